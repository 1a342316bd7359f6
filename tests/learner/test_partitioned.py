"""Building a ZeRO-3 policy and critic partitioned: each rank's peak memory while building stays near its own
partitions instead of the whole model (ops/bench/zero_build.py, old and new build in one run, 2 CPU ranks).

Before, every rank loaded the whole model with from_pretrained and ZeRO-3 partitioned it only in
deepspeed.initialize: ~1.5 × the full fp32 model per rank per module here, and the value-pretraining critic
stayed resident after pretraining."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.partitioned import load_checkpoint
from tests.learner.synth import child_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_partitioned_build_peak_is_under_three_quarters_of_the_model() -> None:
    p = subprocess.run([sys.executable, "-m", "ops.bench.zero_build", "--hidden", "384", "--layers", "8", "--vocab", "4000"],
                       env=child_env(), capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["new"]["peak_rise_over_full_model"] <= 0.75, r
    assert r["old"]["peak_rise_over_full_model"] >= 1.2, r  # the measurement sees the whole-model build
    assert r["new"]["pretrain_critic_left_over_full_model"] < r["old"]["pretrain_critic_left_over_full_model"] - 0.5, r


def test_load_checkpoint_fills_every_tensor_and_names_missing_ones(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tiny_model_dir)))
    load_checkpoint(model, tiny_model_dir)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True))
    broken = tmp_path / "broken"
    broken.mkdir()
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    dropped = sorted(state)[-1]
    save_file({k: v for k, v in state.items() if k != dropped}, str(broken / "model.safetensors"))
    with pytest.raises(KeyError, match="missing"):
        load_checkpoint(model, broken)


def test_the_placement_check_counts_the_build_transient() -> None:
    # A ZeRO-3 learner builds the critic beside the policy's states; its embedding is whole on the GPU for a
    # moment. A budget that fits the steady states but not that transient is refused.
    from common.config import ConfigError, load_config
    from common.gpu_memory import GIB, check_memory, count_parameters, model_state_bytes

    hf = dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
              num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)
    n = count_parameters(hf)
    world = 4
    states = sum(model_state_bytes(n[k], 3, world, "bf16") for k in ("policy", "critic")) / GIB
    transient = n["vocab"] * n["hidden"] * 2 / GIB

    def check(gib: float) -> dict:
        # A 1024-token micro-batch, recomputed: ~0.5 GiB of activations, within the room the transient leaves.
        cfg = load_config(None, ["learner.zero_stage=3", "learner.precision=bf16", "model.dtype=bfloat16",
                                 f"placement.gpu_memory_gib={gib}", "placement.learner_memory_fraction=1.0",
                                 "learner.micro_batch_tokens=1024", "learner.activation_checkpointing=true"])
        return check_memory(cfg, [], [], list(range(world)), hf)

    mem = check(states + 2 * transient)
    assert mem["learner_build_peak_gib_per_gpu"] == pytest.approx(states + transient, abs=0.01)
    with pytest.raises(ConfigError, match="learner_gpus"):
        check(states + transient / 2)
