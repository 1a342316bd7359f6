"""Advantage estimation for VAPO: GAE, decoupled GAE and length-adaptive λ (pure torch).

Conventions (DESIGN.md §3): tensors are ``[B, T]`` over response tokens, right-padded, ``mask[b, t] = 1``
on real tokens. ``values[b, t] = V(s_t)``, the value of the state before token t. Rewards are zero except
on the last real token. The value after the last real token is 0 (terminal); a response cut at the
length limit is treated as terminal too (its verifier reward is the return), never bootstrapped.

GAE (Schulman et al. 2015, eq. 16):  δ_t = r_t + γ V(s_{t+1}) − V(s_t),  A_t = Σ_k (γλ)^k δ_{t+k}.
VAPO (arXiv 2504.05118, §3.2, eq. 7): the policy uses λ_policy = 1 − 1/(α·l) per sample of length l;
decoupled GAE (VC-PPO) trains the critic on λ_critic = 1 returns.

The backward recursion A_t = δ_t + c·A_{t+1} (c = γλ per row) is evaluated without a Python loop over
tokens and without the overflowing c^{-t} rescaling: time is split into chunks of K tokens, each chunk
is solved by a small triangular matmul with entries c^{j-i} ≤ 1, and the chunks are joined by a second
triangular matmul over chunk starts with entries (c^K)^{m-n}. Cost O(B·T·K), memory O(B·T + B·K²).
Every power is ≤ 1, so nothing overflows for any λ ∈ [0, 1]; it runs unchanged on CUDA tensors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def length_adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """VAPO length-adaptive λ: ``1 − 1/(α·l)`` clamped to [0, 1].

    lengths: ``[B]`` response lengths (real tokens per sample). Returns ``[B]`` float.
    A zero-length row gets λ = 0 (it has no tokens, so λ is irrelevant).
    """
    l = lengths.to(torch.float32) if not lengths.is_floating_point() else lengths
    lam = 1.0 - 1.0 / (alpha * l.clamp(min=1e-12))
    return lam.clamp(0.0, 1.0)


def _td_errors(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """δ_t = r_t + γ·V(s_{t+1})·m_{t+1} − V(s_t), zero on padding. ``[B, T]``."""
    m = mask.to(values.dtype)
    v = values * m
    next_v = torch.zeros_like(v)
    next_v[:, :-1] = v[:, 1:]
    return (rewards * m + gamma * next_v - v) * m


def _chunk_size(T: int) -> int:
    # K ≈ sqrt(T) balances the in-chunk (B·T·K) and cross-chunk (B·(T/K)²) matmuls.
    return max(4, min(128, 1 << max(2, math.ceil(math.log2(max(T, 1)) / 2))))


def _powers(c: Tensor, n: int) -> Tensor:
    """[B, n] with c^0 .. c^{n-1} (0^0 = 1)."""
    exps = torch.arange(n, device=c.device, dtype=c.dtype)
    return torch.pow(c.unsqueeze(-1), exps)


def _upper_toeplitz(powers: Tensor) -> Tensor:
    """[B, K, K] matrix M[b, i, j] = powers[b, j − i] for j ≥ i, else 0."""
    K = powers.shape[-1]
    idx = torch.arange(K, device=powers.device)
    diff = idx.unsqueeze(0) - idx.unsqueeze(1)  # [K, K] = j - i
    upper = diff >= 0
    M = powers[:, diff.clamp(min=0)]
    return M * upper.to(powers.dtype)


def discounted_reverse_cumsum(x: Tensor, c: Tensor | float) -> Tensor:
    """y_t = Σ_{k≥0} c^k x_{t+k} along the last dim of ``x`` ``[B, T]``; ``c`` scalar or ``[B]`` in [0, 1]."""
    B, T = x.shape
    if T == 0 or B == 0:
        return torch.zeros_like(x)
    if not torch.is_tensor(c):
        if c == 1.0:
            return torch.flip(torch.cumsum(torch.flip(x, (-1,)), -1), (-1,))
        c = torch.full((B,), float(c), dtype=x.dtype, device=x.device)
    c = c.to(dtype=x.dtype, device=x.device).reshape(B)
    K = _chunk_size(T)
    N = -(-T // K)
    pad = N * K - T
    xs = torch.nn.functional.pad(x, (0, pad)).view(B, N, K)
    pw = _powers(c, K + 1)  # c^0 .. c^K
    M = _upper_toeplitz(pw[:, :K])  # [B, K, K]
    local = torch.bmm(xs, M.transpose(1, 2))  # [B, N, K]: sums within each chunk
    if N > 1:
        starts = local[:, :, 0]  # [B, N]: local sum from each chunk start
        M2 = _upper_toeplitz(_powers(pw[:, K], N))  # [B, N, N] with (c^K)^{m-n}
        full_starts = torch.bmm(M2, starts.unsqueeze(-1)).squeeze(-1)  # y at each chunk start
        carry = torch.zeros_like(full_starts)
        carry[:, :-1] = full_starts[:, 1:]  # y at the start of the next chunk
        tail = torch.flip(pw[:, 1:], (-1,))  # c^{K-i} for i = 0..K-1
        local = local + tail.unsqueeze(1) * carry.unsqueeze(-1)
    return local.reshape(B, N * K)[:, :T]


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded responses.

    rewards, values, mask: ``[B, T]``; lam: float or ``[B]`` per-sample λ.
    Returns (advantages ``[B, T]``, returns ``[B, T]`` = advantages + values), both 0 on padding.
    """
    if rewards.shape != values.shape or values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"rewards, values, mask must share a [B, T] shape, got {rewards.shape}, {values.shape}, {mask.shape}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    m = mask.to(values.dtype)
    delta = _td_errors(rewards.to(values.dtype), values, mask, gamma)
    if torch.is_tensor(lam):
        c = gamma * lam.to(device=values.device, dtype=values.dtype).clamp(0.0, 1.0)
    else:
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lambda must be in [0, 1], got {lam}")
        c = gamma * lam
    adv = discounted_reverse_cumsum(delta, c) * m
    returns = (adv + values) * m
    return adv, returns


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

    Returns (advantages ``[B, T]`` for the policy, returns ``[B, T]`` for the critic).
    """
    advantages, _ = gae(rewards, values, mask, gamma, lam_actor)
    _, returns = gae(rewards, values, mask, gamma, lam_critic)
    return advantages, returns


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
