"""``python -m actors`` command line: help, bad input, and the all-workers mode's exit code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actors", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_help_and_bad_input() -> None:
    r = _run("--help")
    assert r.returncode == 0 and "--actor-id" in r.stdout and "weight_sync=wait|abort" in r.stdout
    r = _run("--actor-id", "x")
    assert r.returncode != 0 and "--actor-id needs an integer" in r.stderr
    r = _run("actors.num_actors=2", "--actor-id", "2")
    assert r.returncode == 2 and "outside [0, actors.num_actors=2)" in r.stderr
    r = _run("actors.weight_sync=sometimes", "--actor-id", "0")
    assert r.returncode == 2 and "actors.weight_sync" in r.stderr
    r = _run("--frobnicate")
    assert r.returncode != 0 and "unknown option --frobnicate" in r.stderr


def test_all_workers_mode_reports_a_worker_that_fails_for_good(tmp_path: Path) -> None:
    # external engine URLs missing for actor 1: that worker cannot start; restarts are bounded.
    r = _run(f"run.root={tmp_path}", "actors.num_actors=2", "engine.kind=external", "engine.urls=[]",
             "actors.max_worker_restarts=1", "metrics.prometheus=false")
    assert r.returncode == 1
    assert "worker 0 failed for good" in r.stderr and "worker 1 failed for good" in r.stderr
    assert "restart 1/1" in r.stderr and "engine.urls has 0 URLs" in r.stderr
