"""common.tasks (the package): ``get_task`` builds a task from its name and refuses unknown names, a bad
held-out split, unknown generators and missing files."""

from __future__ import annotations

import pytest

from common.config import TaskConfig
from common.tasks import get_task


def test_get_task_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        get_task(TaskConfig(name="nope"))
    with pytest.raises(ValueError, match="eval_buckets"):
        get_task(TaskConfig(eval_buckets=1))
    with pytest.raises(ValueError, match="unknown generator"):
        get_task(TaskConfig(name="reasoning_gym:no_such_generator"))
    with pytest.raises(ValueError, match="not found"):
        get_task(TaskConfig(name="jsonl:/no/such/file.jsonl"))
