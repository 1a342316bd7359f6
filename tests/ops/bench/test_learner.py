"""ops/bench/learner.py: its ``--quick`` mode builds DeepSpeed and plain learners and prints one JSON line with
the fields every ratio benchmark shares (ops/bench/measure.py); slow (~2 min on 2 shared cores)."""

from __future__ import annotations

import pytest

from tests.ops.bench.quick_fixtures import check_common, run_quick


@pytest.mark.slow  # DeepSpeed and plain learners built and stepped: ~2 min on 2 shared cores
def test_learner_quick() -> None:
    line = run_quick(["-m", "ops.bench.learner"], 600)
    check_common(line, "learner", "deepspeed_over_plain", ">= 0.8")
    assert line["steps"] == 2 and line["deepspeed_tokens_per_s"] > 0 and line["plain_torch_tokens_per_s"] > 0
