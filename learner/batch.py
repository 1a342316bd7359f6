"""Sample groups → padded training tensors for the learner (not a CLI).

    batch = collate(groups, pad_id=tokenizer.pad_token_id)
    logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logprobs(gather_positions(logits, batch.positions), batch.response_ids)   # [B, T]

Layout: each row is prompt + response, right-padded, so HF's default position ids 0..S−1 are right. The
response lives in its own ``[B, T]`` frame: ``mask[b, t] = 1`` on real response tokens.
Alignment (an off-by-one here silently trains on the wrong token or value): the logits that score response token t, and the critic's V(s_t) (the
value of the state *before* token t), are both read at sequence position ``prompt_len + t − 1``
(``positions[b, t]``). The reward goes on the last real response token only
(``learner.advantages.terminal_rewards``). A response cut at the length limit (finish_reason "length")
is terminal with the verifier's reward, never bootstrapped; padding is never counted (mask 0).

Deviation: with ``algo.overlong_buffer > 0`` the DAPO soft overlong penalty is added to ``scores`` (the
RL return); ``rewards`` keeps the verifier's reward, which alone decides what is a positive for the NLL.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from common.config import Config
from common.protocol import Sample, SampleGroup


@dataclass
class Batch:
    input_ids: Tensor  # [B, S] long: prompt + response, right-padded with pad_id
    attention_mask: Tensor  # [B, S] long
    positions: Tensor  # [B, T] long: sequence index whose logits/hidden state score response token t
    response_ids: Tensor  # [B, T] long
    mask: Tensor  # [B, T] float32, 1 on real response tokens
    behaviour_logprobs: Tensor  # [B, T] float32 (the engine's logprobs at sampling time)
    rewards: Tensor  # [B] float32: the verifier's reward
    scores: Tensor  # [B] float32: the RL return (reward, plus overlong shaping when enabled)
    lengths: Tensor  # [B] long: real response tokens
    prompt_lengths: Tensor  # [B] long
    weight_version: Tensor  # [B] long: version of the weights that generated the sample
    truncated: Tensor  # [B] bool: finish_reason == "length"
    group_index: Tensor  # [B] long: index of the sample's group in the batch (-1 for replayed positives)
    is_replay: Tensor  # [B] bool: a stored positive added for the NLL term only (no PPO loss)
    excluded: Tensor  # [B] bool: kept out of the policy and value losses (truncated, with algo.truncated=mask)
    token_versions: Tensor  # [B, T] long: weight version that generated each response token (0 on padding)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def ppo_mask(self) -> Tensor:
        """Tokens that enter the policy and value losses (replayed positives only feed the NLL; excluded rows
        feed nothing)."""
        return self.mask * (~(self.is_replay | self.excluded)).to(self.mask.dtype).unsqueeze(-1)

    def select(self, idx: Tensor | list[int]) -> Batch:
        """Rows ``idx``, with the sequence and response axes trimmed to what those rows need."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        rows = {f.name: getattr(self, f.name)[idx_t] for f in fields(self)}
        s_need = int((rows["prompt_lengths"] + rows["lengths"]).max().item()) if len(idx_t) else 0
        t_need = max(1, int(rows["lengths"].max().item())) if len(idx_t) else 1
        for name in ("input_ids", "attention_mask"):
            rows[name] = rows[name][:, : max(1, s_need)]
        for name in ("positions", "response_ids", "mask", "behaviour_logprobs", "token_versions"):
            rows[name] = rows[name][:, :t_need]
        return Batch(**rows)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO soft overlong punishment: 0 up to ``max_new_tokens − buffer``, then linear down to −penalty."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    excess = (lengths.to(torch.float32) - (max_new_tokens - buffer)).clamp(min=0.0)
    return -(excess / buffer).clamp(max=1.0) * penalty


def collate_samples(
    samples: list[Sample],
    pad_id: int,
    group_index: list[int] | None = None,
    is_replay: bool = False,
    max_new_tokens: int = 0,
    overlong_buffer: int = 0,
    overlong_penalty_value: float = 1.0,
) -> Batch:
    """Pad ``samples`` into a :class:`Batch`. Every sample needs a non-empty prompt (position −1 does not exist)."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    B = len(samples)
    plens = np.array([len(s.prompt_ids) for s in samples], dtype=np.int64)
    lens = np.array([len(s.output_ids) for s in samples], dtype=np.int64)
    if int(plens.min()) < 1:
        raise ValueError("every sample needs at least one prompt token")
    S = int((plens + lens).max())
    T = max(1, int(lens.max()))
    input_ids = np.full((B, S), pad_id, dtype=np.int64)
    attn = np.zeros((B, S), dtype=np.int64)
    resp = np.full((B, T), pad_id, dtype=np.int64)
    mask = np.zeros((B, T), dtype=np.float32)
    blogp = np.zeros((B, T), dtype=np.float32)
    pos = np.zeros((B, T), dtype=np.int64)
    tver = np.zeros((B, T), dtype=np.int64)
    for i, s in enumerate(samples):
        p, n = int(plens[i]), int(lens[i])
        input_ids[i, :p] = s.prompt_ids
        input_ids[i, p : p + n] = s.output_ids
        attn[i, : p + n] = 1
        resp[i, :n] = s.output_ids
        mask[i, :n] = 1.0
        blogp[i, :n] = s.output_logprobs
        tver[i, :n] = s.token_versions()
        # logits at p + t − 1 predict token t; padded slots point at the last prompt token (masked out).
        pos[i, :] = p - 1
        pos[i, :n] = p - 1 + np.arange(n)
    lengths = torch.from_numpy(lens)
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    scores = rewards + overlong_penalty(lengths, max_new_tokens, overlong_buffer, overlong_penalty_value)
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attn),
        positions=torch.from_numpy(pos),
        response_ids=torch.from_numpy(resp),
        mask=torch.from_numpy(mask),
        behaviour_logprobs=torch.from_numpy(blogp),
        rewards=rewards,
        scores=scores,
        lengths=lengths,
        prompt_lengths=torch.from_numpy(plens),
        weight_version=torch.tensor([int(s.weight_version) for s in samples], dtype=torch.long),
        truncated=torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.bool),
        group_index=torch.tensor(group_index if group_index is not None else [-1] * B, dtype=torch.long),
        is_replay=torch.full((B,), is_replay, dtype=torch.bool),
        excluded=torch.zeros(B, dtype=torch.bool),
        token_versions=torch.from_numpy(tver),
    )


def apply_truncation_policy(batch: Batch, policy: str) -> Batch:
    """``algo.truncated`` on the batch's real rows cut at the length limit, in place: ``keep`` leaves them,
    ``zero_reward`` takes the verifier's reward out of their RL return (any overlong shaping stays),
    ``mask`` excludes them from the policy and value losses (DAPO's overlong filtering). Replayed positives
    are never truncated ones (the buffer does not store those) and are left alone."""
    cut = batch.truncated & ~batch.is_replay
    if policy == "zero_reward":
        batch.scores = torch.where(cut, batch.scores - batch.rewards, batch.scores)
    elif policy == "mask":
        batch.excluded = batch.excluded | cut
    elif policy != "keep":
        raise ValueError(f"truncated policy must be keep, mask or zero_reward, got {policy!r}")
    return batch


def collate_scored(groups: list[SampleGroup], pad_id: int, cfg: Config) -> Batch:
    """``collate`` as the RL step and value pretraining both train on it: DAPO's overlong shaping
    (``algo.overlong_*``) and the truncation policy (``algo.truncated``) applied, so the critic's pretraining
    targets are the returns RL will ask it for."""
    ac = cfg.algo
    batch = collate(groups, pad_id, max_new_tokens=ac.overlong_max_length or cfg.actors.max_new_tokens,
                    overlong_buffer=ac.overlong_buffer, overlong_penalty_value=ac.overlong_penalty)
    return apply_truncation_policy(batch, ac.truncated)


def collate(groups: list[SampleGroup], pad_id: int, max_new_tokens: int = 0, overlong_buffer: int = 0,
            overlong_penalty_value: float = 1.0) -> Batch:
    """All samples of ``groups`` in order (group g's samples are consecutive rows); the overlong shaping as
    ``collate_samples``."""
    samples = [s for g in groups for s in g.samples]
    gidx = [i for i, g in enumerate(groups) for _ in g.samples]
    return collate_samples(samples, pad_id, group_index=gidx, max_new_tokens=max_new_tokens,
                           overlong_buffer=overlong_buffer, overlong_penalty_value=overlong_penalty_value)


def concat(a: Batch, b: Batch, pad_id: int) -> Batch:
    """Rows of ``a`` then ``b`` (used to append replayed positives)."""
    out = {}
    for f in fields(Batch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x.dim() == 2 and x.shape[1] != y.shape[1]:
            width = max(x.shape[1], y.shape[1])
            fill = pad_id if f.name in ("input_ids", "response_ids") else 0
            x = torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill)
            y = torch.nn.functional.pad(y, (0, width - y.shape[1]), value=fill)
        out[f.name] = torch.cat([x, y])
    # Padded position slots of the narrower part must stay inside each row's prompt (any masked index works).
    return Batch(**out)


def gather_positions(x: Tensor, positions: Tensor) -> Tensor:
    """``x[b, positions[b, t]]`` for x ``[B, S]`` or ``[B, S, V]`` → ``[B, T]`` or ``[B, T, V]``."""
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(-1)
    return x[rows, positions.to(x.device)]


__all__ = ["collate"]
