"""The balance estimate of a placement (``common.balance``; printed by ``ops/launch.sh CONFIG --dry-run``),
checked against numbers worked out by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common import balance
from common.balance import Pass, Shape
from common.config import ConfigError, load_config
from common.gpu_memory import count_parameters
from common.microplan import Rows, Workload
from common.placement import build_plan
from tests.common.placement_fixtures import QWEN_32B

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "ops" / "configs" / "paper.yaml"
pytestmark = pytest.mark.usefixtures("pdsh_on_path")


def _rows(prompts: list[int], responses: list[int], cap: int = 1 << 30) -> Rows:
    r = np.array(responses)
    return Rows(np.array(prompts), r, r >= cap, 0.0, 1.0)


def test_generation_is_the_larger_of_flops_and_memory_traffic_by_hand() -> None:
    cfg = load_config(PAPER, ["placement.gpu_peak_tflops=100", "placement.engine_utilization=0.5",
                              "placement.gpu_memory_bandwidth_gbps=1000", "placement.engine_bandwidth_utilization=0.5",
                              "actors.prompts_in_flight=1", "actors.group_size=2", "engine.sglang_tp_size=1",
                              "engine.sglang_mem_fraction_static=0.5"])
    shape = Shape(layers=10, q_dim=1000, kv_dim=200, policy=1e9, critic=1e9, wbytes=2)
    rows = _rows([100, 100], [1000, 3000])
    g = balance.generation_time(cfg, rows, shape, engine_gpus=2)
    # Decode step t of a row attends to P + t tokens: 100*1000 + 1000*999/2 + 100*3000 + 3000*2999/2 = 5,398,000.
    # FLOPs: 2e9 x (200 prompt + 4000 response tokens) + 4 x 10 x 1000 x (5,398,000 + 2 x 100^2/2 of prefill)
    #      = 8.4e12 + 2.1632e11 = 8.61632e12, at 2 GPUs x 100 TFLOP/s x 0.5 = 1e14 FLOP/s: 0.0861632 s.
    assert g["generation_flop_s"] == pytest.approx(0.0861632)
    # Memory: 2 requests running (prompts_in_flight x group_size; the KV room, 80 GiB x 0.5 - 2 GB of weights,
    # holds far more); the KV cache, 2 x 10 layers x 200 x 2 bytes = 8,000 bytes a token, is read for every
    # decode step's context: 5,398,000 x 8,000 = 4.3184e10 bytes; the 2e9 bytes of weights once per
    # iteration: 4,000 tokens / 2 running = 2,000 iterations, 4e12 bytes. At 2 x 1000 GB/s x 0.5: 4.043184 s.
    assert g["running_per_engine"] == 2.0
    assert g["generation_memory_s"] == pytest.approx(4.043184)
    assert g["generation_s"] == g["generation_memory_s"]
    # A KV room for ~13.7 running requests: 4 GiB x 0.5 - 2e9 bytes = 147,483,648 bytes over 8,000 bytes x the
    # mean context of a decoding request, 5,398,000 / 4,000 = 1,349.5 tokens.
    cfg = load_config(PAPER, ["placement.gpu_memory_gib=4", "engine.sglang_mem_fraction_static=0.5",
                              "engine.sglang_tp_size=1"])
    g = balance.generation_time(cfg, rows, shape, engine_gpus=2)
    assert g["running_per_engine"] == pytest.approx(147_483_648 / (8000 * 1349.5))


def _learner_cfg(*extra: str) -> list[str]:
    return ["learner.mini_batches=1", "learner.micro_batch_tokens=100", "learner.no_grad_micro_batch_tokens=0",
            "placement.gpu_peak_tflops=1", "placement.learner_utilization=1", *extra]


def test_learner_time_from_the_plan_by_hand() -> None:
    """Rows of 100, 50, 50, 20 tokens over 2 ranks, a workload of 1e12 FLOPs a token: dealt [100, 20] and
    [50, 50]; the 100-token training budget cuts both in 2 ([100] [20], [50] [50]: index costs 100 + 50), the
    200-token no-grad budget in 1 ([120], [100]: 120). The ideal is 220 / 2 = 110 a rank."""
    cfg = load_config(PAPER, _learner_cfg("learner.zero_stage=2"))
    shape = Shape(layers=1, q_dim=0, kv_dim=0, policy=0.5e12, critic=0.5e12, wbytes=2)
    rows = _rows([10, 10, 10, 10], [90, 40, 40, 10])
    t = balance.learner_time(cfg, rows, shape, world=2)
    assert t["plan_over_ideal_train"] == pytest.approx(150 / 110) and t["plan_over_ideal_no_grad"] == pytest.approx(120 / 110)
    assert (t["slots_per_rank_train"], t["slots_per_rank_no_grad"]) == (2, 1)
    # At 1e12 FLOP/s: training passes 150 x (1 + 2 + 1 recomputed) = 600 s; no-grad passes 120 s.
    assert t["passes_s"] == pytest.approx({"values": 120.0, "critic_update": 600.0, "proximal": 120.0,
                                           "actor_update": 600.0})
    assert t["learner_s"] == pytest.approx(1440.0)
    # ZeRO-3 at 1 MB/s: a gather of 2 bytes x 0.5e12 parameters x 1/2 received is 5e5 s; a training micro-batch
    # gathers twice (forward, backward), a no-grad one once: the gathers bind.
    cfg = load_config(PAPER, _learner_cfg("learner.zero_stage=3", "placement.learner_gather_gbps=0.001"))
    t = balance.learner_time(cfg, rows, shape, world=2)
    assert t["passes_s"]["actor_update"] == pytest.approx(2 * 2 * 5e5) and t["passes_s"]["values"] == pytest.approx(5e5)


def test_passes_follow_the_algorithm() -> None:
    def kinds(*overrides: str, layers: int = 64) -> list[tuple[str, str, float]]:
        return [(p.name, p.plan, p.forwards) for p in balance.passes(load_config(PAPER, list(overrides)), layers)]

    # paper.yaml: value pass (actor_values=pre_update), checkpointed training passes (3 + 1), recomputed pi_old.
    assert kinds() == [("values", "no_grad", 1.0), ("critic_update", "train", 4.0), ("proximal", "no_grad", 1.0),
                       ("actor_update", "train", 4.0)]
    assert kinds("learner.off_policy=behaviour", "algo.actor_values=post_update") == [
        ("critic_update", "train", 4.0), ("fresh_values", "no_grad", 1.0), ("actor_update", "train", 4.0)]
    # Every 3rd of 64 layers recomputed: ceil(64 / 3) = 22 of them.
    assert kinds("learner.activation_checkpointing_every=3")[1] == ("critic_update", "train", 3.0 + 22 / 64)
    assert kinds("algo.advantage=grpo", "learner.ppo_epochs=2", "learner.activation_checkpointing=false",
                 "learner.off_policy=decoupled") == [("proximal", "no_grad", 1.0), ("actor_update", "train", 6.0)]
    assert balance.passes(load_config(PAPER), 64)[1] == Pass("critic_update", "critic", "train", 4.0, 2)


def test_shape_workload_is_the_models() -> None:
    shape = Shape.of(QWEN_32B, count_parameters(QWEN_32B), "bfloat16")
    assert (shape.layers, shape.q_dim, shape.kv_dim, shape.wbytes) == (64, 5120, 1024, 2)
    assert shape.work("policy") == Workload.of_model(QWEN_32B)
    assert shape.work("critic") == Workload.of_model(QWEN_32B, "critic")


def test_paper_split_is_balanced_and_the_old_one_is_flagged() -> None:
    """paper.yaml's learner/engine split at its assumed 5,000-token mean: neither side idles over half the
    time, and the bound flips near there; the earlier 28/36 split leaves the engines idle most of the time."""
    cfg = load_config(PAPER)
    plan = build_plan(cfg, "/run/config.yaml", "/venv/bin/python", ROOT, Path("/run"), hf_config=QWEN_32B)
    b = plan.balance
    assert (b["engine_gpus"], b["learner_gpus"], b["samples_per_step"]) == (16, 48, 512 * 16)
    assert b["idle_fraction"] <= balance.IDLE_WARN
    assert b["plan_over_ideal_train"] <= 1.10 and b["slots_per_rank_train"] > b["slots_per_rank_no_grad"]
    assert b["generation_memory_s"] > b["generation_flop_s"]  # decoding reads the KV cache: memory-bound
    assert b["bound_below"] == "learner" and 2000 < b["flip_response_tokens"] < 10000
    out = plan.render()
    assert "learner ~" in out and "generation ~" in out and "WARNING" not in out
    assert f"turns from learner-bound to generation-bound at a mean response length of ~{b['flip_response_tokens']}" in out
    old = load_config(PAPER, ["placement.learner_gpus=4-31", "placement.engine_gpus=0-3,32-63", "actors.num_actors=9"])
    plan = build_plan(old, "/run/config.yaml", "/venv/bin/python", ROOT, Path("/run"), hf_config=QWEN_32B)
    assert plan.balance["idle_side"] == "engines" and plan.balance["idle_fraction"] > 0.6
    assert "WARNING: the engines would idle" in plan.render()


def test_the_flip_is_where_the_bound_changes_side() -> None:
    cfg = load_config(PAPER)
    shape = Shape.of(QWEN_32B, count_parameters(QWEN_32B), "bfloat16")
    f = balance.flip(cfg, shape, 16, 48)["flip_response_tokens"]
    assert balance.gap(cfg, shape, 16, 48, 0.9 * f) < 0 < balance.gap(cfg, shape, 16, 48, 1.1 * f)
    # Twice the engines: generation binds only at longer responses.
    assert balance.flip(cfg, shape, 32, 48)["flip_response_tokens"] > f
    # One side over the whole range: said, with no length.
    few = balance.flip(cfg, shape, 16, 4)
    assert few["flip_response_tokens"] is None and few["bound_below"] == "learner"
    assert "learner-bound at every mean response length from 205 to 18432 tokens" in "\n".join(
        balance.describe({**balance.estimate(cfg, 16, 4, count_parameters(QWEN_32B), QWEN_32B)}))


@pytest.mark.parametrize("override,key", [("placement.gpu_memory_bandwidth_gbps=0", "placement.gpu_memory_bandwidth_gbps"),
                                          ("placement.engine_bandwidth_utilization=1.5", "placement.engine_bandwidth_utilization"),
                                          ("placement.learner_gather_gbps=-1", "placement.learner_gather_gbps"),
                                          ("placement.est_response_tokens=20480", "placement.est_response_tokens")])
def test_the_estimates_keys_are_checked(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(PAPER, [override])  # a mean response length at the cap (20,480) cannot be drawn below it
