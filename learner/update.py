"""The updates of one learner step: the critic's and the actor's, over mini-batches and micro-batches.

Used by ``learner.train`` (the phase list) and ``learner.value_pretrain``; not a CLI. The math lives in
``learner.advantages`` / ``learner.losses``, the forwards in ``learner.forwards``, how rows are cut into mini-batches
and micro-batches and dealt to ranks in ``learner.schedule``; this module runs the optimiser steps.

Data parallelism: every rank holds the whole batch (learner.data.fetch) and cuts it the same way
(``learner.schedule``). Losses are divided by the real-token count of the whole mini-batch (every rank can count it:
it holds every row) and multiplied by the world size because DeepSpeed averages gradients; so N ranks compute exactly
the one-rank update. Every epoch reuses the same mini-batches and the same deal of rows to ranks, so each rank only
ever needs values and advantages for its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from common.config import Config
from learner.accum import Accum
from learner.batch import Batch
from learner.dist import loss_scale_for_dp, rank, world_size
from learner.forwards import critic_values, policy_logprobs, put_rows
from learner.losses import mismatch_stats, nll_loss, policy_loss, value_loss
from learner.models import grad_norm
from learner.schedule import MicroLimits, micro_batches


def critic_update(
    critic: Any,
    batch: Batch,
    *,
    minibatches: list[Tensor],
    returns: Tensor,
    old_values: Tensor,
    epochs: int,
    limits: MicroLimits | int,
    value_clip: float = 0.0,
    record: Tensor | None = None,
) -> dict[str, float]:
    """Fit V to ``returns`` [B, T] (λ_critic targets) over ``epochs`` × mini-batches; one optimizer step
    per mini-batch. ``record`` ``[B, T]`` (optional) receives the values of the first epoch's forwards on
    this rank's rows: each mini-batch's values just before its own optimizer step (what the explained
    variance is read from when no separate value pass runs). Returns critic_loss, value_clip_fraction,
    grad_norm, lr."""
    acc = Accum()
    lim = MicroLimits.of(limits)
    ppo_mask = batch.ppo_mask
    scale = loss_scale_for_dp()
    for epoch in range(epochs):
        for mbrows in minibatches:
            n_tok = ppo_mask[mbrows].double().sum()  # every rank holds every row: the global count
            mb_loss = 0.0
            for micro in micro_batches([mbrows], batch, lim, model="critic"):
                v = critic_values(critic, batch, micro)
                T = v.shape[1]
                m = ppo_mask[micro.rows, :T].to(v.device) * micro.weight
                loss, st = value_loss(v, returns[micro.rows, :T].to(v.device), m,
                                      old_values[micro.rows, :T].to(v.device), clip=value_clip,
                                      normalizer=n_tok.to(v.dtype))
                critic.backward(loss * scale, scale_wrt_gas=False)
                mb_loss += float(loss.detach())
                acc.add("value_clip_fraction", float(st["value_clip_fraction"]), float(m.sum()))
                if record is not None and epoch == 0 and micro.weight > 0:
                    put_rows(record, micro.rows, v)
            critic.step()
            acc.add("critic_loss", mb_loss * world_size(), 1.0)  # Σ over ranks of partial sums
            acc.add("critic_grad_norm", grad_norm(critic) if rank() == 0 else 0.0, 1.0 if rank() == 0 else 0.0)
    return acc.reduce()


@dataclass(frozen=True)
class ActorParams:
    """The actor update's hyper-parameters (learner.ppo_epochs, algo.clip_low/clip_high/clip_ratio_c/loss_agg/
    entropy_coef, nll.coef)."""

    epochs: int
    clip_low: float  # ε_low: the ratio's lower clip is 1 − ε_low
    clip_high: float  # ε_high: the ratio's upper clip is 1 + ε_high (clip-higher, DAPO)
    loss_agg: str  # token_mean | seq_mean
    nll_coef: float  # μ of the positive-example NLL (VAPO eq. 10)
    entropy_coef: float  # entropy bonus; 0 = none
    positive_reward: float = 1.0  # samples with reward >= this are the NLL's positives (buffer.positive_reward)
    clip_ratio_c: float = 3.0  # dual clip: for A < 0 the objective is at least c·A (0 = off)

    @classmethod
    def from_config(cls, cfg: Config) -> ActorParams:
        ac = cfg.algo
        return cls(epochs=cfg.learner.ppo_epochs, clip_low=ac.clip_low, clip_high=ac.clip_high, loss_agg=ac.loss_agg,
                   nll_coef=cfg.nll.coef, entropy_coef=ac.entropy_coef, positive_reward=cfg.buffer.positive_reward,
                   clip_ratio_c=ac.clip_ratio_c)


def nll_positive_rows(batch: Batch, threshold: float) -> Tensor:
    """``[B]`` bool: rows whose tokens the NLL imitates: verifier reward >= ``threshold`` and not cut at the
    length limit (a truncated response that happens to contain a right answer would teach not stopping)."""
    return (batch.rewards >= threshold) & ~batch.truncated


def actor_update(
    policy: Any,
    batch: Batch,
    *,
    minibatches: list[Tensor],
    advantages: Tensor,
    old_logprobs: Tensor,
    limits: MicroLimits | int,
    params: ActorParams,
    importance_weight: Tensor | None = None,
    version: int | None = None,
) -> dict[str, float]:
    """Clip-higher PPO (+ μ·NLL on verified, untruncated positives, + optional entropy bonus) with one
    optimizer step per mini-batch. The PPO term is normalised by the mini-batch's real (non-replay) tokens
    across ranks (or its sequences for ``seq_mean``); the NLL by the mini-batch's positive tokens across ranks.

    ``version`` (the weights being updated): the first mini-batch's forwards, which precede every optimizer
    step, measure the engine/learner mismatch on its rows generated by exactly these weights
    (mismatch_kl, mismatch_ratio_max, mismatch_tokens; ``losses.mismatch_stats``)."""
    p = params
    acc = Accum()
    lim = MicroLimits.of(limits)
    ppo_mask = batch.ppo_mask
    pos_mask = batch.mask * nll_positive_rows(batch, p.positive_reward).to(batch.mask.dtype).unsqueeze(-1)
    scale = loss_scale_for_dp()
    if version is not None:  # declared on every rank, whatever rows it holds: the reduction is collective
        acc.peak("mismatch_ratio_max", 0.0)
        acc.total("mismatch_tokens", 0.0)
    for epoch in range(p.epochs):
        for k_mb, mbrows in enumerate(minibatches):
            # Every rank holds every row, so the mini-batch's global counts need no collective.
            pm = ppo_mask[mbrows].double()
            n_tok, n_seq, n_pos = pm.sum(), (pm.sum(-1) > 0).sum().double(), pos_mask[mbrows].double().sum()
            norm = n_tok if p.loss_agg == "token_mean" else n_seq
            parts = {"policy_loss": 0.0, "nll_loss": 0.0}
            for micro in micro_batches([mbrows], batch, lim):
                logp, ent, sub = policy_logprobs(policy, batch, micro, lim, entropy_grad=p.entropy_coef > 0)
                assert ent is not None
                T = logp.shape[1]
                dev = logp.device
                m = ppo_mask[micro.rows, :T].to(dev) * micro.weight
                iw = importance_weight[micro.rows, :T].to(dev) if importance_weight is not None else None
                pl, st = policy_loss(logp, old_logprobs[micro.rows, :T].to(dev), advantages[micro.rows, :T].to(dev),
                                     m, clip_low=p.clip_low, clip_high=p.clip_high, loss_agg=p.loss_agg,
                                     normalizer=norm.to(logp.dtype), importance_weight=iw, clip_ratio_c=p.clip_ratio_c)
                nll = nll_loss(logp, pos_mask[micro.rows, :T].to(dev) * micro.weight, sub.rewards,
                               normalizer=n_pos.to(logp.dtype), threshold=float("-inf"))
                if version is not None and epoch == 0 and k_mb == 0 and micro.weight > 0:
                    _measure_mismatch(acc, logp, sub, version)
                loss = pl + p.nll_coef * nll
                if p.entropy_coef > 0:
                    loss = loss - p.entropy_coef * (ent * m).sum() / n_tok.to(ent.dtype).clamp(min=1.0)
                policy.backward(loss * scale, scale_wrt_gas=False)
                parts["policy_loss"] += float(pl.detach())
                parts["nll_loss"] += float(nll.detach())
                ntok = float(m.sum())
                for k in ("clip_fraction_low", "clip_fraction_high", "clip_fraction_dual", "approx_kl", "ratio_mean"):
                    acc.add(k, float(st[k]), ntok)
                acc.add("entropy", float((ent.detach() * m).sum()) / max(ntok, 1.0), ntok)
            policy.step()
            for k, v in parts.items():
                acc.add(k, v * world_size(), 1.0)
            acc.add("actor_grad_norm", grad_norm(policy) if rank() == 0 else 0.0, 1.0 if rank() == 0 else 0.0)
    return acc.reduce()


def _measure_mismatch(acc: Accum, logp: Tensor, sub: Batch, version: int) -> None:
    """Add one micro-batch's engine/learner mismatch (rows generated by ``version``, not replayed) to ``acc``."""
    same = ((sub.weight_version == version) & ~sub.is_replay).to(sub.mask.dtype).unsqueeze(-1).to(logp.device)
    kl_sum, n, top = mismatch_stats(logp.detach(), sub.behaviour_logprobs.to(logp.device), sub.mask.to(logp.device) * same)
    acc.add("mismatch_kl", kl_sum / n if n else 0.0, n)
    acc.total("mismatch_tokens", n)
    acc.peak("mismatch_ratio_max", top)


__all__ = ["critic_update"]
