"""Value pretraining (VAPO §3.1): fit the critic to λ = 1 Monte-Carlo targets with the policy frozen.

    python -m learner.value_pretrain [config.yaml] [key=value ...]     # standalone
    (``python -m learner`` runs it first when value_pretrain.enabled and no checkpoint exists)

The actors sample from the initial policy (nothing new is published while this runs, so every group is
version 0) and the buffer serves their groups. ``value_pretrain.eval_groups`` groups are held out first;
each step trains the critic on a fresh batch of ``value_pretrain.batch_groups`` groups (mini-batches from
learner.critic_updates, else learner.mini_batches; one epoch) and measures the explained variance of its values
on the held-out groups. With ``value_pretrain.pool_groups`` a pool of groups is drawn once instead and the critic
trains on it in epochs (each a fresh shuffle cut into batches). It stops after ``value_pretrain.steps`` or when
that explained variance has not improved for ``value_pretrain.patience`` steps, then saves the critic to
``<run dir>/critic_pretrained`` (HF backbone + ``value_head.safetensors``), where the RL learner picks it up. A
critic whose best held-out explained variance is <= 0 is refused (saved, then an error) when
``value_pretrain.allow_untrained_critic`` is false. EV and loss go to metrics (``vapo_learner_value_pretrain_*``)
and ``metrics.jsonl``.

Deviation: the critic's own learning rate here is ``value_pretrain.lr``; with γ = 1 and λ = 1 the target
at every real token is the sample's final reward (never the actor's λ-return: that would feed the
critic's own errors back into its targets).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.cli import config_from_argv, setup_logging
from common.config import Config
from common.metrics import Metrics
from common.modeling import load_tokenizer, pad_token_id
from common.protocol import SampleGroup
from learner.advantages import gae, terminal_rewards
from learner.batch import collate_scored
from learner.compute import batch_tokens
from learner.data import BufferSource, DataSource, fetch, row_limits
from learner.dist import global_explained_variance, rank
from learner.forwards import compute_values
from learner.host_tensors import load_host_tensors
from learner.models import build_critic, collect, full_state_dict, release, save_critic
from learner.records import RunRecords
from learner.schedule import MicroLimits, minibatch_rows, my_rows
from learner.update import critic_update

log = logging.getLogger("learner.value_pretrain")


def value_targets(batch: Any, values: torch.Tensor, gamma: float) -> torch.Tensor:
    """The critic's regression targets: λ = 1 GAE returns of the terminal scores (Monte Carlo returns)."""
    _, returns = gae(terminal_rewards(batch.scores, batch.mask), values, batch.mask, gamma, 1.0)
    return returns


def heldout_ev(critic: Any, batch: Any, gamma: float, mbs: MicroLimits | int) -> tuple[float, float]:
    """(explained variance, value mean) of the critic on ``batch`` (rows shared across ranks)."""
    everything = [torch.arange(batch.size)]
    rows = my_rows(everything, batch, mbs)
    values = compute_values(critic, batch, everything, mbs)
    return global_explained_variance(values[rows], value_targets(batch, values, gamma)[rows], batch.mask[rows])


def _snapshot(critic: Any) -> dict[str, torch.Tensor] | None:
    """A host copy of the critic's full weights on rank 0 (None elsewhere); collective under ZeRO-3.

    Under ZeRO-3 the parameters are gathered a bounded group at a time and only rank 0 keeps a copy: a
    copy on every rank would cost the critic's whole size in host memory per rank at every improvement."""
    state = full_state_dict(critic, copy=True)
    return state if rank() == 0 else None


@dataclass
class _Best:
    """The best critic so far on the held-out groups: the one that goes on to RL, not the last.

    Patience stops after a run of non-improving steps, and those steps can have made the critic worse."""

    explained_variance: float
    state: dict[str, torch.Tensor] | None
    step: int = 0
    steps_since: int = 0


def _usable_fetcher(cfg: Config, source: DataSource | None, metrics: Metrics) -> Callable[[int], list[SampleGroup]]:
    """``n -> n groups``; rows the learner cannot use are dropped, counted, asked for again."""
    limits = row_limits(cfg)

    def dropped(reason: str, count: int) -> None:
        metrics.unusable_samples.labels(reason=reason).inc(count)
        log.warning("value pretraining: dropped %d batch samples the learner cannot use: %s", count, reason)

    def usable(n: int) -> list[SampleGroup]:
        return fetch(source, 0, n, cfg.learner.batch_timeout_s, limits=limits, count=dropped)[0]

    return usable


def pooled_batches(groups: list[SampleGroup], batch_groups: int, seed: int) -> Callable[[], list[SampleGroup]]:
    """``() -> the next batch`` of ``batch_groups`` groups from ``groups``, epoch after epoch: each epoch a seeded
    permutation cut into ``len(groups) // batch_groups`` batches (the remainder sits that epoch out)."""
    per_epoch = max(1, len(groups) // batch_groups)
    state = {"epoch": 0, "k": per_epoch}
    order: list[int] = []

    def next_batch() -> list[SampleGroup]:
        if state["k"] >= per_epoch:
            g = torch.Generator().manual_seed(int(seed) * 1_000_003 + state["epoch"])
            order[:] = torch.randperm(len(groups), generator=g).tolist()
            state["epoch"] += 1
            state["k"] = 0
        k = state["k"]
        state["k"] += 1
        return [groups[i] for i in order[k * batch_groups:(k + 1) * batch_groups]]

    return next_batch


def check_trained(cfg: Config, critic_dir: Path) -> None:
    """Refuse a pretrained critic whose best held-out explained variance is <= 0 (it predicts the returns no
    better than their mean) unless ``value_pretrain.allow_untrained_critic``; ``critic_dir`` as saved here."""
    info = critic_dir / "value_pretrain.json"
    if cfg.value_pretrain.allow_untrained_critic or not info.is_file():
        return
    ev = float(json.loads(info.read_text())["explained_variance"])
    if ev <= 0.0:
        raise RuntimeError(f"value pretraining: the critic in {critic_dir} has best held-out explained variance "
                           f"{ev:.4f} <= 0; RL will not start from it (train longer: value_pretrain.steps, "
                           f"value_pretrain.pool_groups; or set value_pretrain.allow_untrained_critic=true)")


def _train_on(critic: Any, cfg: Config, groups: list[SampleGroup], pad: int, micro: MicroLimits,
              step: int) -> tuple[dict[str, Any], float]:
    """One critic update on ``groups``: (its stats, the explained variance on its own rows)."""
    batch = collate_scored(groups, pad, cfg)
    minibatches = minibatch_rows(batch.size, cfg.learner.critic_updates or cfg.learner.mini_batches, cfg.run.seed + 7919, step)
    mine = my_rows(minibatches, batch, micro)
    # λ = 1 targets do not depend on V: no value pass before the update; the training-batch explained
    # variance is read from the update's own forwards (each mini-batch before its own step).
    no_values = torch.zeros(batch.mask.shape)
    returns = value_targets(batch, no_values, cfg.algo.gamma)
    seen = torch.zeros(batch.mask.shape)
    stats = critic_update(critic, batch, minibatches=minibatches, returns=returns, old_values=no_values, epochs=1,
                          limits=micro, value_clip=0.0, record=seen)
    train_ev, _ = global_explained_variance(seen[mine], returns[mine], batch.mask[mine])
    stats["critic_backward_tokens"] = batch_tokens(batch)
    return stats, train_ev


def _report(cfg: Config, metrics: Metrics, records: RunRecords, rec: dict[str, Any]) -> None:
    """One pretraining step's gauges, metrics.jsonl record (and trackers) and log line."""
    metrics.value_pretrain_step.set(rec["step"])
    metrics.value_pretrain_loss.set(rec["loss"])
    metrics.value_pretrain_explained_variance.set(rec["explained_variance"])
    if rank() == 0:
        records.append(rec)
        log.info("value pretraining %d/%d: loss %.4f held-out EV %.4f (best %.4f) V̄ %.3f", rec["step"],
                 cfg.value_pretrain.steps, rec["loss"], rec["explained_variance"], rec["best_explained_variance"],
                 rec["value_mean"])


def _train(critic: Any, cfg: Config, next_batch: Callable[[], list[SampleGroup]], held_batch: Any, pad: int,
           micro: MicroLimits, metrics: Metrics, records: RunRecords, best: _Best) -> int:
    """Steps until ``value_pretrain.steps`` or patience runs out, keeping ``best`` current; the steps taken."""
    settings, step = cfg.value_pretrain, 0
    while step < settings.steps and best.steps_since < settings.patience:
        t0 = time.perf_counter()
        stats, train_ev = _train_on(critic, cfg, next_batch(), pad, micro, step)
        step += 1
        ev, value_mean = heldout_ev(critic, held_batch, cfg.algo.gamma, micro)
        if ev > best.explained_variance + 1e-4:
            best.explained_variance, best.steps_since, best.step = ev, 0, step
            best.state = _snapshot(critic)
        else:
            best.steps_since += 1
        _report(cfg, metrics, records, {
            "kind": "value_pretrain", "step": step, "loss": stats["critic_loss"], "explained_variance": ev,
            "train_explained_variance": train_ev, "value_mean": value_mean,
            "best_explained_variance": best.explained_variance,
            "grad_norm": stats.get("critic_grad_norm", float("nan")), "seconds": time.perf_counter() - t0,
            # the update's forward and backward, and the held-out EV pass (learner.compute)
            "critic_forward_tokens": stats["critic_backward_tokens"] + batch_tokens(held_batch),
            "critic_backward_tokens": stats["critic_backward_tokens"],
            "time": time.time()})
    return step


def _save_best(critic: Any, best: _Best, out: Path, steps: int, initial_ev: float) -> None:
    """Load the best weights back into the critic and save it to ``out`` (collective)."""
    # The best weights go back into the engine (rank 0 holds them; under ZeRO-3 each gathered group is
    # handed to every rank's partition) and are saved from there, one group at a time: no rank builds a
    # second whole critic.
    if rank() == 0 and best.state is None:
        raise RuntimeError("value pretraining: rank 0 has no snapshot of the best critic")
    load_host_tensors(critic, best.state)
    best.state = None
    save_critic(critic, out)
    if rank() == 0:
        (out / "value_pretrain.json").write_text(json.dumps(
            {"steps": steps, "best_step": best.step, "explained_variance": best.explained_variance,
             "initial_explained_variance": initial_ev}))
        log.info("value pretraining: saved the critic of step %d/%d (held-out EV %.4f) to %s", best.step, steps,
                 best.explained_variance, out)


def pretrain_critic(cfg: Config, source: DataSource | None, out: Path | None = None,
                    metrics: Metrics | None = None, records: RunRecords | None = None) -> Path:
    """Run value pretraining and return the saved critic's directory (reused if it already exists).

    Its records go to ``records`` (the learner's sink, trackers included); without one, to metrics.jsonl."""
    settings = cfg.value_pretrain
    out = out or cfg.run_dir / "critic_pretrained"
    if out.is_dir() and (out / "value_head.safetensors").is_file():
        log.info("value pretraining: reusing %s", out)
        check_trained(cfg, out)
        return out
    metrics = metrics or Metrics("learner")
    pad = pad_token_id(load_tokenizer(cfg.model.path))
    critic = build_critic(cfg, lr=settings.lr)
    micro = MicroLimits.from_config(cfg)
    usable = _usable_fetcher(cfg, source, metrics)
    held_batch = collate_scored(usable(settings.eval_groups), pad, cfg)
    next_batch = (pooled_batches(usable(settings.pool_groups), settings.batch_groups, cfg.run.seed + 104729)
                  if settings.pool_groups > 0 else lambda: usable(settings.batch_groups))
    initial_ev, _ = heldout_ev(critic, held_batch, cfg.algo.gamma, micro)
    best = _Best(initial_ev, _snapshot(critic))
    log.info("value pretraining: held-out EV %.4f before training", initial_ev)
    steps = _train(critic, cfg, next_batch, held_batch, pad, micro, metrics, records or RunRecords(cfg), best)
    if best.explained_variance < settings.min_explained_variance:
        log.warning("value pretraining ended with explained variance %.4f < %.4f", best.explained_variance,
                    settings.min_explained_variance)
    _save_best(critic, best, out, steps, initial_ev)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
    # The RL learner builds its policy and critic next: this critic, its gradients and its optimizer
    # states must be gone first, not whenever a garbage collection happens to run.
    release(critic)
    del critic
    collect()
    check_trained(cfg, out)
    return out


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv("learner.value_pretrain", __doc__ or "", argv)
    if isinstance(cfg, int):
        return cfg
    setup_logging(cfg.run.log_level)
    source = BufferSource(cfg.buffer.serve_addr, cfg.buffer.max_staleness, curve=cfg.buffer.curve) if rank() == 0 else None
    with RunRecords.open(cfg) if rank() == 0 else RunRecords(cfg) as records:
        print(pretrain_critic(cfg, source, records=records))
    return 0


__all__ = ["check_trained", "heldout_ev", "pooled_batches", "value_targets"]


if __name__ == "__main__":
    raise SystemExit(main())
