"""learner.critic: the value head reads each position's last hidden state; its starting values are the
configured bias; the head's state round-trips; the surprise features are the log-probabilities of each response
token under the tied LM head (latest and running minimum), read one position back, zero before the response; and
where those features come from (learner.value_head_surprise_source): the critic's own head moves with its
training and the features with it, the behaviour log-probs and a frozen base model do not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModel

from learner.advantages import terminal_rewards
from learner.batch import collate
from learner.critic import Critic
from learner.forwards import compute_values
from learner.models import build_critic, save_critic
from learner.schedule import MicroLimits, minibatch_rows
from learner.synthetic import synth_groups
from learner.update import critic_update
from tests.learner.train_fixtures import VOCAB, make_cfg


def _critic(model_dir: Path, **kw: Any) -> Critic:
    torch.manual_seed(0)
    return Critic(AutoModel.from_pretrained(str(model_dir), dtype=torch.float32), 32, **kw)


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[5, 9, 12, 7, 30, 0], [8, 3, 44, 21, 17, 11]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    return ids, mask


@torch.no_grad()
def test_values_start_at_the_bias_and_read_each_positions_hidden_state(tiny_model_dir: Path) -> None:
    critic = _critic(tiny_model_dir, init_std=0.0, init_bias=0.25)
    ids, mask = _rows()
    v = critic(ids, mask)
    assert v.shape == (2, 6) and v.dtype == torch.float32
    assert torch.equal(v, torch.full((2, 6), 0.25))
    critic.value_head.weight.fill_(1.0)  # V = sum of the hidden state + bias
    h = critic.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(critic(ids, mask), h.sum(-1) + 0.25)


@torch.no_grad()
def test_head_state_round_trips_and_a_plain_head_ignores_surprise_keys(tiny_model_dir: Path) -> None:
    src = _critic(tiny_model_dir, init_std=0.5, init_bias=-1.0, surprise=True)
    state = src.head_state_dict()
    assert set(state) == {"weight", "bias", "surprise.0.weight", "surprise.0.bias", "surprise.2.weight",
                          "surprise.2.bias"}
    assert float(state["bias"]) == -1.0 and float(state["surprise.2.weight"].abs().sum()) == 0.0  # starts at zero
    dst = _critic(tiny_model_dir, init_std=0.0, init_bias=0.0, surprise=True)
    dst.load_head_state_dict(state)
    assert all(torch.equal(dst.head_state_dict()[k], t) for k, t in state.items())
    plain = _critic(tiny_model_dir, init_std=0.0, init_bias=0.0)
    plain.load_head_state_dict(state)
    assert set(plain.head_state_dict()) == {"weight", "bias"} and torch.equal(plain.value_head.weight, state["weight"])


@torch.no_grad()
def test_surprise_features_are_the_response_tokens_logprobs_one_position_back(tiny_model_dir: Path) -> None:
    critic = _critic(tiny_model_dir, init_std=0.0, init_bias=0.0, surprise=True)
    ids, mask = _rows()
    start = torch.tensor([2, 3])  # row 0's response: positions 2..4 (5 is padding); row 1's: 3..5
    h = critic.backbone(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    feats = critic._padded_surprise_features(h, ids, mask, start)
    emb = critic.backbone.get_input_embeddings().weight
    logp = torch.log_softmax(h @ emb.t(), dim=-1)  # the tied LM head
    want = torch.zeros(2, 6, 2)
    for b, positions in ((0, [2, 3, 4]), (1, [3, 4, 5])):
        run = float("inf")
        for s in positions:
            lp = float(logp[b, s - 1, ids[b, s]])  # token s is scored by the hidden state at s - 1
            run = min(run, lp)
            want[b, s] = torch.tensor([run, lp])
    want[0, 5, 0] = want[0, 4, 0]  # the running minimum carries on into the padding (masked downstream)
    torch.testing.assert_close(feats, want, rtol=1e-5, atol=1e-5)
    # The MLP's last layer starts at zero: with the features the values are the plain head's.
    assert torch.equal(critic(ids, mask, response_start=start), critic(ids, mask))


def _features(critic, batch, limits: int) -> list[torch.Tensor]:
    """The ``[n, S, 2]`` features the surprise MLP reads, one per micro-batch of a value pass over every row."""
    seen: list[torch.Tensor] = []
    hook = critic.module.surprise_head.register_forward_hook(lambda _m, args, _o: seen.append(args[0].detach().clone()))
    compute_values(critic, batch, torch.arange(batch.size), limits)
    hook.remove()
    return seen


def _train(critic, batch, steps: int) -> None:
    """``steps`` critic optimizer steps toward the batch's Monte-Carlo returns (the backbone trains too)."""
    returns = terminal_rewards(batch.scores, batch.mask).flip(-1).cumsum(-1).flip(-1) * batch.mask
    for k in range(steps):
        critic_update(critic, batch, minibatches=minibatch_rows(batch.size, 1, 0, k), returns=returns,
                      old_values=torch.zeros(batch.mask.shape), epochs=1, limits=4)


def _built_critic(model: Path, source: str, *extra: str):
    return build_critic(make_cfg(model, "learner.value_head_surprise=true", "learner.critic_lr=3e-2",
                                 "learner.packing=false", f"learner.value_head_surprise_source={source}", *extra))


@pytest.mark.parametrize("source", ["critic_head", "behaviour", "frozen_base"])
def test_only_the_critics_own_head_moves_its_features(tiny_model_dir: Path, source: str) -> None:
    batch = collate(synth_groups(2, 4, VOCAB, seed=3, resp_len=(2, 10)), pad_id=0)
    critic = _built_critic(tiny_model_dir, source)
    before = _features(critic, batch, 4)
    backbone0 = {k: v.clone() for k, v in critic.module.backbone.state_dict().items()}
    _train(critic, batch, 4)
    moved = max(float((v - backbone0[k]).abs().max()) for k, v in critic.module.backbone.state_dict().items())
    assert moved > 1e-3  # the backbone (and its tied LM head) did train
    after = _features(critic, batch, 4)
    change = max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True))
    if source == "critic_head":
        assert change > 1e-3
    else:
        assert change == 0.0
    if source == "behaviour":  # the latest-token feature holds exactly the samples' behaviour log-probs
        latest = torch.cat([f[..., 1].flatten() for f in after])
        assert torch.equal(latest[latest != 0].sort().values, batch.behaviour_logprobs[batch.mask > 0].sort().values)


def test_frozen_base_reads_the_base_model_not_the_saved_critic(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A critic saved after training and loaded again: the frozen copy is the base model's, as at the start."""
    batch = collate(synth_groups(2, 4, VOCAB, seed=4, resp_len=(2, 10)), pad_id=0)
    fresh = _built_critic(tiny_model_dir, "frozen_base")
    at_start = _features(fresh, batch, 4)
    _train(fresh, batch, 3)
    save_critic(fresh, tmp_path / "c")
    reloaded = build_critic(make_cfg(tiny_model_dir, "learner.value_head_surprise=true", "learner.packing=false",
                                     "learner.value_head_surprise_source=frozen_base"), tmp_path / "c")
    assert all(torch.equal(a, b) for a, b in zip(_features(reloaded, batch, 4), at_start, strict=True))
    assert not any(p.requires_grad for p in reloaded.module.frozen_base.parameters())


@pytest.mark.parametrize("source", ["behaviour", "frozen_base"])
def test_the_features_are_the_same_packed_and_padded(tiny_model_dir: Path, source: str) -> None:
    """The behaviour log-probs are placed at their tokens' positions in both layouts, and the frozen base reads the
    packed stream as the critic does: the same values."""
    batch = collate(synth_groups(3, 3, VOCAB, seed=5, resp_len=(1, 9)), pad_id=0)
    padded = _built_critic(tiny_model_dir, source)
    with torch.no_grad():  # a non-zero MLP output, so the values depend on the features
        padded.module.surprise_head[2].weight.fill_(0.5)
    packed = _built_critic(tiny_model_dir, source, "learner.packing=true")
    packed.module.load_state_dict(padded.module.state_dict())
    v_pad = compute_values(padded, batch, torch.arange(batch.size), 4)
    v_packed = compute_values(packed, batch, torch.arange(batch.size), MicroLimits(rows=4, packed=True))
    torch.testing.assert_close(v_packed, v_pad, atol=1e-5, rtol=1e-5)
    if source == "frozen_base":
        return
    batch.behaviour_logprobs.mul_(2.0)  # the values read them
    assert float((compute_values(padded, batch, torch.arange(batch.size), 4) - v_pad).abs().max()) > 1e-3


@pytest.mark.parametrize("source", ["behaviour", "frozen_base"])
def test_a_learner_step_trains_a_critic_with_either_source(tiny_model_dir: Path, source: str) -> None:
    """The whole step (packed micro-batches, value pass, update, fresh values) runs with the features' source."""
    from learner.train import Learner

    learner = Learner(make_cfg(tiny_model_dir, "learner.value_head_surprise=true",
                               f"learner.value_head_surprise_source={source}"), None)
    head0 = learner.critic.module.surprise_head[0].weight.detach().clone()
    stats = learner.step(synth_groups(4, 4, VOCAB, seed=9))
    assert torch.isfinite(torch.tensor(stats["critic_loss"])) and stats["critic_loss"] > 0
    assert not torch.equal(head0, learner.critic.module.surprise_head[0].weight)
