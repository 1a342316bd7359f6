"""The GPU memory estimate of a placement (``common.gpu_memory``): parameter counts of published models, model
states by ZeRO stage, a critic of its own shape in the check, and a micro-batch's activations by how many layers
recompute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from common.gpu_memory import (
    GIB,
    activation_bytes,
    check_memory,
    count_parameters,
    layer_activation_elements,
    model_state_bytes,
)
from tests.common.placement_fixtures import QWEN_05B, QWEN_7B, QWEN_32B


def test_parameter_counts_match_the_published_models() -> None:
    assert count_parameters(QWEN_05B)["policy"] == 494_032_768
    assert count_parameters(QWEN_7B)["policy"] == 7_615_616_512
    assert count_parameters(QWEN_32B)["policy"] == 32_763_876_352
    # The critic is the backbone (no untied LM head) plus a Linear(hidden, 1).
    assert count_parameters(QWEN_32B)["critic"] == 32_763_876_352 - 152064 * 5120 + 5120 + 1
    assert count_parameters(QWEN_05B)["critic"] == 494_032_768 + 896 + 1  # tied: the embedding stays


def test_model_state_bytes_by_zero_stage() -> None:
    # 16 bytes a parameter in all; bf16: weights 2, grads 2, fp32 master + Adam moments 12.
    assert model_state_bytes(1000, 0, 4, "bf16") == 16000
    assert model_state_bytes(1000, 1, 4, "bf16") == 1000 * (2 + 2 + 12 / 4)
    assert model_state_bytes(1000, 2, 4, "bf16") == 1000 * (2 + 14 / 4)
    assert model_state_bytes(1000, 3, 4, "bf16") == 4000
    assert model_state_bytes(1000, 1, 2, "fp32") == 1000 * (4 + 4 + 8 / 2)


def test_a_critic_of_its_own_shape_is_counted_in_the_memory_check(tmp_path: Path) -> None:
    """model.critic_path: the learner holds the critic's own parameters (a 32B critic beside a 7B policy), and
    its larger embedding is the ZeRO-3 build transient."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN_32B))

    def check(*extra: str) -> dict:
        cfg = load_config(None, ["learner.zero_stage=3", "learner.precision=bf16", "model.dtype=bfloat16",
                                 "placement.gpu_memory_gib=1000", *extra])
        return check_memory(cfg, [], [], list(range(8)), QWEN_7B)

    same, big = check(), check(f"model.critic_path={tmp_path}")
    assert same["critic_params_b"] == round(count_parameters(QWEN_7B)["critic"] / 1e9, 3)
    assert big["critic_params_b"] == round(count_parameters(QWEN_32B)["critic"] / 1e9, 3)
    grown = model_state_bytes(count_parameters(QWEN_32B)["critic"] - count_parameters(QWEN_7B)["critic"], 3, 8, "bf16")
    assert big["learner_states_gib_per_gpu"] - same["learner_states_gib_per_gpu"] == pytest.approx(grown / GIB, abs=0.02)
    transient = (152064 * 5120 - 152064 * 3584) * 2 / GIB  # the 32B embedding instead of the 7B one
    assert (big["learner_build_peak_gib_per_gpu"] - big["learner_states_gib_per_gpu"]
            - same["learner_build_peak_gib_per_gpu"] + same["learner_states_gib_per_gpu"]) == pytest.approx(transient, abs=0.02)


def test_activations_follow_the_checkpointed_layers_and_refuse_what_cannot_fit() -> None:
    """Qwen2.5-32B (h 5120, q 5120, kv 1024, intermediate 27648, 64 layers): a layer keeps 4·5120 + 2·5120 +
    2·1024 + 4·27648 = 143,360 elements a token, a checkpointed one its input, 5120. At 24,576 tokens in bf16 with
    every layer recomputed: (64 · 5120 + 143,360) · 2 bytes a token, plus a 2^26-element logit chunk and its softmax
    (2 · 4 bytes each) = 22.06 GiB; recomputing every 2nd layer keeps 32 layers whole: 224 GiB, refused on 80 GiB."""
    assert layer_activation_elements(QWEN_32B) == (143_360, 5120)
    every1 = activation_bytes(QWEN_32B, 24_576, True, 1, "bf16", 1 << 26)
    assert every1 == 24_576 * (64 * 5120 + 143_360) * 2 + 8 * (1 << 26)
    assert every1 / GIB == pytest.approx(22.06, abs=0.01)
    every2 = activation_bytes(QWEN_32B, 24_576, True, 2, "bf16", 1 << 26)
    assert every2 == 24_576 * (32 * 143_360 + 32 * 5120 + 143_360) * 2 + 8 * (1 << 26)
    assert activation_bytes(QWEN_32B, 24_576, False, 1, "bf16", 0) == 24_576 * 64 * 143_360 * 2

    def check(*extra: str) -> dict:
        cfg = load_config(None, ["learner.zero_stage=3", "learner.precision=bf16", "model.dtype=bfloat16",
                                 "learner.micro_batch_tokens=24576", "learner.activation_checkpointing=true",
                                 "learner.logits_chunk_elements=67108864", "placement.gpu_memory_gib=80", *extra])
        return check_memory(cfg, [], [], list(range(48)), QWEN_32B)

    assert check()["learner_activations_gib_per_gpu"] == pytest.approx(22.06, abs=0.01)
    with pytest.raises(ConfigError, match="learner.micro_batch_tokens: a training micro-batch's activations"):
        check("learner.activation_checkpointing_every=2")
