"""Engines: critic construction, ZeRO stages and bf16 give the stage-0 update, ZeRO-3 weights publish whole."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.models import load_critic_module, save_critic
from learner.synthetic import synth_groups
from learner.train import Learner
from learner.weights import publish_policy
from tests.learner.train_fixtures import make_cfg


def _step(model: Path, *extra: str) -> Learner:
    learner = Learner(make_cfg(model, *extra), None)
    learner.step(synth_groups(4, 4, 60, seed=9))
    return learner


def _params(learner: Learner) -> dict[str, torch.Tensor]:
    from learner.models import full_state_dict

    return {**{"p." + k: v.float() for k, v in full_state_dict(learner.policy).items()},
            **{"c." + k: v.float() for k, v in full_state_dict(learner.critic).items()}}


def test_critic_head_init_no_dropout_and_save_roundtrip(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = make_cfg(tiny_model_dir, "learner.value_head_init_std=0", "learner.value_head_init_bias=0.25")
    critic = load_critic_module(cfg)
    assert critic.value_head.weight.dtype == torch.float32 and float(critic.value_head.weight.abs().sum()) == 0
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in critic.modules())
    assert all(v == 0.0 for k, v in vars(critic.backbone.config).items() if "dropout" in k and isinstance(v, float))
    x = torch.randint(3, 50, (2, 7))
    v = critic(x, torch.ones_like(x))
    assert v.shape == (2, 7) and v.dtype == torch.float32 and torch.allclose(v, torch.full_like(v, 0.25))
    with torch.no_grad():
        critic.value_head.weight.normal_()
    out = save_critic(critic, tmp_path / "critic")
    again = load_critic_module(cfg, out)
    assert torch.equal(again.value_head.weight, critic.value_head.weight)
    assert torch.allclose(again(x, torch.ones_like(x)), critic(x, torch.ones_like(x)))


@pytest.mark.slow
def test_zero2_matches_stage0(tiny_model_dir: Path) -> None:
    ref, got = _params(_step(tiny_model_dir)), _params(_step(tiny_model_dir, "learner.zero_stage=2"))
    assert max(float((ref[k] - got[k]).abs().max()) for k in ref) < 2e-5


def test_bf16_step_is_finite_and_close(tiny_model_dir: Path) -> None:
    learner = _step(tiny_model_dir, "learner.precision=bf16")
    assert all(torch.isfinite(v).all() for v in _params(learner).values())
    assert math.isfinite(learner.last["critic_loss"]) and math.isfinite(learner.last["policy_loss"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_under_zero_accumulates_gradients_in_fp32(tiny_model_dir: Path, stage: int) -> None:
    learner = _step(tiny_model_dir, "learner.precision=bf16", f"learner.zero_stage={stage}")
    for engine in (learner.policy, learner.critic):
        assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert math.isfinite(learner.last["critic_loss"]) and math.isfinite(learner.last["policy_loss"])
    assert all(torch.isfinite(v).all() for v in _params(learner).values())


def test_zero3_matches_stage0_and_publishes_full_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    ref = _params(_step(tiny_model_dir))
    learner = _step(tiny_model_dir, "learner.zero_stage=3")
    got = _params(learner)
    assert max(float((ref[k] - got[k]).abs().max()) for k in ref) < 2e-5
    up = publish_policy(learner.policy, AutoTokenizer.from_pretrained(str(tiny_model_dir)), tmp_path / "w", 1, 2, None)
    saved = load_file(str(Path(up.path) / "model.safetensors"))
    assert saved and all(v.numel() > 0 and torch.equal(v, got["p." + k]) for k, v in saved.items())


def test_surprise_head_sees_unlikely_tokens_saves_and_gets_its_lr(tiny_model_dir: Path, tmp_path: Path) -> None:
    from learner.models import build_critic

    cfg = make_cfg(tiny_model_dir, "learner.value_head_surprise=true", "learner.value_head_lr_scale=100",
                   "learner.value_head_init_std=0",
                   "learner.value_head_init_bias=0.5")
    critic = load_critic_module(cfg)
    x = torch.randint(3, 50, (2, 9))
    start = torch.tensor([4, 6])
    # The MLP's last layer starts at zero: the initial values are the plain head's.
    assert torch.allclose(critic(x, torch.ones_like(x), start), torch.full((2, 9), 0.5))
    with torch.no_grad():
        h = critic.backbone(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state
        feats = critic._padded_surprise_features(h, x, torch.ones_like(x), start)
    assert feats.shape == (2, 9, 2)
    assert torch.all(feats[0, :4] == 0) and torch.all(feats[1, :6] == 0)  # prompt tokens carry no surprise
    assert torch.all(feats[0, 4:, 1] < 0)  # log-probabilities of the response tokens
    assert torch.all(feats[..., 0].diff(dim=1) <= 0)  # running minimum never rises
    assert torch.allclose(feats[0, :, 0], torch.cummin(feats[0, :, 1], 0).values)
    with torch.no_grad():
        critic.surprise_head[2].weight.normal_()
    v = critic(x, torch.ones_like(x), start)
    assert not torch.allclose(v, torch.full_like(v, 0.5))
    again = load_critic_module(cfg, save_critic(critic, tmp_path / "critic"))
    assert torch.allclose(again(x, torch.ones_like(x), start), v)
    critic = build_critic(cfg, lr=1e-4)
    lrs = sorted(g["lr"] for g in critic.optimizer.param_groups)
    assert lrs == pytest.approx([1e-4, 1e-2])


def test_surprise_head_refuses_untied_embeddings_and_chunks_its_logprobs(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The surprise features read log-probs through the input embeddings: a model whose LM head is a
    different matrix is refused, naming the key; the chunked features equal the full-vocabulary formula."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.config import ConfigError

    cfg = make_cfg(tiny_model_dir, "learner.value_head_surprise=true")
    untied = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone() + 0.1)
    untied.save_pretrained(tmp_path / "untied")
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(tmp_path / "untied")
    with pytest.raises(ConfigError, match="learner.value_head_surprise"):
        load_critic_module(cfg, tmp_path / "untied")

    critic = load_critic_module(make_cfg(tiny_model_dir, "learner.value_head_surprise=true",
                                         "learner.logits_chunk_elements=1"))  # one token per chunk
    x = torch.randint(3, 50, (3, 11))
    attn = torch.ones_like(x)
    attn[2, 8:] = 0
    start = torch.tensor([4, 6, 2])
    with torch.no_grad():
        h = critic.backbone(input_ids=x, attention_mask=attn).last_hidden_state
        feats = critic._padded_surprise_features(h, x, attn, start)
        # The whole [B, S, V] computation, as before the chunking.
        logp = torch.log_softmax(h[:, :-1] @ critic.backbone.get_input_embeddings().weight.t(), dim=-1)
        tok = torch.cat([torch.zeros(3, 1), logp.gather(-1, x[:, 1:, None]).squeeze(-1)], dim=1)
        real = (torch.arange(11)[None, :] >= start[:, None]) & attn.bool()
        tok = tok * real
    torch.testing.assert_close(feats[..., 1], tok, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(feats[..., 0], torch.cummin(tok, dim=1).values, atol=1e-6, rtol=1e-6)


def test_critic_warmup_ramps_its_lr_linearly_then_holds(tiny_model_dir: Path) -> None:
    """learner.critic_warmup_steps=4: the critic's k-th optimizer step (0-based) runs at min(1, (k+1)/4) × its lr,
    in every parameter group (the surprise MLP's at value_head_lr_scale × that); the policy's lr is not touched."""
    from learner.models import build_critic, build_policy

    cfg = make_cfg(tiny_model_dir, "learner.critic_lr=1e-2", "learner.critic_warmup_steps=4",
                   "learner.value_head_surprise=true", "learner.value_head_lr_scale=10")
    critic = build_critic(cfg)
    full = sorted({1e-2, 1e-1})
    seen: list[list[float]] = []
    for _ in range(6):
        seen.append(sorted({round(g["lr"], 12) for g in critic.optimizer.param_groups}))
        for p in critic.module.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        critic.step()
    assert seen == [[round(f * x, 12) for x in full] for f in (0.25, 0.5, 0.75, 1.0, 1.0, 1.0)]
    assert {g["lr"] for g in build_policy(cfg).optimizer.param_groups} == {cfg.learner.actor_lr}
