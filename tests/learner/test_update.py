"""learner.update: the way a step is cut and run (packed or padded rows, rows or tokens, chunked or full logits,
every or some layers recomputed, with or without a value pass) does not change the update it makes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.modeling import build_tiny_qwen2
from learner.batch import collate
from learner.models import checkpointed_layers, enable_activation_checkpointing
from learner.synthetic import synth_groups
from learner.train import Learner
from tests.learner.train_fixtures import VOCAB, make_cfg, max_diff


def _batch(n_groups: int = 3, group_size: int = 5, seed: int = 0):
    return collate(synth_groups(n_groups, group_size, VOCAB, seed=seed, resp_len=(1, 40), max_new_tokens=40), pad_id=0)


def _run(model: Path, *extra: str) -> Learner:
    learner = Learner(make_cfg(model, *extra), None)
    learner.step(synth_groups(4, 4, VOCAB, seed=31, resp_len=(1, 40), max_new_tokens=40))
    return learner


def _both(learner: Learner) -> dict[str, torch.Tensor]:
    return {**{"p." + k: v for k, v in learner.policy.module.state_dict().items()},
            **{"c." + k: v for k, v in learner.critic.module.state_dict().items()}}


def _same_gradients(a: Learner, b: Learner, rel: float = 1e-5) -> None:
    """Gradient norms before clipping: AdamW's update is nearly blind to a uniform gradient scale (a lost
    or doubled normaliser), the norm is not."""
    for k in ("actor_grad_norm", "critic_grad_norm"):
        assert a.last[k] == pytest.approx(b.last[k], rel=rel), (k, a.last[k], b.last[k])


def test_packed_update_equals_padded_update(tiny_model_dir: Path) -> None:
    """Packed micro-batches (one token stream, block-diagonal attention) against right-padded rows, both cut
    into several micro-batches: the same gradients and parameters (fp32), with the entropy bonus's gradient too."""
    padded = _run(tiny_model_dir, "learner.packing=false", "algo.entropy_coef=0.01")
    packed = _run(tiny_model_dir, "learner.packing=true", "algo.entropy_coef=0.01", "learner.micro_batch_tokens=90")
    assert max_diff(_both(padded), _both(packed)) < 1e-5
    _same_gradients(padded, packed)
    for k in ("policy_loss", "nll_loss", "entropy", "approx_kl", "critic_loss", "value_explained_variance"):
        assert padded.last[k] == pytest.approx(packed.last[k], abs=1e-5), k
    assert max_diff(_both(padded), _both(Learner(make_cfg(tiny_model_dir), None))) > 1e-4  # the step did something


def test_token_budget_update_equals_row_count_update(tiny_model_dir: Path) -> None:
    rows = _run(tiny_model_dir, "learner.packing=false", "learner.micro_batch_size=3")
    tokens = _run(tiny_model_dir, "learner.packing=false", "learner.micro_batch_size=64", "learner.micro_batch_tokens=60")
    assert max_diff(_both(rows), _both(tokens)) < 1e-5
    _same_gradients(rows, tokens)
    assert max_diff(_both(rows), _both(Learner(make_cfg(tiny_model_dir), None))) > 1e-4  # the step did something


def test_chunked_logprobs_update_equals_full_logits_update(tiny_model_dir: Path) -> None:
    """Many LM-head chunks (64 logit elements: one token per chunk with this vocabulary) against the old
    full-logits path, with the entropy bonus on so that its gradient is compared too."""
    full = _run(tiny_model_dir, "learner.logits_chunk_elements=0", "algo.entropy_coef=0.01")
    chunked = _run(tiny_model_dir, "learner.logits_chunk_elements=64", "algo.entropy_coef=0.01")
    assert max_diff(_both(full), _both(chunked)) < 1e-5
    _same_gradients(full, chunked)
    for k in ("policy_loss", "nll_loss", "entropy", "approx_kl"):
        assert abs(full.last[k] - chunked.last[k]) < 1e-5, k


def test_activation_checkpointing_gives_the_same_update(tiny_model_dir: Path) -> None:
    plain = _run(tiny_model_dir)
    ckpt = _run(tiny_model_dir, "learner.activation_checkpointing=true")
    assert all(getattr(m, "gradient_checkpointing", False) for m in (ckpt.policy.module.model, ckpt.critic.module.backbone))
    assert not getattr(plain.policy.module.model, "gradient_checkpointing", False)
    assert [checkpointed_layers(m.module) for m in (plain.policy, ckpt.policy, ckpt.critic)] == [0, 1, 1]
    assert max_diff(_both(plain), _both(ckpt)) < 1e-5
    _same_gradients(plain, ckpt)


def test_every_kth_layer_recomputes_and_the_gradients_do_not_change() -> None:
    """learner.activation_checkpointing_every=2 on a 3-layer model: layers 0 and 2 run their attention again in the
    backward (2 calls each), layer 1 keeps its activations (1 call); the gradients equal no checkpointing's."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 9))
    grads, calls = [], []
    for every in (0, 2):
        torch.manual_seed(1)
        model = build_tiny_qwen2(50, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1)
        model.train()
        if every:
            enable_activation_checkpointing(model, every)
        n = [0, 0, 0]
        for i, layer in enumerate(model.model.layers):  # the layer's own hooks stay outside the checkpoint
            layer.self_attn.register_forward_pre_hook(lambda *_, i=i, n=n: n.__setitem__(i, n[i] + 1))
        model(input_ids=ids).logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        calls.append(n)
    assert calls == [[1, 1, 1], [2, 1, 2]]
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_monte_carlo_targets_need_no_value_pass(tiny_model_dir: Path) -> None:
    """λ_critic = 1 without value clipping: one critic pass fewer, the same update, and the explained
    variance read from the update's own forwards. A value clip too wide to bite forces the old pass."""
    counts: dict[str, int] = {}

    def run(*extra: str) -> Learner:
        learner = Learner(make_cfg(tiny_model_dir, "learner.mini_batches=1", "learner.packing=false", *extra), None)
        n = [0]
        learner.critic.module.register_forward_pre_hook(lambda *_: n.__setitem__(0, n[0] + 1))
        learner.step(synth_groups(4, 4, VOCAB, seed=32))
        counts[extra[0] if extra else "default"] = n[0]
        return learner

    fast, slow, pre = run(), run("algo.value_clip=1e6"), run("algo.actor_values=pre_update")
    assert max_diff(_both(fast), _both(slow)) < 1e-6
    # 16 rows, padded, micro_batch_size 3: 6 forwards per pass; the default runs update + fresh values only,
    # pre_update a value pass + update (the advantages read the value pass: no fresh values).
    assert counts == {"default": 12, "algo.value_clip=1e6": 18, "algo.actor_values=pre_update": 12}
    # pre_update reports the EV of the value pass, values no update has seen: here the slow run's.
    assert pre.last["value_explained_variance"] == pytest.approx(slow.last["value_explained_variance"], abs=1e-6)
    # One mini-batch: the update's forward precedes any step, so its values are the old pass's exactly.
    assert math.isfinite(fast.last["value_explained_variance"])
    assert abs(fast.last["value_explained_variance"] - slow.last["value_explained_variance"]) < 1e-6
    assert abs(fast.last["value_mean"] - slow.last["value_mean"]) < 1e-6


def test_actor_and_critic_update_take_keywords_and_actor_params(tiny_model_dir: Path) -> None:
    """The update functions are called by keyword (a positional call is refused), and ActorParams carries
    the actor's hyper-parameters: with zero advantages the PPO term is exactly 0 and only μ·NLL moves the
    policy; the critic update reports its loss and moves the critic."""

    from learner.advantages import terminal_rewards
    from learner.schedule import minibatch_rows
    from learner.update import ActorParams, actor_update, critic_update

    cfg = make_cfg(tiny_model_dir, "algo.clip_low=0.1", "algo.clip_high=0.3", "nll.coef=0.5", "learner.ppo_epochs=2")
    params = ActorParams.from_config(cfg)
    assert params == ActorParams(epochs=2, clip_low=0.1, clip_high=0.3, loss_agg=cfg.algo.loss_agg, nll_coef=0.5,
                                 entropy_coef=cfg.algo.entropy_coef, positive_reward=1.0)
    # The learner's positives are the buffer's: one threshold (buffer.positive_reward) for the NLL and replay.
    assert ActorParams.from_config(make_cfg(tiny_model_dir, "buffer.positive_reward=0.5")).positive_reward == 0.5
    learner = Learner(cfg, None)
    b = _batch(2, 4, seed=5)
    assert bool((b.rewards >= 1).any())  # there are positives for the NLL
    mbs = minibatch_rows(b.size, 2, 0, 0)
    returns = terminal_rewards(b.scores, b.mask).flip(-1).cumsum(-1).flip(-1) * b.mask  # λ = γ = 1 targets
    with pytest.raises(TypeError):
        critic_update(learner.critic, b, mbs, returns, torch.zeros(b.mask.shape), 1, 4)  # type: ignore[misc]
    c0 = {k: v.clone() for k, v in learner.critic.module.state_dict().items()}
    st = critic_update(learner.critic, b, minibatches=mbs, returns=returns, old_values=torch.zeros(b.mask.shape),
                       epochs=1, limits=4)
    assert set(st) == {"critic_loss", "value_clip_fraction", "critic_grad_norm"} and st["critic_loss"] > 0
    assert max_diff(c0, learner.critic.module.state_dict()) > 1e-6
    p0 = {k: v.clone() for k, v in learner.policy.module.state_dict().items()}
    st = actor_update(learner.policy, b, minibatches=mbs, advantages=torch.zeros(b.mask.shape),
                      old_logprobs=b.behaviour_logprobs, limits=4, params=params)
    assert st["policy_loss"] == 0.0 and st["nll_loss"] > 0
    assert {"clip_fraction_low", "clip_fraction_high", "approx_kl", "entropy", "actor_grad_norm"} <= set(st)
    assert max_diff(p0, learner.policy.module.state_dict()) > 1e-6


def test_critic_updates_set_apart_from_the_actors(tiny_model_dir: Path) -> None:
    """learner.critic_updates=K_v: K_v critic optimizer steps per epoch of a step, the actor's count
    (learner.mini_batches per epoch) unchanged; 0 keeps the actor's mini-batches for both."""

    def steps(*extra: str) -> tuple[int, int]:
        learner = Learner(make_cfg(tiny_model_dir, "learner.mini_batches=2", "learner.ppo_epochs=2", *extra), None)
        n = {"policy": 0, "critic": 0}
        for name in n:
            engine = getattr(learner, name)
            real = engine.step

            def counted(*a, _name=name, _real=real, **k):
                n[_name] += 1
                return _real(*a, **k)

            engine.step = counted
        learner.step(synth_groups(4, 4, VOCAB, seed=33))
        return n["critic"], n["policy"]

    assert steps() == (4, 4)
    assert steps("learner.critic_updates=5") == (10, 4)


def test_value_clipping_bites_across_the_critics_own_mini_batches(tiny_model_dir: Path) -> None:
    """The paper-trained critic with its value loss clipped (the value_parts ``paper_clip`` arm): K_v = 4 critic
    updates a step at a high lr, surprise from a frozen copy of the base model. After the first mini-batch the values
    have moved off the value pass's, so a clip of 1e-4 around them holds some tokens (fraction > 0); with no
    clip none is counted, and the clipped loss stays a finite, positive number."""

    def last(*extra: str) -> dict[str, float]:
        learner = Learner(make_cfg(tiny_model_dir, "learner.critic_updates=4", "learner.critic_lr=1e-2",
                                   "learner.value_head_surprise_source=frozen_base", *extra), None)
        learner.step(synth_groups(4, 4, VOCAB, seed=34))
        return learner.last

    clipped, free = last("algo.value_clip=1e-4"), last()
    assert 0 < clipped["value_clip_fraction"] <= 1 and free["value_clip_fraction"] == 0
    assert math.isfinite(clipped["critic_loss"]) and clipped["critic_loss"] > 0
