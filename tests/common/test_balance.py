"""The balance estimate of a placement (``common.balance``; printed by ``ops/launch.sh CONFIG --dry-run``),
checked against numbers worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import balance
from common.config import load_config
from common.placement import build_plan
from tests.common.placement_fixtures import QWEN_32B

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("pdsh_on_path")


def test_step_flops_and_seconds_by_hand() -> None:
    # N = 1e9 parameters (policy and critic), 10 layers, q = 1000, 10 samples of P = 100 + R = 1000 tokens.
    # Generation per sample: decode 1000 x (2e9 + 4*10*1000*(100 + 500)) = 1000 x 2.024e9 = 2.024e12,
    #                        prefill 100 x (2e9 + 4*10*1000*50)          =  100 x 2.002e9 = 2.002e11;
    #   x 10 samples = 2.2242e13 FLOPs.
    # Learner per sample: 1100 tokens x (2e9 + 4*10*1000*550) = 1100 x 2.022e9 = 2.2242e12 per forward pass;
    #   policy 4 passes (fwd + bwd + recompute) + critic 5 (its value pass too) = 9 -> x 10 samples = 2.00178e14.
    gen, learn = balance.step_flops(1e9, 1e9, 10, 1000, 10, 100, 1000, 4, 5)
    assert gen == pytest.approx(2.2242e13, rel=1e-12)
    assert learn == pytest.approx(2.00178e14, rel=1e-12)
    # 2 engine GPUs and 4 learner GPUs at 100 TFLOP/s peak, half of it used: 1e14 and 2e14 FLOP/s.
    gen_s = balance.seconds(gen, 2, 100, 0.5)
    learn_s = balance.seconds(learn, 4, 100, 0.5)
    assert gen_s == pytest.approx(0.22242) and learn_s == pytest.approx(1.00089)
    side, frac = balance.idle(gen_s, learn_s)
    assert side == "engines" and frac == pytest.approx(1 - 0.22242 / 1.00089)  # ~0.778
    line, warning = balance.describe({"generation_s": gen_s, "learner_s": learn_s, "engine_gpus": 2, "learner_gpus": 4,
                                      "samples_per_step": 10, "response_tokens": 1000, "idle_side": side,
                                      "idle_fraction": frac})
    assert "the engines would idle ~78%" in line
    assert warning is not None and "move GPUs from the engines to the learner" in warning
    assert balance.idle(3.0, 1.0) == ("learner", pytest.approx(2 / 3))


def test_passes_follow_the_algorithm() -> None:
    cfg = load_config(ROOT / "ops" / "configs" / "paper.yaml", ["learner.off_policy=behaviour"])
    assert balance.passes(cfg) == (4.0, 5.0)  # checkpointed: 3 + 1 per epoch; the critic's value pass
    cfg = load_config(ROOT / "ops" / "configs" / "paper.yaml", ["learner.off_policy=rollout_correction"])
    assert balance.passes(cfg) == (5.0, 5.0)  # pi_old recomputed: one more policy forward
    cfg = load_config(ROOT / "ops" / "configs" / "paper.yaml", ["algo.advantage=grpo", "learner.ppo_epochs=2",
                                                                 "learner.activation_checkpointing=false",
                                                                 "learner.off_policy=decoupled"])
    assert balance.passes(cfg) == (2 * 3.0 + 1.0, 0.0)  # no critic; a recomputed pi_old


def test_paper_split_is_balanced_and_the_old_one_is_flagged() -> None:
    """paper.yaml's learner/engine split by the estimate: neither side idles over half the time; the
    earlier 28/36 split left the engines idle ~3/4 of the time."""
    cfg = load_config(ROOT / "ops" / "configs" / "paper.yaml")
    plan = build_plan(cfg, "/run/config.yaml", "/venv/bin/python", ROOT, Path("/run"), hf_config=QWEN_32B)
    b = plan.balance
    assert (b["engine_gpus"], b["learner_gpus"], b["samples_per_step"]) == (16, 48, 512 * 16)
    assert b["idle_fraction"] <= balance.IDLE_WARN
    assert "balance: generation ~" in plan.render() and "WARNING" not in plan.render()
    old = load_config(ROOT / "ops" / "configs" / "paper.yaml", ["placement.learner_gpus=4-31",
                                                                "placement.engine_gpus=0-3,32-63", "actors.num_actors=9"])
    plan = build_plan(old, "/run/config.yaml", "/venv/bin/python", ROOT, Path("/run"), hf_config=QWEN_32B)
    assert plan.balance["idle_side"] == "engines" and plan.balance["idle_fraction"] > 0.7
    assert "WARNING: the engines would idle" in plan.render()
