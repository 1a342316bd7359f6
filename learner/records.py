"""``<run dir>/metrics.jsonl``: one JSON object per line, appended by rank 0 of the learner.

Not a CLI. Records carry a ``kind``: ``learner_step`` and ``eval`` (``learner.runner``), ``value_pretrain``
(``learner.value_pretrain``); ``ops/report.py`` and ``ops/launch.py`` read them. Its own module because
both writers use it and ``learner.runner`` sits above ``learner.value_pretrain``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line; numbers that JSON lacks (numpy, tensors) are written as floats."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps(record, default=float) + "\n")
