"""`ops/launch.sh CONFIG --dry-run`: the whole process plan, nothing started, nothing written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _launch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "ops" / "launch.sh"), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("config,ranks,engines", [("gpu-small.yaml", 1, 1), ("gpu-node8.yaml", 6, 2),
                                                  ("paper.yaml", 28, 9)])
def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path, config: str, ranks: int, engines: int) -> None:
    # Flags may follow the overrides (`CONFIG key=val --dry-run`), as they may precede them.
    p = _launch(f"ops/configs/{config}", f"run.root={tmp_path / 'runs'}", "--dry-run")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert f"{ranks} learner rank(s)" in out
    assert out.count("sglang.launch_server") == engines
    assert "deepspeed.launcher.runner" in out and "DS_ACCELERATOR=cpu" not in out
    assert not (tmp_path / "runs").exists()  # nothing written


def test_dry_run_refuses_a_placement_that_cannot_work(tmp_path: Path) -> None:
    p = _launch("ops/configs/gpu-node8.yaml", "--dry-run", "placement.learner_gpus=1-7", f"run.root={tmp_path}")
    assert p.returncode == 2
    assert "placement.engine_gpus/learner_gpus" in p.stderr and "share_gpus" in p.stderr


def test_resume_flag_after_the_overrides_is_accepted(tmp_path: Path) -> None:
    # Used to fail with "unrecognized arguments": flags only worked before the positionals.
    p = _launch("ops/configs/smoke.yaml", f"run.root={tmp_path}", "--dry-run", "--resume")
    assert p.returncode == 0, p.stderr
    assert " -m learner " in p.stdout and "DS_ACCELERATOR=cpu" in p.stdout  # the CPU plan: one learner process
