"""ops/bench/suites/weight_sync_suite.py: the drain and in-place arms, the opt-in engine-bound pair, its listing and summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from common.config import load_config
from tests.ops.bench.bench_fixtures import ROOT, load_experiments


@pytest.fixture(scope="module")
def exp() -> ModuleType:
    return load_experiments()


def test_weight_sync_suite_engine_bound_arms_resolve_and_are_opt_in(exp: ModuleType, tmp_path: Path) -> None:
    """The engine-bound pair: valid configs on the long task that differ from the default pair only in the
    generation-bound overrides (and from each other only in the weight transport); run only when named."""
    ws = exp.weight_sync_suite
    suite = {e.name: e for e in ws.experiments(exp.Experiment)}
    assert set(suite) == {"ws_long_wait", "ws_long_in_place", "ws_long_wait_engine_bound", "ws_long_in_place_engine_bound"}
    assert ws.OPT_IN == {"ws_long_wait_engine_bound", "ws_long_in_place_engine_bound"}
    base = load_config(ROOT / ws.CONFIG, [])
    for arm in ("wait", "in_place"):
        plain = load_config(ROOT / ws.CONFIG, [*suite[f"ws_long_{arm}"].overrides, f"learner.total_steps={ws.STEPS}"])
        bound = load_config(ROOT / ws.CONFIG, [*suite[f"ws_long_{arm}_engine_bound"].overrides,
                                               f"learner.total_steps={ws.STEPS}"])
        assert bound.learner.weight_transport == plain.learner.weight_transport
        assert (bound.buffer.max_staleness, bound.learner.off_policy, bound.actors.prompts_in_flight) == (4, "decoupled", 32)
        assert (plain.buffer.max_staleness, plain.learner.off_policy) == (base.buffer.max_staleness, base.learner.off_policy)
        # 32 prompts x 8 samples fit the engine's batch: it decodes every sequence the credit allows at once
        assert bound.actors.prompts_in_flight * bound.actors.group_size <= bound.engine.max_batch_size
    out = subprocess.run([sys.executable, "-m", "ops.bench.suites.experiments", "--suite", "weight_sync", "--root",
                          str(tmp_path), "--list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "ws_long_in_place-s1" in out and "engine_bound" not in out
    out = subprocess.run([sys.executable, "-m", "ops.bench.suites.experiments", "--suite", "weight_sync", "--root",
                          str(tmp_path), "--list", "--only", "ws_long_in_place_engine_bound"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() and all(line.startswith("ws_long_in_place_engine_bound-s") for line in out.splitlines())
    summary = ws.summary(tmp_path, exp.load_run)
    assert set(summary) == {"wait", "in_place", "wait_engine_bound", "in_place_engine_bound"}
    assert all(v["seeds_done"] == 0 for v in summary.values())
