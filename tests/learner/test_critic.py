"""learner.critic: the value head reads each position's last hidden state; its starting values are the
configured bias; the head's state round-trips; the surprise features are the log-probabilities of each response
token under the tied LM head (latest and running minimum), read one position back, zero before the response."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel

from learner.critic import Critic


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
