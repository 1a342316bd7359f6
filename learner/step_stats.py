"""What one learner step reports: its phase timings, its summary record and their Prometheus export.

Not a CLI. ``learner.train.Learner.step`` times its phases with ``Phases``, ends with ``step_summary`` (the
``learner_step`` record ``learner.runner`` appends to metrics.jsonl), ``Throughput.stats`` (model FLOPs,
tokens/s and TFLOP/s per phase per rank, MFU) and ``export_step`` (the learner's gauges); ``learner.runner``
times its own work between steps with ``Phases`` too.

MFU = model FLOPs (``learner.compute.step_model_flops``: no padding, no recomputation) / seconds / ranks /
the device's peak (``common.device_peak.learner_peak``: ``learner.peak_tflops``, a known GPU's datasheet
figure, or on the CPU a matmul ceiling measured when the learner starts, reported as ``peak_tflops_measured``).
A phase's FLOPs are the whole batch's (every rank's rows) over its wall seconds on this rank, divided by
the ranks; the step's over its busy seconds (the step without ``fetch``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import Tensor

from common.config import Config
from common.device_peak import learner_peak, raised_cpu_peak
from common.gpu_memory import read_model_config
from common.metrics import Metrics
from learner.batch import Batch
from learner.compute import ModelShape, model_shape, step_model_flops
from learner.dist import world_size
from learner.models import critic_base

log = logging.getLogger("learner")

# Gauges set from the step's statistics of the same name, when the step produced them.
_GAUGES = ("critic_loss", "value_explained_variance", "value_mean", "policy_loss", "nll_loss",
           "clip_fraction_low", "clip_fraction_high", "clip_fraction_dual", "approx_kl", "entropy",
           "lambda_actor_mean", "reward_mean", "positives_fraction", "response_length_mean",
           "tokens_per_second", "tokens_per_second_per_rank", "mismatch_tokens")


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


class Throughput:
    """The models' shapes and the device's peak, fixed when the learner starts; ``stats`` gives a step's
    throughput fields. Without a readable config.json there are no FLOPs (a warning says so); without a
    known peak (an unknown GPU) no MFU."""

    def __init__(self, cfg: Config, critic_path: str | Path | None = None) -> None:
        lc = cfg.learner
        self.epochs, self.surprise, self.world = lc.ppo_epochs, lc.value_head_surprise, world_size()
        self.policy: ModelShape | None = None
        self.critic: ModelShape | None = None
        hf = read_model_config(cfg.model.path)
        critic_hf = read_model_config(critic_path or critic_base(cfg)) if cfg.algo.advantage == "gae" else None
        try:
            self.policy = model_shape(hf) if hf is not None else None
            self.critic = model_shape(critic_hf, critic=True) if critic_hf is not None else None
            hidden = int(hf.get("text_config", hf)["hidden_size"]) if hf is not None else 0
        except (KeyError, TypeError, ValueError) as e:
            self.policy, hidden = None, 0
            log.warning("no model FLOPs or MFU: cannot read the model shape from %s/config.json (%s)", cfg.model.path, e)
        if hf is None:
            log.warning("no model FLOPs or MFU: no config.json under model.path=%s", cfg.model.path)
        elif cfg.algo.advantage == "gae" and critic_hf is None:
            log.warning("the critic's phases count no model FLOPs: no config.json for the critic under %s",
                        critic_path or critic_base(cfg))
        self.hidden, self.precision = hidden, lc.precision
        self.peak, self.peak_source = (learner_peak(lc.peak_tflops, cfg.run.device, lc.precision, hidden)
                                       if self.policy is not None else (None, "unknown"))
        if self.policy is not None and self.peak is None:
            log.warning("no MFU: the learner device's peak is unknown (set learner.peak_tflops)")

    def stats(self, batch: Batch, s: Mapping[str, Any], value_pass: bool,
              rows: Mapping[str, Tensor] | None = None) -> dict[str, Any]:
        """Throughput fields of the step whose record so far is ``s`` (its ``phase_seconds``, ``step_seconds``,
        ``tokens_per_second``); ``rows``: the rows each phase ran (``learner.compute.step_model_flops``)."""
        work = ({} if self.policy is None else
                step_model_flops(batch, s["phase_seconds"], self.epochs, value_pass, self.policy, self.critic,
                                 self.surprise, rows))
        busy = s["step_seconds"] - s["phase_seconds"].get("fetch", 0.0)
        out = throughput(work, s["phase_seconds"], busy, s["tokens_per_second"], self.world, self.peak)
        if self.peak_source == "measured" and self.peak and "mfu" in out:
            reached = max(out["tflops_per_rank"], *out["phase_tflops_per_rank"].values())
            low, self.peak = self.peak, raised_cpu_peak(self.peak, reached, self.hidden, self.precision)
            if self.peak != low:
                log.info("the CPU matmul ceiling (%.4g TFLOP/s) was timed low: a step reached %.4g; timed again, "
                         "MFU is now against %.4g", low, reached, self.peak)
                out = throughput(work, s["phase_seconds"], busy, s["tokens_per_second"], self.world, self.peak)
            out["peak_tflops_measured"] = self.peak
        return out


def throughput(work: Mapping[str, tuple[float, int]], phase_seconds: Mapping[str, float], busy_seconds: float,
               tokens_per_second: float, world: int, peak_tflops: float | None) -> dict[str, Any]:
    """Per phase of ``work`` (``{phase: (model FLOPs, tokens)}``, the whole batch's): tokens/s, TFLOP/s per
    rank and MFU against ``peak_tflops`` (None: no MFU); the same for the step over ``busy_seconds``; the
    step's ``tokens_per_second`` per rank."""
    world = max(world, 1)

    def per_rank(flops: float, seconds: float) -> float:
        return flops / max(seconds, 1e-9) / world / 1e12

    out: dict[str, Any] = {"tokens_per_second_per_rank": tokens_per_second / world}
    if not work:
        return out
    total = sum(f for f, _ in work.values())
    out.update({
        "model_flops": total, "phase_model_flops": {p: f for p, (f, _) in work.items()},
        "phase_tokens_per_second": {p: n / max(phase_seconds[p], 1e-9) for p, (_, n) in work.items()},
        "phase_tflops_per_rank": {p: per_rank(f, phase_seconds[p]) for p, (f, _) in work.items()},
        "tflops_per_rank": per_rank(total, busy_seconds),
    })
    if peak_tflops:
        out["phase_mfu"] = {p: v / peak_tflops for p, v in out["phase_tflops_per_rank"].items()}
        out["mfu"] = out["tflops_per_rank"] / peak_tflops
        out["peak_tflops"] = peak_tflops
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
    export_throughput(metrics, s)
    metrics.samples.inc(s["samples"])


def export_throughput(metrics: Metrics, s: Mapping[str, Any]) -> None:
    """The per-phase throughput gauges, the step's under ``phase="step"``; a step without them sets none."""
    for phase, v in s.get("phase_tokens_per_second", {}).items():
        metrics.phase_tokens_per_second.labels(phase=phase).set(v)
    for gauge, phases, step in ((metrics.tflops_per_rank, "phase_tflops_per_rank", "tflops_per_rank"),
                                (metrics.mfu, "phase_mfu", "mfu")):
        for phase, v in s.get(phases, {}).items():
            gauge.labels(phase=phase).set(v)
        if step in s:
            gauge.labels(phase="step").set(s[step])
