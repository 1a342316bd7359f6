"""ops/bench/gpu_check.py: the prepared GPU check runs end to end (on CPU here) and refuses a missing GPU clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ports import port_overrides

ROOT = Path(__file__).resolve().parents[3]
CHECK = ("-m", "ops.bench.gpu_check")


def _run(*args: str) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, *CHECK, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def test_cpu_dry_run_reports_every_figure(tmp_path: Path) -> None:
    rc, out = _run("--device", "cpu", "--hidden", "32", "--layers", "1", "--sft-steps", "10", "--steps", "2",
                   "--value-steps", "1", "--root", str(tmp_path), "learner.batch_groups=4",
                   "value_pretrain.batch_groups=4", "value_pretrain.eval_groups=4", "task.eval_size=16",
                   "learner.eval_k=1", *port_overrides())
    assert rc == 0 and out["ok"], out
    assert out["engine_device"] == "cpu" and out["sft_device"] == "cpu" and out["learner_steps"] == 2
    assert out["parameters"] > 0 and out["learner_step_seconds"] > 0 and out["actor_samples_per_s"] > 0
    assert [s for s, _ in out["heldout_avg_at_k"]] == [0, 2]
    assert {"critic_update", "actor_update"} <= set(out["learner_phase_seconds"])
    assert (tmp_path / "_base" / "cpu-h32-l1" / "config.json").is_file()  # the bootstrap lives under --root


def test_cuda_without_a_gpu_is_a_clear_refusal(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the real check instead")
    rc, out = _run("--device", "cuda", "--root", str(tmp_path))
    assert rc == 2 and out["ok"] is False and "no CUDA device" in out["error"]
    assert not any(tmp_path.iterdir())  # nothing launched
