"""learner.compute: a step's token passes and model FLOPs per model, by hand and from a real learner step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.gpu_memory import read_model_config
from learner.batch import Batch, collate
from learner.compute import (
    ModelShape,
    batch_tokens,
    forward_flops,
    model_shape,
    step_model_flops,
    step_token_passes,
)
from learner.synthetic import synth_groups
from learner.train import Learner
from tests.learner.train_fixtures import VOCAB, make_cfg


def test_token_passes_by_hand() -> None:
    """A batch of N tokens, 2 epochs: the value pass, two critic epochs and the fresh values make 4 critic
    forwards and 2 backwards; the proximal pass and two actor epochs 3 policy forwards and 2 backwards."""
    b = collate(synth_groups(2, 3, VOCAB, seed=1), 0)
    n = batch_tokens(b)
    assert n == int((b.prompt_lengths + b.lengths).sum()) > 0
    phases = dict.fromkeys(("values", "critic_update", "fresh_values", "advantages", "proximal", "actor_update"), 0.1)
    out = step_token_passes(b, phases, epochs=2, value_pass=True)
    assert out == {"response_tokens": int(b.lengths.sum()), "policy_forward_tokens": 3 * n,
                   "policy_backward_tokens": 2 * n, "critic_forward_tokens": 4 * n, "critic_backward_tokens": 2 * n}
    # GRPO: no critic phase ran, so no critic pass.
    grpo = step_token_passes(b, {"advantages": 0.1, "actor_update": 0.1}, epochs=1, value_pass=False)
    assert grpo["critic_forward_tokens"] == grpo["critic_backward_tokens"] == 0
    assert grpo["policy_forward_tokens"] == grpo["policy_backward_tokens"] == n


@pytest.mark.parametrize("actor_values, critic_fwd", [("post_update", 2), ("pre_update", 2)])
def test_a_learner_step_records_its_token_passes(tiny_model_dir: Path, actor_values: str, critic_fwd: int) -> None:
    """post_update with Monte-Carlo targets: no value pass, the update, the fresh values (2 forwards);
    pre_update: the value pass and the update (2 forwards). One backward each, one policy pass."""
    groups = synth_groups(4, 3, VOCAB, seed=5)
    stats = Learner(make_cfg(tiny_model_dir, f"algo.actor_values={actor_values}"), None).step(groups)
    n = batch_tokens(collate(groups, 0))
    assert stats["critic_forward_tokens"] == critic_fwd * n and stats["critic_backward_tokens"] == n
    assert stats["policy_forward_tokens"] == stats["policy_backward_tokens"] == n
    assert stats["response_tokens"] == sum(s.response_length for g in groups for s in g.samples)


# ---------------------------------------------------------------------------------------------- model FLOPs

def test_model_shape_of_a_config_by_hand() -> None:
    """V=10, H=8, 2 layers, 2 heads of 4 (q_dim 8), 1 KV head, MLP 16. A layer: q 8·8+8, k and v 2·(8·4+4),
    o 8·8 = 208; MLP 3·8·16 = 384; norms 2·8: 608. Body = 2·608 + the final norm 8 = 1224 (the policy, tied or
    not); the critic adds its value head 8 + 1 = 1233. The LM head is 10·8 = 80."""
    hf = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "intermediate_size": 16, "tie_word_embeddings": True}
    assert model_shape(hf) == ModelShape(body_params=1224, layers=2, q_dim=8, head_params=80)
    assert model_shape({**hf, "tie_word_embeddings": False}) == ModelShape(1224, 2, 8, 80)
    assert model_shape(hf, critic=True) == ModelShape(1233, 2, 8, 80)


def test_model_shape_counts_the_real_model_s_parameters_without_embedding_and_head(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    shape = model_shape(read_model_config(tiny_model_dir))
    assert shape.body_params == body > 0
    assert shape.head_params == model.get_input_embeddings().weight.numel()


def test_forward_flops_by_hand() -> None:
    """2·100·n + 2·2·4·n² + 2·50·h: rows (n=3, h=1) 600 + 144 + 100 = 844 and (n=5, h=2) 1000 + 400 + 200 = 1600."""
    shape = ModelShape(body_params=100, layers=2, q_dim=4, head_params=50)
    assert forward_flops(shape, torch.tensor([3, 5]), torch.tensor([1, 2])) == 2444.0


POLICY, CRITIC = ModelShape(100, 2, 4, 50), ModelShape(120, 2, 4, 50)
ALL_PHASES = dict.fromkeys(("values", "critic_update", "fresh_values", "advantages", "proximal", "actor_update"), 0.1)


def three_rows() -> Batch:
    """Rows of prompt + response 3 + 2, 3 + 2 and 4 + 4 tokens: n = 5, 5, 8 (18 tokens), 8 response tokens."""
    b = collate(synth_groups(1, 2, VOCAB, seed=1, prompt_len=(3, 3), resp_len=(2, 2))
                + synth_groups(1, 1, VOCAB, seed=2, prompt_len=(4, 4), resp_len=(4, 4)), 0)
    assert (b.prompt_lengths + b.lengths).tolist() == [5, 5, 8] and b.lengths.tolist() == [2, 2, 4]
    return b


def test_step_model_flops_by_hand() -> None:
    """Policy forward 200n + 16n² + 100r: 1600 + 1600 + 3024 = 6224, backward twice that: 18672 per epoch.
    Critic forward 240n + 16n² (no LM head): 1600 + 1600 + 2944 = 6144, with its backward 18432. Two epochs."""
    out = step_model_flops(three_rows(), ALL_PHASES, epochs=2, value_pass=True, policy=POLICY, critic=CRITIC)
    assert out == {"values": (6144.0, 18), "critic_update": (2 * 18432.0, 36), "fresh_values": (6144.0, 18),
                   "proximal": (6224.0, 18), "actor_update": (2 * 18672.0, 36)}
    # Surprise features: the LM head on the 8 response tokens (2·50·8 = 800) in each critic forward, no backward.
    surprise = step_model_flops(three_rows(), ALL_PHASES, 2, True, POLICY, CRITIC, surprise=True)
    assert surprise["values"] == (6944.0, 18) and surprise["critic_update"] == (2 * (6944.0 + 12288.0), 36)
    # No value pass: the timed `values` phase ran no model. GRPO: no critic. Without a proximal pass, none.
    assert "values" not in step_model_flops(three_rows(), ALL_PHASES, 2, False, POLICY, CRITIC)
    grpo = step_model_flops(three_rows(), {"advantages": 0.1, "actor_update": 0.1}, 1, False, POLICY, None)
    assert grpo == {"actor_update": (18672.0, 18)}


def test_step_model_flops_counts_only_the_rows_a_phase_runs() -> None:
    """The actor update on row 2 alone (n = 8, r = 4): 3024 forward + 6048 backward, two epochs."""
    out = step_model_flops(three_rows(), ALL_PHASES, 2, True, POLICY, CRITIC,
                           rows={"actor_update": torch.tensor([2]), "values": torch.tensor([True, False, False])})
    assert out["actor_update"] == (2 * 9072.0, 16) and out["values"] == (1600.0, 5)
    assert out["proximal"] == (6224.0, 18)  # a phase not named runs every row


def test_a_learner_step_reports_its_model_flops_and_mfu(tiny_model_dir: Path) -> None:
    """The tiny model on the CPU: the step's FLOPs are step_model_flops' from config.json, its MFU is against
    the matmul ceiling measured at start, and the per-rank figures divide by the seconds each phase took."""
    groups = synth_groups(4, 3, VOCAB, seed=5)
    learner = Learner(make_cfg(tiny_model_dir, "algo.actor_values=pre_update", "learner.off_policy=decoupled"), None)
    stats = learner.step(groups)
    hf = read_model_config(tiny_model_dir)
    expected = step_model_flops(collate(groups, 0), stats["phase_seconds"], 1, True, model_shape(hf),
                                model_shape(hf, critic=True))
    assert set(expected) == {"values", "critic_update", "proximal", "actor_update"}
    assert stats["phase_model_flops"] == {p: f for p, (f, _) in expected.items()}
    assert stats["model_flops"] == pytest.approx(sum(f for f, _ in expected.values()))
    peak = stats["peak_tflops_measured"]
    assert peak == stats["peak_tflops"] > 0
    for p, (f, n) in expected.items():
        sec = stats["phase_seconds"][p]
        assert stats["phase_tflops_per_rank"][p] == pytest.approx(f / sec / 1e12)
        assert stats["phase_tokens_per_second"][p] == pytest.approx(n / sec)
        assert stats["phase_mfu"][p] == pytest.approx(f / sec / 1e12 / peak)
    assert 0 < stats["mfu"] == pytest.approx(stats["tflops_per_rank"] / peak)
    assert stats["tokens_per_second_per_rank"] == stats["tokens_per_second"]  # one rank
