"""ops/bench/engines.py: its ``--quick`` mode starts SGLang and runs 2 rounds of three phases, printing one JSON
line with the fields every ratio benchmark shares (ops/bench/measure.py); slow, and needs SGLang."""

from __future__ import annotations

import pytest

from tests.ops.bench.quick_fixtures import check_common, run_quick


@pytest.mark.slow  # starts SGLang (~1 min) and runs 2 rounds of three phases
@pytest.mark.sglang
def test_engines_quick() -> None:
    from ops.sglang_cpu.live import skip_reason

    if (reason := skip_reason()) is not None:
        pytest.skip(reason)
    line = run_quick(["-m", "ops.bench.engines"], 900)
    check_common(line, "engines", "actor_over_raw_sglang", ">= 0.9")
    assert [r["order"] for r in line["per_round"]] == ["rollout_server,sglang,actor", "actor,sglang,rollout_server"]
    assert line["sglang_tokens_per_s"] > 0 and line["rollout_server_tokens_per_s"] > 0
