"""What one learner step reports: its phase timings, its summary record and their Prometheus export.

Not a CLI. ``learner.train.Learner.step`` times its phases with ``Phases``, ends with ``step_summary`` (the
``learner_step`` record ``learner.runner`` appends to metrics.jsonl) and ``export_step`` (the learner's
gauges); ``learner.runner`` times its own work between steps with ``Phases`` too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from common.metrics import Metrics
from learner.batch import Batch

# Gauges set from the step's statistics of the same name, when the step produced them.
_GAUGES = ("critic_loss", "value_explained_variance", "value_mean", "policy_loss", "nll_loss",
           "clip_fraction_low", "clip_fraction_high", "clip_fraction_dual", "approx_kl", "entropy",
           "lambda_actor_mean", "reward_mean", "positives_fraction", "response_length_mean",
           "tokens_per_second", "mismatch_tokens")


class Phases:
    """Wall-clock seconds per named phase of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def token_staleness(version: int, token_versions: Tensor, mask: Tensor) -> dict[str, float]:
    """Mean and max versions between each real token's weights and ``version``."""
    st = (version - token_versions[mask > 0]).clamp(min=0).float()
    return {"token_staleness_mean": float(st.mean()) if st.numel() else 0.0,
            "token_staleness_max": float(st.max()) if st.numel() else 0.0}


def step_summary(b: Batch, *, staleness: Tensor, version: int, positive_reward: float, policy: Any,
                 critic: Any | None, phases: Phases, t_start: float) -> dict[str, Any]:
    """The step's batch, throughput and learning-rate statistics; ``version`` is the one the step made."""
    real = ~b.is_replay
    n_real = max(int(real.sum()), 1)
    tokens = int((b.prompt_lengths + b.lengths).sum())
    busy = time.perf_counter() - t_start - phases.seconds.get("fetch", 0.0)
    out = {
        "step": version, "weight_version": version, "time": time.time(),
        "reward_mean": float(b.rewards[real].sum()) / n_real,
        "positives_fraction": float((b.rewards[real] >= positive_reward).sum()) / n_real,
        "response_length_mean": float(b.lengths[real].sum()) / n_real,
        "truncated_fraction": float(b.truncated[real].sum()) / n_real,
        "samples": n_real, "replay_positives": int(b.is_replay.sum()),
        "staleness_mean": float(staleness.float().mean()) if len(staleness) else 0.0,
        "staleness_max": int(staleness.max()) if len(staleness) else 0,
        # Per token (an in-place update mid-generation makes a sample's tokens of several versions; its
        # staleness above counts from its oldest): the weights being updated were version - 1.
        **token_staleness(version - 1, b.token_versions[real], b.mask[real]),
        "tokens": tokens, "tokens_per_second": tokens / max(busy, 1e-9),
        "actor_lr": float(policy.get_lr()[0]),
        "phase_seconds": dict(phases.seconds), "step_seconds": time.perf_counter() - t_start,
    }
    if critic is not None:
        out["critic_lr"] = float(critic.get_lr()[0])
    return out


def export_step(metrics: Metrics, s: dict[str, Any], staleness: Tensor) -> None:
    """Set the learner's gauges, histograms and counters from one step's statistics ``s``."""
    metrics.step.set(s["step"])
    metrics.last_step_timestamp_seconds.set(s["time"])
    for key in _GAUGES:
        if key in s:
            getattr(metrics, key).set(s[key])
    if s.get("mismatch_tokens", 0) > 0:  # a step without rows of its own version keeps the last measurement
        metrics.mismatch_kl.set(s["mismatch_kl"])
        metrics.mismatch_ratio_max.set(s["mismatch_ratio_max"])
        if "mismatch_ratio_min" in s:  # measured in the proximal pass (learner.mismatch)
            metrics.mismatch_ratio_min.set(s["mismatch_ratio_min"])
            for key in (k for k in s if k.startswith("mismatch_kl_len_")):
                metrics.mismatch_kl_by_length.labels(length_bin=key.removeprefix("mismatch_kl_len_")).set(s[key])
    if "oracle_explained_variance" in s:
        metrics.oracle_explained_variance.set(s["oracle_explained_variance"])
    metrics.grad_norm.labels(model="actor").set(s.get("actor_grad_norm", float("nan")))
    metrics.lr.labels(model="actor").set(s["actor_lr"])
    if "critic_lr" in s:
        metrics.grad_norm.labels(model="critic").set(s.get("critic_grad_norm", float("nan")))
        metrics.lr.labels(model="critic").set(s["critic_lr"])
    for v in staleness.tolist():
        metrics.staleness.observe(v)
    metrics.data_wait_seconds.inc(s["phase_seconds"].get("fetch", 0.0))
    for phase, sec in s["phase_seconds"].items():
        metrics.phase_seconds.labels(phase=phase).set(sec)
    metrics.samples.inc(s["samples"])
