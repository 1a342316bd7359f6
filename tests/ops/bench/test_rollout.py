"""ops/bench/rollout.py: its ``--quick`` mode runs a rollout_server and HF generate in turn and prints one JSON
line with the fields every ratio benchmark shares (ops/bench/measure.py); slow (~1 min on 2 shared cores)."""

from __future__ import annotations

import pytest

from tests.ops.bench.quick_fixtures import check_common, run_quick


@pytest.mark.slow  # a rollout_server and HF generate in turn: ~1 min on 2 shared cores
def test_rollout_quick() -> None:
    line = run_quick(["-m", "ops.bench.rollout"], 600)
    check_common(line, "rollout", "server_over_hf_generate", ">= 1.5")
    assert line["tokens"] == 2 * 2 * 2 * 8  # clients x prompts x samples x max_new_tokens, on both sides
