"""Configs and data shared by the learner-step tests (train, update, models, data, token versions,
distributed); no tests here. The models are the session's ``tiny_model_dir`` (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.config import load_config
from learner.synthetic import synth_groups

VOCAB = 60  # the tiny model's char tokenizer


def make_cfg(model_dir: Path, *extra: str) -> Any:
    """A one-rank CPU learner config small enough for a step in seconds; ``extra``: more overrides."""
    return load_config(None, [
        f"model.path={model_dir}", "learner.micro_batch_size=3", "learner.mini_batches=2", "learner.batch_groups=4",
        "learner.actor_lr=1e-3", "learner.critic_lr=2e-3", "learner.grad_clip=1.0", "algo.alpha=0.5",
        "learner.value_head_init_std=0.02", "metrics.prometheus=false", *extra,
    ])


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference between two state dicts with the same keys."""
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def zero3_data() -> tuple[list, list, list]:
    """(groups for the fetched step, stored positives to replay, 3 groups of one row for the odd step): the
    same batches for the two-rank ZeRO-3 harness (a subprocess) and its one-rank reference."""
    groups = synth_groups(4, 3, 60, seed=41, resp_len=(1, 8)) + synth_groups(
        1, 3, 60, seed=42, resp_len=(120, 150), max_new_tokens=150)
    positives = [s for g in synth_groups(2, 2, 60, seed=43, resp_len=(2, 30), max_new_tokens=30) for s in g.samples]
    for s in positives:
        s.reward = 1.0
    odd = synth_groups(3, 1, 60, seed=44, resp_len=(1, 90), max_new_tokens=90)
    return groups, positives, odd
