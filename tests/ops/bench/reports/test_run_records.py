"""ops/bench/reports/run_records.py: a finished run read back: generated-sample accounting, interpolated
samples-to-accuracy, wall time net of evaluation and from the launch (from hand-made run directories)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from ops.bench.reports import run_records
from tests.ops.bench.bench_fixtures import load_experiments, make_run


@pytest.fixture(scope="module")
def exp() -> ModuleType:
    return load_experiments()


def test_accounting_crossing_and_net_wall_time(exp: ModuleType, tmp_path: Path) -> None:
    make_run(tmp_path / "dapo-s0", {0: 0.4, 2: 0.6, 4: 0.8}, filtered_per_step=1)
    run = exp.load_run(tmp_path / "dapo-s0")
    assert [(p["step"], p["acc"]) for p in run.points] == [(0, 0.4), (2, 0.6), (4, 0.8)]
    # Paid for = trained + value pretraining ((1 step x 2 + 1 held-out) groups x G = 24) + filtered (8 per step).
    assert [p["cost"] for p in run.points] == [24, 24 + 80, 24 + 160] and run.points[-1]["samples"] == 128
    # Everything that reached the learner, stale drops included: G x (consumed + stale + filtered).
    assert run.points[-1]["gen"] == 8 * (19 + 4 + 4) and run.stale_share(4) == pytest.approx(32 / 216)
    # Evaluation pauses are not training time: 10 s per step.
    assert [p["t"] for p in run.points] == pytest.approx([0.0, 20.0, 40.0])
    # 0.7 is halfway from step 2 to step 4.
    assert run.crossing(0.7, "cost") == pytest.approx(24 + 120.0)
    assert run.crossing(0.7, "t") == pytest.approx(30.0)
    assert run.crossing(0.4, "cost") == 24 and run.crossing(0.81, "cost") is None
    assert run.throughput(4) == pytest.approx(128 / 40.0)  # trained samples per learner second
    assert run.final(2)["acc"] == 0.6 and run.final()["acc"] == 0.8 and run.base == 0.4


def test_wall_from_launch_adds_the_suites_bootstrap(exp: ModuleType, tmp_path: Path) -> None:
    import os

    make_run(tmp_path / "vapo-s0", {0: 0.45, 2: 0.6}, step_s=10.0, eval_s=3.0, base_time=1000.0)
    os.utime(tmp_path / "vapo-s0" / "config.yaml", (950.0, 950.0))  # launched 50 s before the base eval
    info = tmp_path / "_base" / "y" / "vapo_info.json"  # the suite's own build of the run's model.path (x/y)
    info.parent.mkdir(parents=True)
    info.write_text(json.dumps({"bootstrap": {"sft_seconds": 300.0}}))
    run = exp.load_run(tmp_path / "vapo-s0")
    # Step 2 is logged at 1000 + 10 + 13; from the launch that is 73 s, plus the 300 s bootstrap.
    assert run.bootstrap_seconds == 300.0 and run.launch_to[2] == pytest.approx(73.0 + 300.0)


def test_wall_from_launch_adds_no_bootstrap_for_a_shipped_base(exp: ModuleType, tmp_path: Path) -> None:
    import os

    make_run(tmp_path / "vapo-s0", {0: 0.45, 2: 0.6}, step_s=10.0, eval_s=3.0, base_time=1000.0)
    cfg_path = tmp_path / "vapo-s0" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["model"]["path"] = "ops/bases/addition-tiny"  # shipped with the repository: no user bootstraps it
    cfg_path.write_text(yaml.safe_dump(cfg))
    os.utime(cfg_path, (950.0, 950.0))
    info = tmp_path / "_base" / "addition-tiny" / "vapo_info.json"  # an old suite bootstrap must not be added
    info.parent.mkdir(parents=True)
    info.write_text(json.dumps({"bootstrap": {"sft_seconds": 300.0}}))
    run = exp.load_run(tmp_path / "vapo-s0")
    assert run.bootstrap_seconds is None and run.launch_to[2] == pytest.approx(73.0)


def test_mean_if_all_needs_every_run_to_reach_the_mark() -> None:
    assert run_records.mean_if_all([1000.0, 3000.0]) == 2000.0
    assert run_records.mean_if_all([1000.0, None]) is None
