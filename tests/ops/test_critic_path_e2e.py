"""A run whose critic is larger than its policy, as a user starts it: grow a base with ``learner.grow``, point
``model.critic_path`` at it, ``ops/launch.sh`` the smoke config. Value pretraining, RL steps and checkpoints
all use the larger critic, and the run records which base it started from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.checksum import weights_sha256
from tests.ports import port_overrides

ROOT = Path(__file__).resolve().parents[2]


# slow: a whole launched run; growing, loading and training a grown critic are tested in tests/learner/test_grow.py.
@pytest.mark.slow
def test_a_smoke_run_trains_a_grown_critic_larger_than_its_policy(tmp_path: Path) -> None:
    critic = tmp_path / "critic"  # the shipped addition base (128 wide, 3 layers) grown to 4 layers
    subprocess.run([sys.executable, "-m", "learner.grow", "ops/bases/addition-tiny", str(critic), "--layers", "4"],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    run = subprocess.run([str(ROOT / "ops/launch.sh"), "ops/configs/smoke.yaml", f"run.root={tmp_path}", "run.name=big",
                          f"model.critic_path={critic}", *port_overrides()], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_dir = tmp_path / "big"
    policy = json.loads((run_dir / "weights" / sorted(p.name for p in (run_dir / "weights").glob("v*"))[-1]
                         / "config.json").read_text())
    pretrained = json.loads((run_dir / "critic_pretrained" / "config.json").read_text())
    assert policy["hidden_size"] == 32 and policy["num_hidden_layers"] == 1  # the smoke policy, unchanged
    assert pretrained["hidden_size"] == 128 and pretrained["num_hidden_layers"] == 4
    ckpt = sorted((run_dir / "checkpoints").glob("v*"))[-1] / "critic" / "state" / "mp_rank_00_model_states.pt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["module"]
    assert state["value_head.weight"].shape == (1, 128) and "backbone.layers.3.mlp.down_proj.weight" in state
    # Trained: the inserted layer (the copy after the last, learner.grow's plan for 3 -> 4) started with a zero
    # down projection; the RL critic's is not zero.
    assert [p["identity"] for p in json.loads((critic / "grow.json").read_text())["plan"]] == [False, False, False, True]
    assert float(state["backbone.layers.3.mlp.down_proj.weight"].abs().sum()) > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] >= 3
    assert summary["provenance"]["critic_base"] == {"path": str(critic), "sha256": weights_sha256(critic)}
