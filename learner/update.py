"""The pieces of one learner step that touch the models: forwards, the critic update, the actor update.

Used by ``learner.train`` (the phase list) and ``learner.value_pretrain``; not a CLI. The math lives in
``learner.advantages`` / ``learner.losses``; this module only schedules it over mini-batches,
micro-batches and data-parallel ranks.

Data parallelism: every rank holds the whole batch (learner.data.fetch), the rows are permuted once
per step (seeded by run seed and version, identical on every rank) and cut into ``mini_batches``
contiguous mini-batches. Losses are divided by the real-token count of the whole mini-batch (every rank
can count it: it holds every row) and multiplied by the world size because DeepSpeed averages gradients;
so N ranks compute exactly the one-rank update. Every epoch reuses the same mini-batches and micro-batches,
so each rank only ever needs values and advantages for its own rows.

Micro-batches (``plan``): a mini-batch's rows, longest first, are cut greedily into micro-batches of at
most ``learner.micro_batch_size`` rows and, when ``learner.micro_batch_tokens`` > 0, at most that many
padded tokens (rows × longest prompt + response), like verl's per-GPU token budget; neighbours in length
share a micro-batch, so little is padding. The micro-batches are dealt to the ranks by padded tokens
(largest first, to the least loaded rank). Under ZeRO-2/3 every forward and backward is a collective, so
every rank must run the same number of micro-batches in every phase: every rank computes the whole plan
(all hold the whole batch) and pads its own list with weight-0 filler micro-batches (the shortest row,
loss multiplied by 0). The LM head is applied in a number of chunks that is also the same on every rank
for a given micro-batch (under ZeRO-3 each call gathers its weight).

Policy log-probs (``learner.logits_chunk_elements`` > 0): the policy returns its final hidden states and the
LM head runs over the real response tokens only, in chunks of about ``logits_chunk_elements / vocab``
tokens, recomputed in the backward (``learner.losses.chunked_token_logprobs``); 0 keeps the old path
(full ``[B, S, V]`` logits), which the memory benchmark uses as its baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from learner.accum import Accum
from learner.batch import Batch, gather_positions
from learner.dist import loss_scale_for_dp, rank, world_size
from learner.losses import (
    chunked_token_logprobs,
    entropy_from_logits,
    mismatch_stats,
    nll_loss,
    policy_loss,
    token_logprobs,
    value_loss,
)
from learner.models import grad_norm


def minibatch_rows(n_rows: int, mini_batches: int, seed: int, version: int) -> list[Tensor]:
    """The step's mini-batches: one seeded permutation of the rows, cut into contiguous chunks."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(version))
    perm = torch.randperm(n_rows, generator=g)
    return [c for c in torch.tensor_split(perm, mini_batches) if len(c)]


# ------------------------------------------------------------------------------------------ scheduling


@dataclass(frozen=True)
class MicroLimits:
    """How micro-batches are cut (learner.micro_batch_size, micro_batch_tokens, logits_chunk_elements)."""

    rows: int = 64
    tokens: int = 0  # most padded tokens (rows × longest prompt + response) per micro-batch; 0 = no limit
    logit_elements: int = 0  # tokens × vocab per LM-head chunk; 0 = full logits (the old path)
    temperature: float = 1.0  # the engines' sampling temperature: log π is of logits / temperature, as they sample

    @classmethod
    def of(cls, limits: MicroLimits | int) -> MicroLimits:
        return limits if isinstance(limits, MicroLimits) else cls(rows=int(limits))

    @classmethod
    def from_config(cls, learner_cfg: Any, temperature: float = 1.0) -> MicroLimits:
        return cls(learner_cfg.micro_batch_size, learner_cfg.micro_batch_tokens, learner_cfg.logits_chunk_elements,
                   temperature)


@dataclass(frozen=True)
class Micro:
    """One micro-batch of this rank."""

    rows: Tensor  # batch rows
    weight: float  # 1, or 0 for a filler that only keeps the ranks' collectives matched
    peak_tokens: int  # most real response tokens any rank has in its micro-batch of this index


def seq_lengths(batch: Batch) -> Tensor:
    """Tokens each row's forward processes: prompt + response ``[B]``."""
    return batch.prompt_lengths + batch.lengths


def _longest_first(rows: Tensor, seq_len: Tensor) -> Tensor:
    return rows[torch.argsort(seq_len[rows], descending=True, stable=True)]


def cut(rows: Tensor, seq_len: Tensor, max_rows: int, max_tokens: int = 0) -> list[Tensor]:
    """``rows`` longest first, cut greedily: a micro-batch grows while it has at most ``max_rows`` rows and
    (``max_tokens`` > 0) rows × its longest row ≤ ``max_tokens``. A row longer than the budget goes alone."""
    order = _longest_first(rows, seq_len)
    lens = seq_len[order].tolist()
    out, start = [], 0
    for i in range(1, len(lens)):
        n = i - start + 1
        if n > max_rows or (max_tokens > 0 and n * lens[start] > max_tokens):
            out.append(order[start:i])
            start = i
    if len(lens):
        out.append(order[start:])
    return out


def plan(rows: Tensor, batch: Batch, limits: MicroLimits, world: int) -> list[list[Tensor]]:
    """One mini-batch's micro-batches on every rank: its rows longest first, cut into micro-batches (so a
    micro-batch holds rows of similar length: little padding), at least ``world`` of them when there are
    enough rows, dealt largest first to the rank with the fewest padded tokens so far."""
    seq = seq_lengths(batch)
    cap = max(1, limits.rows)
    if len(rows) >= world:
        cap = min(cap, math.ceil(len(rows) / world))
    micros = cut(rows, seq, cap, limits.tokens)
    cost = [len(m) * int(seq[m].max()) for m in micros]
    out: list[list[Tensor]] = [[] for _ in range(world)]
    load = [0] * world
    for k in sorted(range(len(micros)), key=lambda k: -cost[k]):
        r = min(range(world), key=lambda r: (load[r], len(out[r]), r))
        out[r].append(micros[k])
        load[r] += cost[k]
    return out


def rank_plans(minibatches: list[Tensor], batch: Batch, limits: MicroLimits, world: int) -> list[list[Tensor]]:
    """Each rank's micro-batches over all ``minibatches`` (mini-batch by mini-batch)."""
    plans = [plan(mb, batch, limits, world) for mb in minibatches]
    return [[m for p in plans for m in p[r]] for r in range(world)]


def equalize(per_rank: list[list[Tensor]], batch: Batch, me: int) -> list[Micro]:
    """Rank ``me``'s micro-batches when rank r runs ``per_rank[r]``: every rank gets the same count, the
    shorter lists ending with weight-0 fillers (the shortest row)."""
    n = max((len(p) for p in per_rank), default=0)
    if n == 0:
        return []
    everyone = torch.cat([m for p in per_rank for m in p])
    filler = everyone[torch.argmin(seq_lengths(batch)[everyone])].reshape(1)
    resp = batch.lengths

    def tokens(p: list[Tensor], k: int) -> int:
        return int(resp[p[k] if k < len(p) else filler].sum())

    peaks = [max(tokens(p, k) for p in per_rank) for k in range(n)]
    mine = per_rank[me]
    return [Micro(mine[k], 1.0, peaks[k]) if k < len(mine) else Micro(filler, 0.0, peaks[k]) for k in range(n)]


def micro_batches(minibatches: list[Tensor], batch: Batch, limits: MicroLimits | int) -> list[Micro]:
    """This rank's micro-batches over ``minibatches`` (the same count on every rank)."""
    return equalize(rank_plans(minibatches, batch, MicroLimits.of(limits), world_size()), batch, rank())


def my_rows(minibatches: list[Tensor], batch: Batch, limits: MicroLimits | int) -> Tensor:
    """The rows this rank trains on (and needs values and advantages for)."""
    mine = rank_plans(minibatches, batch, MicroLimits.of(limits), world_size())[rank()]
    return torch.cat(mine) if mine else torch.zeros(0, dtype=torch.long)


def _as_minibatches(rows: Tensor | list[Tensor]) -> list[Tensor]:
    return [rows] if isinstance(rows, Tensor) else list(rows)


# -------------------------------------------------------------------------------------------- forwards


def _dev(model: Any) -> torch.device:
    return next(model.module.parameters()).device


def critic_values(critic: Any, batch: Batch, rows: Tensor) -> Tensor:
    """V(s_t) ``[len(rows), T_rows]`` fp32 with grad (T trimmed to those rows)."""
    sub = batch.select(rows).to(_dev(critic))
    v = critic(sub.input_ids, sub.attention_mask, sub.prompt_lengths)
    return gather_positions(v, sub.positions).float()


def head_chunks(policy: Any, peak_tokens: int, logit_elements: int) -> int:
    """LM-head chunks for a micro-batch whose largest per-rank share has ``peak_tokens`` response tokens."""
    head = policy.module.get_output_embeddings()
    vocab = int(getattr(head, "out_features", 0) or policy.module.config.vocab_size)
    return max(1, math.ceil(peak_tokens * vocab / max(1, logit_elements)))


def policy_logprobs(policy: Any, batch: Batch, micro: Micro, logit_elements: int, entropy: bool = True,
                    entropy_grad: bool = False, temperature: float = 1.0) -> tuple[Tensor, Tensor | None, Batch]:
    """log π of each response token ``[n, T_rows]`` fp32 (0 on padding), its entropy (or None) and the
    rows' sub-batch. ``logit_elements`` > 0: chunked LM head over the real tokens (no ``[n, T, V]``);
    0: full logits. ``entropy_grad``: the entropy enters the loss (otherwise it is a detached metric).
    ``temperature``: π is softmax(logits / temperature), the distribution the engines sampled from."""
    sub = batch.select(micro.rows).to(_dev(policy))
    if logit_elements <= 0:
        logits = gather_positions(policy(input_ids=sub.input_ids, attention_mask=sub.attention_mask).logits,
                                  sub.positions) / temperature
        logp = token_logprobs(logits, sub.response_ids)
        ent = None
        if entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = entropy_from_logits(logits)
        return logp, ent, sub
    # Only the last position's logits are computed; the final (normed) hidden states feed the chunked head.
    h = _final_hidden(policy, sub)
    r, t = (sub.mask > 0).nonzero(as_tuple=True)
    chunks = head_chunks(policy, micro.peak_tokens, logit_elements)
    lm_head = policy.module.get_output_embeddings()
    head = lm_head if temperature == 1.0 else (lambda x: lm_head(x) / temperature)
    lp, ent_flat = chunked_token_logprobs(h[r, sub.positions[r, t]], head,
                                          sub.response_ids[r, t], chunks, entropy=entropy, entropy_grad=entropy_grad)
    logp = lp.new_zeros(sub.mask.shape).index_put((r, t), lp)
    ent = ent_flat.new_zeros(sub.mask.shape).index_put((r, t), ent_flat) if entropy else None
    return logp, ent, sub


def _final_hidden(policy: Any, sub: Batch) -> Tensor:
    """The decoder's ``last_hidden_state`` ``[n, S, H]`` from a policy forward that computes the logits of one
    position only. Read with a hook on the decoder, not ``output_hidden_states=True``: that returns (and so
    keeps alive) every layer's ``[n, S, H]`` output, which activation checkpointing exists to drop (~13 GB
    for one 20k-token row of a 64-layer, 5120-wide model)."""
    seen: dict[str, Tensor] = {}

    def grab(_module: Any, _args: Any, out: Any) -> None:
        seen["h"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    handle = policy.module.get_decoder().register_forward_hook(grab)
    try:
        policy(input_ids=sub.input_ids, attention_mask=sub.attention_mask, logits_to_keep=1)
    finally:
        handle.remove()
    return seen["h"]


def _put(dst: Tensor, rows: Tensor, x: Tensor) -> None:
    dst[rows, : x.shape[1]] = x.detach().to(dst.dtype).cpu()


@torch.no_grad()
def compute_values(critic: Any, batch: Batch, rows: Tensor | list[Tensor], limits: MicroLimits | int) -> Tensor:
    """Full-size ``[B, T]`` fp32 values, filled on this rank's share of ``rows`` (a tensor, or the
    mini-batches, each dealt to the ranks as the updates deal it); 0 elsewhere."""
    out = torch.zeros(batch.mask.shape, dtype=torch.float32)
    critic.eval()
    for mb in micro_batches(_as_minibatches(rows), batch, limits):
        v = critic_values(critic, batch, mb.rows)
        if mb.weight > 0:
            _put(out, mb.rows, v)
    critic.train()
    return out * batch.mask


@torch.no_grad()
def compute_logprobs(policy: Any, batch: Batch, rows: Tensor | list[Tensor], limits: MicroLimits | int) -> Tensor:
    """Full-size ``[B, T]`` current-policy logprobs of the response tokens on this rank's share of ``rows``."""
    out = torch.zeros(batch.mask.shape, dtype=torch.float32)
    lim = MicroLimits.of(limits)
    policy.eval()
    for mb in micro_batches(_as_minibatches(rows), batch, lim):
        logp, _, _ = policy_logprobs(policy, batch, mb, lim.logit_elements, entropy=False, temperature=lim.temperature)
        if mb.weight > 0:
            _put(out, mb.rows, logp)
    policy.train()
    return out * batch.mask


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
            for micro in micro_batches([mbrows], batch, lim):
                v = critic_values(critic, batch, micro.rows)
                T = v.shape[1]
                m = ppo_mask[micro.rows, :T].to(v.device) * micro.weight
                loss, st = value_loss(v, returns[micro.rows, :T].to(v.device), m,
                                      old_values[micro.rows, :T].to(v.device), clip=value_clip,
                                      normalizer=n_tok.to(v.dtype))
                critic.backward(loss * scale, scale_wrt_gas=False)
                mb_loss += float(loss.detach())
                acc.add("value_clip_fraction", float(st["value_clip_fraction"]), float(m.sum()))
                if record is not None and epoch == 0 and micro.weight > 0:
                    _put(record, micro.rows, v)
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
    def from_config(cls, cfg: Any) -> ActorParams:
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
                logp, ent, sub = policy_logprobs(policy, batch, micro, lim.logit_elements,
                                                 entropy_grad=p.entropy_coef > 0, temperature=lim.temperature)
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
