"""Test-only learner helpers: the one hand-written reference GAE that the tests compare ``learner.advantages``
against, and the environment of a learner subprocess. Synthetic sample groups are ``learner.synthetic``."""

from __future__ import annotations

from pathlib import Path

import torch


def reference_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                  lam: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE straight from the definition (Schulman et al. 2015, eq. 16), one sample and one token at a time:
    δ_t = r_t + γ·V(s_{t+1}) − V(s_t) with V = 0 after the last real token, A_t = δ_t + γλ·A_{t+1}.

    rewards, values, mask ``[B, T]`` (right-padded); lam a float or ``[B]`` per-sample λ. Returns
    (advantages, returns = advantages + values), both ``[B, T]`` and 0 on padding."""
    B, _ = rewards.shape
    adv = torch.zeros_like(values)
    for b in range(B):
        length = int(mask[b].sum())
        lam_b = float(lam[b]) if torch.is_tensor(lam) else float(lam)
        last = 0.0
        for t in reversed(range(length)):
            next_v = float(values[b, t + 1]) if t + 1 < length else 0.0
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            last = delta + gamma * lam_b * last
            adv[b, t] = last
    return adv, (adv + values) * mask


DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "CROSS_RANK", "CROSS_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    """os.environ for a learner subprocess, without the rendezvous variables this process set for itself, and
    with the repository on its path (a harness written to a temporary file imports the product by name)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.update(extra)
    return env
