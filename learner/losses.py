"""VAPO loss terms (pure torch): clip-higher token-level policy loss, value loss, positive-example NLL.

Shapes are ``[B, T]`` over response tokens with ``mask`` 1 on real tokens. Every loss takes an optional
``normalizer``: the caller passes the real-token count of the whole mini-batch summed over micro-batches
and data-parallel ranks, so that gradient accumulation gives exactly the token-level mean over the whole
mini-batch (a per-micro-batch mean would weight short micro-batches' tokens more). Without it the local
count is used.

- Policy (VAPO §3.3 / DAPO eq. 8-10, clip-higher): L = −Σ_t min(r_t·A_t, clip(r_t, 1−ε_low, 1+ε_high)·A_t) / N,
  r_t = exp(clamp(logp_t − logp_old_t, ±20)); ``loss_agg="seq_mean"`` gives the vanilla per-sequence mean instead.
  Dual clip (Ye et al. 2020, verl's ``clip_ratio_c``): for A_t < 0 the objective is bounded below by c·A_t,
  so a token whose ratio ran far above 1 + ε_high (an engine/learner mismatch, a stale sample) gives a
  bounded loss and no gradient instead of one growing linearly in r_t.
- Behaviour importance weights (``behaviour_weight``): π_prox / π_behav per token, either AReaL's (tokens
  above the cap masked) or verl's truncated importance sampling (clamped at the cap, per token or per
  sequence), and the engine/learner mismatch statistics (``mismatch_stats``).
- Value: ½(V − R)², optionally clipped around the old values (PPO value clipping).
- NLL (VAPO §3.4, eq. 10): −Σ logp over tokens of reward-1 samples / number of those tokens.
- Statistics: masked advantage whitening and the critic's explained variance, from float64 sufficient
  statistics that a caller may sum over data-parallel ranks (``reduce_sum``; ``learner.dist`` does).

Token log-probs and entropies come either from full logits (``token_logprobs``, ``entropy_from_logits``) or
from final hidden states in chunks of positions (``chunked_token_logprobs``): the second never holds more
than one chunk of ``[positions, vocab]`` logits, forward or backward, which is what lets a 20k-token
response with a 152k vocabulary fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

LOG_RATIO_CLAMP = 20.0  # |log π/π_old| bound before exp in the policy loss (e^20 ≈ 4.9e8)


def _no_reduce(stats: Tensor) -> Tensor:
    return stats


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None, eps: float = 0.0) -> Tensor:
    """Mean of ``x`` over real tokens; 0 where there are none (never NaN)."""
    m = mask.to(x.dtype)
    total = (x * m).sum() if dim is None else (x * m).sum(dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp(min=1.0) if eps == 0.0 else total / (count + eps)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8,
                  reduce_sum: Callable[[Tensor], Tensor] = _no_reduce) -> Tensor:
    """(x − mean) / sqrt(var + eps) over the real tokens, unbiased variance; 0 on padding. x, mask ``[B, T]``.

    Advantage whitening as in PPO implementations (VAPO §3 keeps it for the GAE advantages). The
    sufficient statistics (count, Σx, Σx²) are float64 sums stacked into one ``[3]`` tensor and passed
    through ``reduce_sum`` (identity by default; ``learner.dist.all_reduce_sum`` for every rank's rows), so
    one rank and N ranks run the same code. With no real token, returns ``x * mask``."""
    m = mask.double()
    a = x.double() * m
    s = reduce_sum(torch.stack([m.sum(), a.sum(), (a * a).sum()]))
    n = float(s[0])
    if n < 1:
        return x * mask
    mean = float(s[1]) / n
    var = (float(s[2]) - n * mean * mean) / max(n - 1.0, 1.0)
    return ((x - mean) * torch.rsqrt(torch.tensor(var + eps, dtype=x.dtype))) * mask


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor,
                       reduce_sum: Callable[[Tensor], Tensor] = _no_reduce) -> tuple[float, float]:
    """(1 − Var[R − V] / Var[R], mean of V) over real tokens; values, returns, mask ``[B, T]``.

    EV 1 = perfect, 0 = no better than the mean, < 0 worse; 0 when Var[R] ≤ 1e-12 or fewer than two
    tokens. Unbiased variances from float64 sums of (count, ΣR, ΣR², Σd, Σd², ΣV) with d = R − V, stacked
    into one ``[6]`` tensor and passed through ``reduce_sum`` (see ``masked_whiten``)."""
    m = mask.double()
    v, r = values.double() * m, returns.double() * m
    d = (r - v) * m
    s = reduce_sum(torch.stack([m.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum(), v.sum()]))
    n = float(s[0])
    if n < 2:
        return 0.0, float(s[5] / max(n, 1.0))
    var_r = (float(s[2]) - float(s[1]) ** 2 / n) / (n - 1)
    var_d = (float(s[4]) - float(s[3]) ** 2 / n) / (n - 1)
    ev = 0.0 if var_r <= 1e-12 else 1.0 - var_d / var_r
    return ev, float(s[5]) / n


def _aggregate(per_token: Tensor, mask: Tensor, loss_agg: str, normalizer: Tensor | float | None) -> Tensor:
    m = mask.to(per_token.dtype)
    if loss_agg == "token_mean":
        denom = m.sum() if normalizer is None else normalizer
        return (per_token * m).sum() / torch.as_tensor(denom, dtype=per_token.dtype, device=per_token.device).clamp(min=1.0)
    if loss_agg == "seq_mean":
        # normalizer (if given) is the number of sequences across micro-batches / ranks.
        seq = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        has = (m.sum(-1) > 0).to(per_token.dtype)
        denom = has.sum() if normalizer is None else normalizer
        return (seq * has).sum() / torch.as_tensor(denom, dtype=per_token.dtype, device=per_token.device).clamp(min=1.0)
    raise ValueError(f"loss_agg must be token_mean or seq_mean, got {loss_agg!r}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    loss_agg: str = "token_mean",
    normalizer: Tensor | float | None = None,
    importance_weight: Tensor | None = None,
    clip_ratio_c: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-higher PPO surrogate. All inputs ``[B, T]``.

    ``old_logprobs`` are the logprobs the ratio is taken against (behaviour, or the recomputed proximal
    policy); ``importance_weight`` (decoupled / rollout correction) multiplies each token's objective by the
    behaviour weight (``behaviour_weight``) and carries no gradient. ``clip_ratio_c`` > 1: dual clip, the
    objective of a token with A < 0 is max(min(r·A, clip(r)·A), c·A) (0 = off).

    Returns (loss, stats) with stats: clip_fraction_low, clip_fraction_high, clip_fraction_dual, approx_kl,
    ratio_mean (detached token means over real tokens of this call).
    """
    log_ratio = (logprobs - old_logprobs) * mask.to(logprobs.dtype)
    # exp overflows fp32 past 88.7, and the clipped branch's zero gradient times an infinite ratio is NaN.
    # Past |log r| = 20 a token is clipped or dual-clipped already, except A < 0 with the dual clip off,
    # whose gradient (linear in r) is then cut to 0 instead of growing without bound.
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    obj = torch.minimum(ratio * advantages, clipped * advantages)
    dual = torch.zeros_like(obj, dtype=torch.bool)
    if clip_ratio_c > 0.0:
        bound = clip_ratio_c * advantages
        dual = (advantages < 0) & (obj < bound)
        obj = torch.where(dual, bound, obj)
    if importance_weight is not None:
        obj = obj * importance_weight.detach()
    loss = _aggregate(-obj, mask, loss_agg, normalizer)
    with torch.no_grad():
        low = ((ratio < 1.0 - clip_low) & (advantages < 0)).to(logprobs.dtype)
        high = ((ratio > 1.0 + clip_high) & (advantages > 0)).to(logprobs.dtype)
        stats = {
            "clip_fraction_low": masked_mean(low, mask),
            "clip_fraction_high": masked_mean(high, mask),
            "clip_fraction_dual": masked_mean(dual.to(logprobs.dtype), mask),
            # k1 estimator of KL(old || new), as verl's ppo_kl.
            "approx_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def behaviour_weight(prox_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float,
                     mode: str = "mask", level: str = "token") -> Tensor:
    """Importance weight π_prox / π_behav ``[B, T]`` (0 on padding) that corrects a ratio taken against the
    proximal (learner-recomputed) policy for the tokens having been sampled by the behaviour (engine) policy.

    ``mode="mask"`` (AReaL's decoupled objective): a token whose weight exceeds ``cap`` gets weight 0 (its
    loss is dropped; the normaliser still counts it). ``mode="truncate"`` (verl's truncated importance
    sampling): the weight is min(w, cap). ``level="sequence"`` uses one weight per row, exp(Σ_t log w_t)
    over its real tokens (truncate only: computed in log space, so a long row cannot overflow)."""
    m = mask.to(prox_logprobs.dtype)
    log_w = (prox_logprobs - behaviour_logprobs) * m
    if level == "sequence":
        if mode != "truncate":
            raise ValueError("sequence-level weights are truncated, not masked")
        seq = log_w.sum(-1, keepdim=True).clamp(max=math.log(cap))
        return torch.exp(seq).expand_as(m) * m
    if level != "token":
        raise ValueError(f"level must be token or sequence, got {level!r}")
    w = torch.exp(log_w)
    if mode == "mask":
        return torch.where(w > cap, torch.zeros_like(w), w) * m
    if mode == "truncate":
        return w.clamp(max=cap) * m
    raise ValueError(f"mode must be mask or truncate, got {mode!r}")


def mismatch_stats(learner_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> tuple[float, float, float]:
    """Engine/learner mismatch over real tokens: (Σ_t KL estimate, token count, max ratio π_learner/π_behav).

    The KL is KL(π_behav ‖ π_learner) per token by the k3 estimator (r − 1) − log r with r = π_learner/π_behav
    (unbiased for tokens sampled from π_behav, never negative; verl's rollout-correction KL). Only
    meaningful when both log-probs belong to the same weights (the rows' weight version). Sums, not a mean,
    so that micro-batches and ranks add up."""
    m = mask.bool()
    if not bool(m.any()):
        return 0.0, 0.0, 0.0
    log_r = (learner_logprobs.double() - behaviour_logprobs.double())[m]
    k3 = torch.expm1(log_r) - log_r
    return float(k3.sum()), float(m.sum()), float(torch.exp(log_r.max()))


def value_loss(
    values: Tensor,
    returns: Tensor,
    mask: Tensor,
    old_values: Tensor | None = None,
    clip: float = 0.0,
    normalizer: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """½(V − R)² token mean; with ``clip > 0`` and ``old_values`` the PPO clipped variant
    max((V − R)², (clip(V, V_old ± clip) − R)²). Returns (loss, stats: value_clip_fraction)."""
    err = (values - returns) ** 2
    clip_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    if clip > 0.0 and old_values is not None:
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (v_clipped - returns) ** 2
        with torch.no_grad():
            clip_frac = masked_mean((err_clipped > err).to(values.dtype), mask)
        err = torch.maximum(err, err_clipped)
    loss = 0.5 * _aggregate(err, mask, "token_mean", normalizer)
    return loss, {"value_clip_fraction": clip_frac}


def nll_loss(
    logprobs: Tensor, mask: Tensor, rewards: Tensor, normalizer: Tensor | float | None = None, threshold: float = 1.0
) -> Tensor:
    """Positive-example LM loss: −Σ logp over the tokens of samples with reward ≥ ``threshold`` divided by
    those tokens' count (``normalizer`` if given: the count across micro-batches and ranks).

    logprobs, mask ``[B, T]``; rewards ``[B]``. With no positive sample the loss is an exact 0 that keeps
    the graph (gradient 0), never NaN."""
    pos = (rewards >= threshold).to(logprobs.dtype).unsqueeze(-1) * mask.to(logprobs.dtype)
    total = -(logprobs * pos).sum()
    denom = pos.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=logprobs.dtype, device=logprobs.device)
    return total / denom.clamp(min=1.0)


def positive_token_count(mask: Tensor, rewards: Tensor, threshold: float = 1.0) -> Tensor:
    """Number of response tokens belonging to reward ≥ threshold samples (the NLL normaliser)."""
    return ((rewards >= threshold).to(mask.dtype).unsqueeze(-1) * mask).sum()


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy ``[B, T]`` of the categorical distributions in ``logits`` ``[B, T, V]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log π(tokens) from logits ``[B, T, V]`` aligned with ``tokens`` ``[B, T]`` → ``[B, T]`` fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, tokens.long().unsqueeze(-1)).squeeze(-1)


def _head_logprobs_entropy(hidden: Tensor, tokens: Tensor, head: Callable[[Tensor], Tensor],
                           entropy: bool = True, entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """One chunk: hidden ``[n, H]`` → (log π(tokens) ``[n]``, entropy ``[n]`` or zeros), both fp32."""
    logp = torch.log_softmax(head(hidden).float(), dim=-1)
    lp = torch.gather(logp, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return lp, torch.zeros_like(lp)
    # A metric-only entropy must not enter the graph: its nodes would never run in the backward, and the
    # [n, V] tensors they saved (recomputed with the chunk) would stay alive until the backward ends.
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return lp, -(logp.exp() * logp).sum(-1)


def chunked_token_logprobs(hidden: Tensor, head: Callable[[Tensor], Tensor], tokens: Tensor, chunks: int,
                           recompute: bool = True, entropy: bool = True,
                           entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """log π(tokens) and the entropy of π from final hidden states, ``chunks`` pieces of positions at a time.

    hidden ``[N, H]`` (the states that score each token), tokens ``[N]``, ``head`` the LM head (``[n, H] →
    [n, V]``) → (logprobs ``[N]``, entropy ``[N]``) fp32, equal to ``token_logprobs`` /
    ``entropy_from_logits`` of ``head(hidden)``. With ``recompute`` (and autograd on), each chunk runs
    under non-reentrant activation checkpointing: its ``[n, V]`` logits are freed after the forward and
    rebuilt for the backward, one chunk at a time. The entropy is exact on every position (it reuses the
    chunk's log-softmax, no second pass); it carries a gradient only with ``entropy_grad`` (an entropy
    bonus in the loss), and is zeros when ``entropy`` is False.

    ``chunks`` is a count, not a size, on purpose: under ZeRO-3 every call of ``head`` gathers its weight
    across ranks, so all ranks must make the same number of calls for a micro-batch (the scheduler gives
    every rank the same count; a chunk may be empty)."""
    if hidden.shape[0] != tokens.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} positions, tokens {tokens.shape[0]}")
    lps, ents = [], []
    for h, tok in zip(hidden.tensor_split(max(1, chunks)), tokens.tensor_split(max(1, chunks)), strict=True):
        if recompute and torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_head_logprobs_entropy, h, tok, head, entropy, entropy_grad, use_reentrant=False)
        else:
            lp, ent = _head_logprobs_entropy(h, tok, head, entropy, entropy_grad)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


__all__ = ["explained_variance", "masked_whiten", "mismatch_stats"]
