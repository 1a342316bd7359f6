"""ops/bench/chaos.py: the short mode end to end (slow), and its pieces that need no run (fast)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from common import lifeline
from common.config import ConfigError, load_config
from ops.bench import chaos as chaos_mod
from ops.bench.chaos import ROOT, main, settings, start_reference, step_gaps_lost
from ops.chaos.cluster import CONFIG as CLUSTER_CONFIG
from ops.chaos.cluster import OVERRIDES as CLUSTER_OVERRIDES
from ops.chaos.cluster import workload_overrides
from ops.chaos.procs import mentioning
from ops.rehearsal.cluster import missing_prerequisites
from tests.polling import wait_for


def _args(**kw: object) -> argparse.Namespace:
    base = {"short": False, "minutes": None, "steps": 0, "step_s": 0.0, "interval_s": 0.0, "baseline": None,
            "cluster": False, "config": "", "overrides": []}
    return argparse.Namespace(**{**base, **kw})


def test_short_mode_fits_five_minutes_of_faults_and_the_full_mode_about_fifty() -> None:
    a = settings(_args(short=True))
    assert (a.minutes, a.steps, a.interval_s, a.baseline) == (4.0, 24, 15.0, "base")
    a = settings(_args())
    assert (a.minutes, a.steps, a.interval_s, a.baseline) == (60.0, 1200, 72.0, "run")  # 3 s a step
    assert a.config == "ops/configs/default.yaml"


def test_a_cluster_run_sizes_its_steps_for_the_cluster_and_takes_the_rehearsals_topology() -> None:
    a = settings(_args(short=True, cluster=True))
    assert (a.minutes, a.steps, a.config) == (4.0, 30, "ops/configs/rehearsal.yaml")  # 4 min at 8 s a step
    assert settings(_args(cluster=True)).steps == 450


def test_the_cluster_runs_the_default_critic_in_the_form_its_zero3_learner_can_hold() -> None:
    """The default critic's frozen base model is a whole copy per rank, which ZeRO-3 refuses: laid over the
    rehearsal's ZeRO-3 learner, the default workload reads its surprise features from the behaviour log-probs,
    and keeps the rest of its critic (K_v, lr, value pretraining)."""
    default = load_config(ROOT / "ops/configs/default.yaml")
    assert default.learner.value_head_surprise_source == "frozen_base"
    with pytest.raises(ConfigError, match="frozen_base keeps a whole frozen copy"):
        load_config(ROOT / CLUSTER_CONFIG, ["learner.value_head_surprise=true", "learner.value_head_surprise_source=frozen_base"])
    cfg = load_config(ROOT / CLUSTER_CONFIG, [*CLUSTER_OVERRIDES, *workload_overrides()])
    assert (cfg.learner.zero_stage, cfg.learner.value_head_surprise_source) == (3, "behaviour")
    assert (cfg.learner.critic_updates, cfg.learner.critic_lr, cfg.value_pretrain.pool_groups) == (
        default.learner.critic_updates, default.learner.critic_lr, default.value_pretrain.pool_groups)


def test_live_sglang_engines_size_the_steps_at_twelve_seconds_and_space_the_faults() -> None:
    a = settings(_args(config="ops/configs/sglang-cpu.yaml"))
    assert (a.step_s, a.steps, a.interval_s) == (12.0, 300, 72.0)
    assert settings(_args(overrides=["engine.kind=sglang"])).steps == 300
    assert settings(_args(short=True, config="ops/configs/sglang-cpu.yaml")).steps == 24
    # Faults at least 30 s apart there: an actor's or engine's return takes 20-70 s.
    assert settings(_args(minutes=8.0, config="ops/configs/sglang-cpu.yaml")).interval_s == 30.0
    assert settings(_args(minutes=8.0)).interval_s == 9.6


def test_a_missing_sglang_install_is_a_skipped_line_not_a_failed_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(chaos_mod, "missing_modules", lambda python: ["sglang", "sgl_kernel"])
    assert main(["--short", "--config", "ops/configs/sglang-cpu.yaml"]) == 3
    line = json.loads(capsys.readouterr().out)
    assert line["pass"] is False and "has no sglang, sgl_kernel (ops/setup.sh --sglang)" in line["skipped"]


def test_the_baseline_alongside_runs_while_the_chaos_run_does(monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = threading.Event(), threading.Event()

    def baseline(*_: object) -> float:
        started.set()
        release.wait(30)
        return 0.7
    monkeypatch.setattr(chaos_mod, "baseline_accuracy", baseline)
    reference = start_reference(_args(baseline="alongside", reference_accuracy=None), [], Path("."), time.time() + 60,
                                None)
    assert started.wait(30)  # under way once start_reference returned: the chaos run starts beside it
    release.set()
    assert reference is not None and reference() == 0.7
    given = start_reference(_args(baseline="run", reference_accuracy=0.5), [], Path("."), 0.0, None)
    assert given is not None and given() == 0.5  # a known figure: no baseline run at all
    assert start_reference(_args(baseline="base", reference_accuracy=None), [], Path("."), 0.0, None) is None


def test_options_the_cluster_cannot_take_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, why in ((["--cluster", "--baseline", "alongside"], "needs a second cluster"),
                      (["--cluster", "engine.kind=sglang"], "--cluster runs rollout_server engines")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and why in capsys.readouterr().err


def test_time_lost_is_the_step_gaps_beyond_twice_the_median(tmp_path: Path) -> None:
    times = [0, 1, 2, 3, 13, 14, 15]  # one 10 s gap: 9 s more than the 1 s median
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "learner_step", "weight_version": i + 1, "time": t}) + "\n" for i, t in enumerate(times)))
    assert step_gaps_lost(tmp_path) == 9.0


def test_an_unknown_fault_kind_is_refused_naming_the_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--faults", "kill_buffer,flood"])
    assert e.value.code == 2 and "unknown fault kind(s) ['flood']" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # its ports are inside the hosts' namespaces
        main(["--cluster", "--faults", "slow_metrics"])
    assert e.value.code == 2 and "['slow_metrics'] on a cluster" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a host fault needs the hosts
        main(["--faults", "partition"])
    assert e.value.code == 2 and "['partition'] here" in capsys.readouterr().err


@pytest.mark.slow
def test_an_interrupted_chaos_run_stops_its_launchers_in_order(tmp_path: Path) -> None:
    """SIGTERM (or Ctrl-C) while the run and its baseline alongside are up: both launchers stop in order,
    no process of either run is left, and the line says it was interrupted and names the root it kept (without
    --keep: an interrupted run's logs are what its user reads next) (1-2 min here)."""
    root = tmp_path / "root"
    p = subprocess.Popen([sys.executable, "-m", "ops.bench.chaos", "--short", "--baseline", "alongside",
                          "--root", str(root)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         **lifeline.popen_kwargs())
    try:
        logs = [root / "chaos-launcher.log", root / "baseline-launcher.log"]
        wait_for(lambda: all(f.is_file() and "learner started" in f.read_text() for f in logs), 600,
                 "both runs' learners to start")
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    line = json.loads(out.strip().splitlines()[-1])
    assert p.returncode == 130 and line["interrupted"] is True and line["root"] == str(root)
    assert mentioning(str(root)) == []
    assert all("interrupted: stopping every component" in f.read_text() for f in logs)  # in order, not killed


@pytest.mark.slow
def test_short_chaos_run_passes_every_invariant_with_at_least_three_faults(tmp_path: Path) -> None:
    """≤ 5 minutes of the default workload under the nemesis (4-6 min on 2 shared cores)."""
    out = tmp_path / "chaos.json"
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "ops.bench.chaos", "--short", "--seed", "3", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    line = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"CHAOS {time.time() - t0:.0f} s " + json.dumps(line), flush=True)
    record = json.loads(out.read_text())
    assert p.returncode == 0 and line["pass"], json.dumps(record["details"], indent=1)[-6000:] + p.stderr[-3000:]
    assert line["faults_total"] >= 3, record["details"]["fault_log"]
    assert all(line["invariants"].values()) and len(line["invariants"]) == 8
    assert line["rc"] == 0 and line["groups"]["served"] > 0


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or bool(missing_prerequisites()), reason="needs root and the rehearsal's packages")
def test_short_chaos_run_on_the_rehearsal_cluster_passes_every_invariant() -> None:
    """≤ 5 minutes of faults on four hosts (network namespaces), host faults among them (5-7 min here)."""
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "ops.bench.chaos", "--cluster", "--short", "--seed", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    line = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"CHAOS CLUSTER {time.time() - t0:.0f} s " + json.dumps(line), flush=True)
    assert p.returncode == 0 and line["pass"], json.dumps(line) + p.stderr[-3000:]
    assert line["hosts"] == 4 and line["faults_total"] >= 3 and len(line["invariants"]) == 8


@pytest.mark.slow
@pytest.mark.sglang
def test_short_chaos_run_on_a_live_sglang_engine_passes_every_invariant(tmp_path: Path) -> None:
    """Engine faults (SIGKILL, SIGSTOP of its HTTP server) on the default workload served by the real SGLang
    server (8-12 min here); the other kinds hit what rollout_server runs also have. Each engine kill costs a
    ~1-minute SGLang start in which no engine fault is picked: 40 steps and 6 minutes make room for 3."""
    out = tmp_path / "chaos.json"
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "ops.bench.chaos", "--short", "--minutes", "6", "--steps", "40",
                        "--seed", "1", "--config", "ops/configs/sglang-cpu.yaml", "--faults", "kill_engine,stop_engine",
                        "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=2400)
    line = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"CHAOS SGLANG {time.time() - t0:.0f} s " + json.dumps(line), flush=True)
    record = json.loads(out.read_text())
    assert p.returncode == 0 and line["pass"], json.dumps(record["details"], indent=1)[-6000:] + p.stderr[-3000:]
    assert line["faults_total"] >= 3 and set(line["faults"]) <= {"kill_engine", "stop_engine"}, record["details"]
