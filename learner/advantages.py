"""Advantage estimation for VAPO: GAE, decoupled GAE and length-adaptive λ (pure torch).

Conventions: tensors are ``[B, T]`` over response tokens, right-padded, ``mask[b, t] = 1``
on real tokens. ``values[b, t] = V(s_t)``, the value of the state before token t. Rewards are zero except
on the last real token. The value after the last real token is 0 (terminal); a response cut at the
length limit is treated as terminal too (its verifier reward is the return), never bootstrapped.

GAE (Schulman et al. 2015, eq. 16):  δ_t = r_t + γ V(s_{t+1}) − V(s_t),  A_t = Σ_k (γλ)^k δ_{t+k}.
VAPO (arXiv 2504.05118, §3.2, eq. 7): the policy uses λ_policy = 1 − 1/(α·l) per sample of length l;
decoupled GAE (VC-PPO) trains the critic on λ_critic = 1 returns.

The backward recursion A_t = δ_t + c·A_{t+1} (c = γλ per row) is evaluated without a Python loop over
tokens and without the c^{-t} rescaling trick (0.95^-3000 ≈ 7e66 overflows): a log-depth doubling scan
(Hillis-Steele), y ← y + c^s·shift(y, s) for s = 1, 2, 4, ..., whose coefficients c^s are all ≤ 1 (they may
underflow to 0, which is exact truncation). On CPU the batch is processed in row blocks of ~128k elements
so the log2(T) passes run out of cache and memory traffic stays near one read of the inputs and one write
of the outputs. λ = γ = 1 is a reverse cumulative sum. The same code runs on CUDA tensors (one block, no
host synchronisation).
"""

from __future__ import annotations

import torch
from torch import Tensor


def length_adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """VAPO length-adaptive λ: ``1 − 1/(α·l)`` clamped to [0, 1].

    lengths: ``[B]`` response lengths (real tokens per sample). Returns ``[B]`` float.
    A zero-length row gets λ = 0 (it has no tokens, so λ is irrelevant).
    """
    length = lengths.to(torch.float32) if not lengths.is_floating_point() else lengths
    lam = 1.0 - 1.0 / (alpha * length.clamp(min=1e-12))
    return lam.clamp(0.0, 1.0)


_BLOCK_ELEMENTS = 1 << 17  # ~512 KiB of fp32 per array: a row block's scan passes stay in L2


def _reverse_cumsum_into(x: Tensor, out: Tensor) -> Tensor:
    """out_t = Σ_{k≥t} x_k along dim 1, as total − prefix + x (no flips, two passes)."""
    torch.cumsum(x, 1, out=out)
    return out.neg_().add_(x).add_(x.sum(1, keepdim=True))


def _scan_into(x: Tensor, c: Tensor, out: Tensor, buf: Tensor) -> Tensor:
    """out_t = Σ_{k≥0} c^k x_{t+k} for x ``[b, T]`` and c ``[b, 1]`` by doubling; x is not modified."""
    T = x.shape[1]
    shifts = []
    s = 1
    while s < T:
        shifts.append(s)
        s *= 2
    if not shifts:
        return out.copy_(x)
    # Ping-pong between two buffers, arranged so that the last pass writes into ``out``.
    targets = (out, buf) if len(shifts) % 2 == 1 else (buf, out)
    y, cp = x, c
    for i, s in enumerate(shifts):
        dst = targets[i % 2]
        torch.addcmul(y[:, :-s], y[:, s:], cp, out=dst[:, :-s])
        dst[:, -s:] = y[:, -s:]
        y, cp = dst, cp * cp
    return out


def _td_errors_into(rewards: Tensor, values: Tensor, m: Tensor, gamma: float, out: Tensor) -> Tensor:
    """δ_t = r_t + γ·V(s_{t+1})·m_{t+1} − V(s_t), zero on padding."""
    torch.sub(rewards, values, out=out)
    out[:, :-1].addcmul_(values[:, 1:], m[:, 1:], value=gamma)
    return out.mul_(m)


def _row_blocks(B: int, T: int, device: torch.device) -> int:
    if device.type != "cpu":
        return max(B, 1)
    return max(1, _BLOCK_ELEMENTS // max(T, 1))


def discounted_reverse_cumsum(x: Tensor, c: Tensor | float) -> Tensor:
    """y_t = Σ_{k≥0} c^k x_{t+k} along the last dim of ``x`` ``[B, T]``; ``c`` scalar or ``[B]`` in [0, 1]."""
    B, T = x.shape
    out = torch.empty_like(x)
    if T == 0 or B == 0:
        return out
    if not torch.is_tensor(c) and c == 1.0:
        return _reverse_cumsum_into(x, out)
    cc = c.to(dtype=x.dtype, device=x.device).reshape(B, 1) if torch.is_tensor(c) else torch.full((B, 1), float(c), dtype=x.dtype, device=x.device)
    rows = _row_blocks(B, T, x.device)
    buf = torch.empty((min(rows, B), T), dtype=x.dtype, device=x.device)
    for i in range(0, B, rows):
        j = min(i + rows, B)
        _scan_into(x[i:j], cc[i:j], out[i:j], buf[: j - i])
    return out


def _lambda_rows(lam: float | Tensor, gamma: float, B: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """c = γ·λ as a ``[B, 1]`` tensor."""
    if torch.is_tensor(lam):
        return (gamma * lam.to(device=device, dtype=dtype).clamp(0.0, 1.0)).reshape(B, 1)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be in [0, 1], got {lam}")
    return torch.full((B, 1), gamma * lam, dtype=dtype, device=device)


def _check(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float) -> None:
    if rewards.shape != values.shape or values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"rewards, values, mask must share a [B, T] shape, got {rewards.shape}, {values.shape}, {mask.shape}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")


def decoupled_gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam_actor: float | Tensor = 0.95,
    lam_critic: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Decoupled GAE (VC-PPO, used by VAPO): policy advantages with ``lam_actor`` (a float or a ``[B]``
    tensor of length-adaptive λ), critic targets with ``lam_critic`` (default 1: Monte-Carlo returns).

    rewards, values, mask: ``[B, T]``. Returns (advantages ``[B, T]`` for the policy, returns ``[B, T]``
    for the critic), both 0 on padding.
    """
    _check(rewards, values, mask, gamma)
    B, T = values.shape
    dtype, device = values.dtype, values.device
    adv = torch.empty_like(values)
    ret = torch.empty_like(values)
    if B == 0 or T == 0:
        return adv, ret
    c_actor = _lambda_rows(lam_actor, gamma, B, dtype, device)
    monte_carlo = lam_critic == 1.0 and gamma == 1.0
    c_critic = None if monte_carlo else _lambda_rows(lam_critic, gamma, B, dtype, device)
    m = mask.to(dtype)
    r = rewards.to(dtype)
    rows = _row_blocks(B, T, device)
    delta = torch.empty((min(rows, B), T), dtype=dtype, device=device)
    buf = torch.empty_like(delta)
    tmp = torch.empty_like(delta)
    for i in range(0, B, rows):
        j, n = min(i + rows, B), min(i + rows, B) - i
        rb, vb, mb = r[i:j], values[i:j], m[i:j]
        d = _td_errors_into(rb, vb, mb, gamma, delta[:n])
        _scan_into(d, c_actor[i:j], adv[i:j], buf[:n])  # zero on padding because δ is
        if c_critic is None:  # monte_carlo
            # γ = λ = 1: the critic target is the reward-to-go (δ telescopes), whatever λ_actor is.
            _reverse_cumsum_into(torch.mul(rb, mb, out=tmp[:n]), ret[i:j]).mul_(mb)
        else:
            _scan_into(d, c_critic[i:j], tmp[:n], buf[:n])
            torch.add(tmp[:n], vb, out=ret[i:j]).mul_(mb)
    return adv, ret


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded responses.

    rewards, values, mask: ``[B, T]``; lam: float or ``[B]`` per-sample λ.
    Returns (advantages ``[B, T]``, returns ``[B, T]`` = advantages + values), both 0 on padding.
    """
    _check(rewards, values, mask, gamma)
    if not torch.is_tensor(lam) and not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be in [0, 1], got {lam}")
    # One scan with per-row c = γλ; the Monte-Carlo critic side of decoupled_gae is a cheap cumsum.
    lam_rows = lam if torch.is_tensor(lam) else torch.full((values.shape[0],), float(lam), dtype=values.dtype, device=values.device)
    adv, _ = decoupled_gae(rewards, values, mask, gamma, lam_rows, 1.0)
    return adv, (adv + values) * mask.to(values.dtype)


def terminal_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Place each sample's scalar score on its last real token. scores ``[B]``, mask ``[B, T]`` → ``[B, T]``.

    Rows with no real token get no reward (their score has nowhere to go)."""
    m = mask.to(scores.dtype if scores.is_floating_point() else torch.float32)
    lengths = m.sum(-1).long()
    out = torch.zeros_like(m)
    rows = lengths > 0
    idx = (lengths - 1).clamp(min=0)
    out[rows, idx[rows]] = scores.to(out.dtype)[rows]
    return out


def group_normalized_advantages(scores: Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO/DAPO outcome advantages: (r − mean_group) / (std_group + eps). scores ``[B]`` with B = n·G,
    consecutive rows forming a group. Returns ``[B]`` (broadcast over tokens by the caller)."""
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    g = scores.reshape(-1, group_size).to(torch.float32)
    centred = g - g.mean(-1, keepdim=True)
    if std_normalize:
        centred = centred / (g.std(-1, unbiased=True, keepdim=True).nan_to_num(0.0) + eps)
    return centred.reshape(-1)


def grpo_advantages(scores: Tensor, group_index: Tensor, mask: Tensor, std_normalize: bool = True) -> Tensor:
    """GRPO outcome advantages per token (DeepSeekMath arXiv 2402.03300 §4.1.2; DAPO eq. 1):
    A_i = (r_i − mean_group) / (std_group + 1e-6) on every real token of sample i.

    scores ``[B]``; group_index ``[B]`` (rows of one group share an index, in any order; an index < 0
    marks a row outside every group, e.g. a replayed positive, which gets 0); mask ``[B, T]`` (the PPO mask).
    Returns ``[B, T]`` float32, 0 where ``mask`` is 0. Each group is normalised by
    ``group_normalized_advantages`` on its own rows."""
    adv = torch.zeros(mask.shape)
    for g in group_index.unique().tolist():
        if g < 0:
            continue
        rows = (group_index == g).nonzero().squeeze(-1)
        a = group_normalized_advantages(scores[rows], len(rows), std_normalize)
        adv[rows] = a.unsqueeze(-1)
    return adv * mask


def leave_one_out_means(scores: Tensor, group_index: Tensor) -> Tensor:
    """Each row's group mean reward without the row itself: (Σ_group r − r_i) / (n − 1).

    scores ``[B]``; group_index ``[B]`` (rows of one group share an index, in any order; < 0: outside every
    group). Returns ``[B]`` float32, NaN for a row outside every group or alone in its group (no others)."""
    s = scores.to(torch.float32)
    out = torch.full(s.shape, float("nan"))
    grouped = group_index >= 0
    if not bool(grouped.any()):
        return out
    ids, inverse = torch.unique(group_index[grouped], return_inverse=True)
    totals = torch.zeros(len(ids)).index_add_(0, inverse, s[grouped])
    counts = torch.zeros(len(ids)).index_add_(0, inverse, torch.ones(len(inverse)))
    n = counts[inverse]
    loo = (totals[inverse] - s[grouped]) / (n - 1).clamp(min=1.0)
    out[grouped] = torch.where(n > 1, loo, torch.full_like(loo, float("nan")))
    return out


def group_baseline_values(values: Tensor, mask: Tensor, scores: Tensor, group_index: Tensor) -> Tensor:
    """The critic's values shifted per response so that its first state's value is the group's leave-one-out mean
    reward: V'(s_t) = V(s_t) − V(s_0) + mean_{j≠i} r_j (algo.baseline=group_loo).

    GAE over V' keeps the critic's TD errors inside the response (the shift cancels in r_t + γV'(s_{t+1}) − V'(s_t)
    when γ = 1) and replaces its prompt-level baseline: with λ = 1, A_0 = r_i − mean_{j≠i} r_j, the group's
    leave-one-out advantage. values, mask ``[B, T]``; scores, group_index ``[B]`` (``leave_one_out_means``). A row
    without others in its group keeps its values. Returns ``[B, T]``, 0 on padding."""
    loo = leave_one_out_means(scores, group_index).to(device=values.device, dtype=values.dtype)
    shift = torch.where(torch.isnan(loo), torch.zeros_like(loo), loo - values[:, 0]) if values.shape[1] else loo[:0]
    return (values + shift[:, None]) * mask.to(values.dtype)


__all__ = ["decoupled_gae", "group_baseline_values", "leave_one_out_means", "gae", "length_adaptive_lambda", "terminal_rewards"]
