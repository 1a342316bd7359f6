"""The pieces of one learner step that touch the engines: forwards, the critic update, the actor update.

Used by ``learner.train`` (the phase list) and ``learner.value_pretrain``; not a CLI. The math lives in
``learner.advantages`` / ``learner.losses``; this module only schedules it over mini-batches,
micro-batches and data-parallel ranks.

Data parallelism: every rank holds the whole batch (the groups are broadcast), the rows are permuted once
per step (seeded by run seed and version, identical on every rank), cut into ``mini_batches``
contiguous mini-batches, and rank r trains on rows ``mini_batch[r::world]``. Losses are divided by the
real-token count of the whole mini-batch summed over ranks (all_reduce) and multiplied by the world size
because DeepSpeed averages gradients; so N ranks compute exactly the one-rank update (PITFALLS
Algorithm 5). Every epoch reuses the same mini-batches, so each rank only ever needs values and
advantages for its own rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from learner.batch import Batch, gather_positions
from learner.engines import grad_norm, loss_scale_for_dp, rank, world_size
from learner.losses import entropy_from_logits, nll_loss, policy_loss, token_logprobs, value_loss


def all_reduce_sum(x: Tensor) -> Tensor:
    """Sum over data-parallel ranks (a no-op for one process); returns a new float64 CPU tensor."""
    y = x.detach().to(torch.float64).cpu().clone()
    if world_size() > 1:
        torch.distributed.all_reduce(y)
    return y


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (raw bytes through a uint8 tensor; nothing pickled)."""
    if world_size() == 1:
        assert data is not None
        return data
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.long)
    torch.distributed.broadcast(n, 0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank() == 0 and data else torch.empty(int(n), dtype=torch.uint8)
    if int(n):
        torch.distributed.broadcast(buf, 0)
    return bytes(buf.numpy().tobytes())


def minibatch_rows(n_rows: int, mini_batches: int, seed: int, version: int) -> list[Tensor]:
    """The step's mini-batches: one seeded permutation of the rows, cut into contiguous chunks."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(version))
    perm = torch.randperm(n_rows, generator=g)
    return [c for c in torch.tensor_split(perm, mini_batches) if len(c)]


def my_share(rows: Tensor) -> Tensor:
    return rows[rank() :: world_size()]


def micro_batches(rows: Tensor, size: int) -> Iterator[Tensor]:
    for i in range(0, len(rows), size):
        yield rows[i : i + size]


def _dev(engine: Any) -> torch.device:
    return next(engine.module.parameters()).device


def critic_values(critic: Any, batch: Batch, rows: Tensor) -> Tensor:
    """V(s_t) ``[len(rows), T_rows]`` fp32 with grad (T trimmed to those rows)."""
    sub = batch.select(rows).to(_dev(critic))
    v = critic(sub.input_ids, sub.attention_mask, sub.prompt_lengths)
    return gather_positions(v, sub.positions).float()


def policy_logits(policy: Any, batch: Batch, rows: Tensor) -> tuple[Tensor, Batch]:
    """Logits that score each response token ``[len(rows), T_rows, V]`` and the rows' sub-batch."""
    sub = batch.select(rows).to(_dev(policy))
    logits = policy(input_ids=sub.input_ids, attention_mask=sub.attention_mask).logits
    return gather_positions(logits, sub.positions), sub


def _put(dst: Tensor, rows: Tensor, x: Tensor) -> None:
    dst[rows, : x.shape[1]] = x.detach().to(dst.dtype).cpu()


@torch.no_grad()
def compute_values(critic: Any, batch: Batch, rows: Tensor, mbs: int) -> Tensor:
    """Full-size ``[B, T]`` fp32 values, filled on ``rows`` (0 elsewhere)."""
    out = torch.zeros(batch.mask.shape, dtype=torch.float32)
    critic.eval()
    for mb in micro_batches(rows, mbs):
        _put(out, mb, critic_values(critic, batch, mb))
    critic.train()
    return out * batch.mask


@torch.no_grad()
def compute_logprobs(policy: Any, batch: Batch, rows: Tensor, mbs: int) -> Tensor:
    """Full-size ``[B, T]`` current-policy logprobs of the response tokens on ``rows``."""
    out = torch.zeros(batch.mask.shape, dtype=torch.float32)
    policy.eval()
    for mb in micro_batches(rows, mbs):
        logits, sub = policy_logits(policy, batch, mb)
        _put(out, mb, token_logprobs(logits, sub.response_ids))
    policy.train()
    return out * batch.mask


@dataclass
class Accum:
    """Token-weighted sums of statistics, all-reduced at the end of a phase."""

    sums: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: float, weight: float = 1.0) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value) * weight
        self.sums[name + "/w"] = self.sums.get(name + "/w", 0.0) + weight

    def reduce(self) -> dict[str, float]:
        keys = sorted(k for k in self.sums if not k.endswith("/w"))
        vec = all_reduce_sum(torch.tensor([[self.sums[k], self.sums[k + "/w"]] for k in keys] or [[0.0, 0.0]]))
        return {k: float(vec[i, 0] / vec[i, 1]) if vec[i, 1] > 0 else 0.0 for i, k in enumerate(keys)}


def _rows_or_dummy(share: Tensor, minibatch: Tensor) -> tuple[Tensor, float]:
    """A rank without rows in this mini-batch still joins the gradient all-reduce: it runs one row with
    loss weight 0."""
    return (share, 1.0) if len(share) else (minibatch[:1], 0.0)


def critic_update(
    critic: Any,
    batch: Batch,
    minibatches: list[Tensor],
    returns: Tensor,
    old_values: Tensor,
    epochs: int,
    mbs: int,
    value_clip: float,
) -> dict[str, float]:
    """Fit V to ``returns`` [B, T] (λ_critic targets) over ``epochs`` × mini-batches; one optimizer step
    per mini-batch. Returns critic_loss, value_clip_fraction, grad_norm, lr."""
    acc = Accum()
    ppo_mask = batch.ppo_mask
    scale = loss_scale_for_dp()
    for _ in range(epochs):
        for mbrows in minibatches:
            mine = my_share(mbrows)
            n_tok = all_reduce_sum(ppo_mask[mine].sum())
            share, w = _rows_or_dummy(mine, mbrows)
            mb_loss = 0.0
            for micro in micro_batches(share, mbs):
                v = critic_values(critic, batch, micro)
                T = v.shape[1]
                m = ppo_mask[micro, :T].to(v.device) * w
                loss, st = value_loss(v, returns[micro, :T].to(v.device), m, old_values[micro, :T].to(v.device),
                                      clip=value_clip, normalizer=n_tok.to(v.dtype))
                critic.backward(loss * scale, scale_wrt_gas=False)
                mb_loss += float(loss.detach())
                acc.add("value_clip_fraction", float(st["value_clip_fraction"]), float(m.sum()))
            critic.step()
            acc.add("critic_loss", mb_loss * world_size(), 1.0)  # Σ over ranks of partial sums
            acc.add("critic_grad_norm", grad_norm(critic) if rank() == 0 else 0.0, 1.0 if rank() == 0 else 0.0)
    return acc.reduce()


def actor_update(
    policy: Any,
    batch: Batch,
    minibatches: list[Tensor],
    advantages: Tensor,
    old_logprobs: Tensor,
    importance_weight: Tensor | None,
    epochs: int,
    mbs: int,
    clip_low: float,
    clip_high: float,
    loss_agg: str,
    nll_coef: float,
    entropy_coef: float,
) -> dict[str, float]:
    """Clip-higher PPO (+ μ·NLL on verified positives, + optional entropy bonus) with one optimizer step
    per mini-batch. The PPO term is normalised by the mini-batch's real (non-replay) tokens across
    ranks (or its sequences for ``seq_mean``); the NLL by the mini-batch's positive tokens across ranks."""
    acc = Accum()
    ppo_mask = batch.ppo_mask
    pos_mask = batch.mask * (batch.rewards >= 1.0).to(batch.mask.dtype).unsqueeze(-1)
    scale = loss_scale_for_dp()
    for _ in range(epochs):
        for mbrows in minibatches:
            mine = my_share(mbrows)
            counts = all_reduce_sum(torch.stack([
                ppo_mask[mine].sum(), (ppo_mask[mine].sum(-1) > 0).sum().to(ppo_mask.dtype), pos_mask[mine].sum()
            ]))
            n_tok, n_seq, n_pos = counts[0], counts[1], counts[2]
            norm = n_tok if loss_agg == "token_mean" else n_seq
            share, w = _rows_or_dummy(mine, mbrows)
            parts = {"policy_loss": 0.0, "nll_loss": 0.0}
            for micro in micro_batches(share, mbs):
                logits, sub = policy_logits(policy, batch, micro)
                T = logits.shape[1]
                dev = logits.device
                logp = token_logprobs(logits, sub.response_ids)
                m = ppo_mask[micro, :T].to(dev) * w
                iw = importance_weight[micro, :T].to(dev) if importance_weight is not None else None
                pl, st = policy_loss(logp, old_logprobs[micro, :T].to(dev), advantages[micro, :T].to(dev), m,
                                     clip_low=clip_low, clip_high=clip_high, loss_agg=loss_agg,
                                     normalizer=norm.to(logp.dtype), importance_weight=iw)
                nll = nll_loss(logp, sub.mask * w, sub.rewards, normalizer=n_pos.to(logp.dtype))
                loss = pl + nll_coef * nll
                if entropy_coef > 0:
                    ent = entropy_from_logits(logits)
                    loss = loss - entropy_coef * (ent * m).sum() / n_tok.to(ent.dtype).clamp(min=1.0)
                else:
                    with torch.no_grad():
                        ent = entropy_from_logits(logits)
                policy.backward(loss * scale, scale_wrt_gas=False)
                parts["policy_loss"] += float(pl.detach())
                parts["nll_loss"] += float(nll.detach())
                ntok = float(m.sum())
                for k in ("clip_fraction_low", "clip_fraction_high", "approx_kl", "ratio_mean"):
                    acc.add(k, float(st[k]), ntok)
                acc.add("entropy", float((ent.detach() * m).sum()) / max(ntok, 1.0), ntok)
            policy.step()
            for k, v in parts.items():
                acc.add(k, v * world_size(), 1.0)
            acc.add("actor_grad_norm", grad_norm(policy) if rank() == 0 else 0.0, 1.0 if rank() == 0 else 0.0)
    return acc.reduce()
