"""One VAPO learner step as a short list of named, timed phases (read this file first).

Not a CLI: ``python -m learner`` runs ``learner.runner`` (resume, value pretraining, steps, checkpoints,
weight pushes, evaluation), which calls ``Learner.step()`` once per version. Tests and benchmarks build a
``Learner`` directly and pass groups to ``step``.

Step (VAPO arXiv 2504.05118 §3):

    fetch            groups with weight_version >= version - max_staleness (rank 0 asks the buffer, the
                     other ranks decode the frames it broadcasts; rows the learner cannot use dropped and
                     asked for again: learner.data.fetch), + stored positives for NLL replay (optional)
    collate          padded prompt+response tensors, response mask, behaviour logprobs (learner.batch);
                     truncated responses treated as ``algo.truncated`` says (keep | mask | zero_reward)
    values           V(s_t) of the batch from the critic before its update (skipped when the targets are
                     Monte-Carlo, λ_critic = 1 without value clipping, and the actor reads the post-update
                     critic: EV then comes from critic_update's own forwards)
    critic_update    fit V to λ_critic (= 1: Monte-Carlo) returns, epochs × mini-batches
    fresh_values     V(s_t) again, from the updated critic (``algo.actor_values=post_update``; skipped with
                     ``pre_update``, verl's order, where the advantages read the values pass)
    advantages       decoupled GAE with per-sample length-adaptive λ_actor = 1 − 1/(α·l); or GRPO
    proximal         (learner.off_policy=decoupled | rollout_correction) logprobs of the current policy and
                     the behaviour importance weight (AReaL's masked, or verl's truncated); the engine/learner
                     mismatch on every row of the weights being updated (learner.mismatch)
    actor_update     clip-higher (+ dual clip) token-level PPO + μ·NLL on the batch's verified, untruncated
                     positives; without a proximal pass its first mini-batch measures the engine/learner mismatch
    version += 1     (the runner then checkpoints, publishes weights and evaluates, every N versions)

Deviations from the paper: mini-batches are cut from one seeded permutation per step and reused by every
epoch; the ratio is taken against the rollout engine's behaviour logprobs (``behaviour``) unless
``decoupled`` or ``rollout_correction`` is set; the actor's advantages read the critic after its update
(``algo.actor_values=post_update``) unless ``pre_update``; tiny-model hyper-parameters live in
ops/configs/default.yaml.
``algo.advantage=grpo`` (no critic) and ``algo.loss_agg=seq_mean`` turn the same loop into the GRPO /
vanilla-PPO baselines.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from common import protocol
from common.config import Config
from common.metrics import Metrics
from common.modeling import load_tokenizer, pad_token_id
from learner.advantages import (
    decoupled_gae,
    gae,
    group_baseline_values,
    grpo_advantages,
    length_adaptive_lambda,
    terminal_rewards,
)
from learner.batch import Batch, collate_samples, collate_scored, concat
from learner.compute import PHASE_PASSES, step_token_passes
from learner.data import DataSource, fetch, row_limits
from learner.dist import all_reduce_sum, global_explained_variance, global_whiten, setup_distributed
from learner.forwards import compute_logprobs, compute_values
from learner.losses import behaviour_weight
from learner.mismatch import proximal_mismatch
from learner.models import build_critic, build_policy
from learner.oracle import ChainOracle
from learner.schedule import MicroLimits, critic_minibatch_rows, minibatch_rows, my_rows, read_rows
from learner.step_stats import Phases, Throughput, export_step, step_summary
from learner.update import ActorParams, actor_update, critic_update

log = logging.getLogger("learner")


@dataclass(frozen=True)
class StepData:
    """One step's batch and how it is cut: what every phase after ``collate`` reads."""

    batch: Batch
    minibatches: list[Tensor]  # row indices of each mini-batch (the same on every rank)
    mine: Tensor  # the rows this rank trains on (and needs values and advantages for)
    critic_minibatches: list[Tensor]  # the critic's (learner.critic_updates, K_v): ``minibatches`` itself when 0
    critic_mine: Tensor  # the rows this rank trains the critic on
    limits: MicroLimits
    rewards: Tensor  # [B, T] the score on each row's last real token, 0 on replayed positives
    lam: Tensor  # [B] λ_actor per row (length-adaptive or constant)
    staleness: Tensor  # [n_real] versions between each real row's weights and the weights being updated


class Learner:
    """Policy + critic, the data source and the version counter; ``step()`` is one VAPO update."""

    def __init__(self, cfg: Config, source: DataSource | None, critic_path: str | Path | None = None,
                 models: tuple[Any, Any] | None = None, metrics: Metrics | None = None) -> None:
        setup_distributed(cfg)
        self.cfg = cfg
        self.source = source
        torch.manual_seed(cfg.run.seed)
        if models is not None:  # (policy, critic) objects with DeepSpeed's interface (benchmark baseline)
            self.policy, self.critic = models
        else:
            self.policy = build_policy(cfg)
            self.critic = build_critic(cfg, critic_path) if cfg.algo.advantage == "gae" else None
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.pad_id = pad_token_id(self.tokenizer)
        self.actor_params = ActorParams.from_config(cfg)
        self.version = 0
        self.samples_seen = 0
        self.metrics = metrics or Metrics("learner")
        self.row_limits = row_limits(cfg)
        # How micro-batches are cut: the workload model reads model.path's config.json once, not every step.
        self.limits = MicroLimits.from_config(cfg, cfg.actors.temperature)
        self.oracle = ChainOracle(self.tokenizer, cfg.algo.oracle_line_accuracy) if cfg.algo.critic == "oracle" else None
        self.last: dict[str, Any] = {}
        self.throughput = Throughput(cfg, critic_path)  # model shapes and the device peak, for MFU

    # ------------------------------------------------------------------------------------------- step

    def step(self, groups: list[protocol.SampleGroup] | None = None,
             extra: list[protocol.Sample] | None = None) -> dict[str, Any]:
        """One VAPO update; ``groups`` given directly bypasses the fetch (tests, benchmarks)."""
        t, t_start = Phases(), time.perf_counter()
        if groups is None:
            with t("fetch"):
                groups, extra = self.fetch()
        with t("collate"):
            batch = self.make_batch(groups=groups, extra=extra or [])
        d = self.step_data(batch)
        stats: dict[str, Any] = {}
        if self.cfg.algo.advantage == "gae":
            with t("values"):
                returns, old_values, ev_stats = self.critic_targets(d)
                stats.update(ev_stats)
            with t("critic_update"):
                stats.update(self.update_critic(d, returns=returns, old_values=old_values))
            if self.cfg.algo.actor_values == "pre_update" or self.oracle is not None:
                values = old_values
            else:
                with t("fresh_values"):
                    values = compute_values(self.critic, d.batch, rows=d.minibatches, limits=d.limits)
            if self.oracle is not None:  # algo.critic=oracle: the task's own values replace the critic's
                values = self.oracle.values(d.batch)
                stats.update(self.oracle.stats(self.value_stats(d, values=values, returns=returns)))
            with t("advantages"):
                advantages = self.gae_advantages(d, values=values)
                stats["lambda_actor_mean"] = self.lambda_actor_mean(d)
        else:
            with t("advantages"):
                advantages = self.grpo_advantages(d)
        old_logprobs, importance_weight = d.batch.behaviour_logprobs, None
        if self.cfg.learner.off_policy != "behaviour":
            with t("proximal"):
                old_logprobs, importance_weight = self.proximal(d)
                stats.update(proximal_mismatch(old_logprobs, d.batch, d.mine, self.version))
        with t("actor_update"):
            stats.update(actor_update(self.policy, d.batch, minibatches=d.minibatches, advantages=advantages,
                                      old_logprobs=old_logprobs, importance_weight=importance_weight,
                                      limits=d.limits, params=self.actor_params,
                                      version=self.version if importance_weight is None else None))
        self.version += 1
        stats.update(step_summary(d.batch, staleness=d.staleness, version=self.version,
                                  positive_reward=self.cfg.buffer.positive_reward, policy=self.policy,
                                  critic=self.critic, phases=t, t_start=t_start))
        ran = {m: read_rows(d.batch, torch.arange(d.batch.size), m) for m in ("policy", "critic")}
        value_pass = self.critic is not None and self.value_pass
        stats.update(step_token_passes(d.batch, t.seconds, self.cfg.learner.ppo_epochs, value_pass=value_pass, rows=ran))
        stats.update(self.throughput.stats(d.batch, stats, value_pass=value_pass,
                                           rows={p: ran[m] for p, (m, _) in PHASE_PASSES.items()}))
        self.samples_seen += stats["samples"]
        export_step(self.metrics, stats, d.staleness)
        self.last = stats
        return stats

    # ------------------------------------------------------------------------------------------ phases

    def fetch(self) -> tuple[list[protocol.SampleGroup], list[protocol.Sample]]:
        """The step's groups and replayed positives, without rows the learner cannot use (dropped, counted,
        and made up for by asking the buffer again)."""
        cfg = self.cfg
        return fetch(self.source, self.version, cfg.learner.batch_groups, cfg.learner.batch_timeout_s,
                     limits=self.row_limits, count=self.count_unusable, replay_fraction=cfg.nll.replay_fraction,
                     positive_reward=cfg.buffer.positive_reward)

    def count_unusable(self, reason: str, n: int) -> None:
        self.metrics.unusable_samples.labels(reason=reason).inc(n)
        log.warning("dropped %d batch samples the learner cannot use: %s", n, reason)

    def make_batch(self, *, groups: list[protocol.SampleGroup], extra: list[protocol.Sample]) -> Batch:
        batch = collate_scored(groups, self.pad_id, self.cfg)
        if extra:
            batch = concat(batch, collate_samples(extra, self.pad_id, is_replay=True), self.pad_id)
        return batch

    def step_data(self, batch: Batch) -> StepData:
        cfg, ac = self.cfg, self.cfg.algo
        limits = self.limits
        minibatches = minibatch_rows(batch.size, cfg.learner.mini_batches, cfg.run.seed, self.version)
        lam = (length_adaptive_lambda(batch.lengths, ac.alpha) if ac.length_adaptive
               else torch.full((batch.size,), ac.lambda_actor))
        critic_mbs = critic_minibatch_rows(minibatches, batch.size, cfg.learner.critic_updates, cfg.run.seed,
                                           self.version)
        mine = my_rows(minibatches, batch, limits)
        critic_mine = my_rows(critic_mbs, batch, limits) if cfg.learner.critic_updates > 0 else mine
        return StepData(batch=batch, minibatches=minibatches, mine=mine, critic_minibatches=critic_mbs,
                        critic_mine=critic_mine, limits=limits,
                        rewards=terminal_rewards(batch.scores, batch.mask) * batch.ppo_mask, lam=lam,
                        staleness=(self.version - batch.weight_version[~batch.is_replay]).clamp(min=0))

    @property
    def value_pass(self) -> bool:
        """Whether V is computed before the critic's update. With λ_critic = 1 the targets are Monte-Carlo
        returns, which do not depend on V; without value clipping and with the actor reading the post-update
        critic nothing else reads the pre-update values: no separate value pass, and the explained variance
        then comes from the critic update's own forwards (each mini-batch before its own step: partly
        in-sample with two or more mini-batches). With a value pass the EV is of values no update has seen."""
        ac = self.cfg.algo
        return (ac.actor_values == "pre_update"
                or not (ac.decoupled_gae and ac.lambda_critic == 1.0 and ac.value_clip <= 0.0))

    def critic_targets(self, d: StepData) -> tuple[Tensor, Tensor, dict[str, float]]:
        """(returns, pre-update values (zeros without a value pass), their EV stats ({} without))."""
        ac, b = self.cfg.algo, d.batch
        old_values = (compute_values(self.critic, b, rows=d.minibatches, limits=d.limits) if self.value_pass
                      else torch.zeros(b.mask.shape))
        if self.value_pass and self.cfg.learner.critic_updates > 0:
            # K_v deals the rows to the ranks apart from the actor's deal, so a rank trains the critic on rows whose
            # values another rank computed: every rank takes every row's (each row's are non-zero on one rank).
            old_values = all_reduce_sum(old_values).to(old_values.dtype)
        if ac.decoupled_gae:
            _, returns = decoupled_gae(d.rewards, old_values, b.ppo_mask, ac.gamma, ac.lambda_actor, ac.lambda_critic)
        else:  # ablation: the critic regresses on the actor's λ-returns, A^λ + V
            _, returns = gae(d.rewards, old_values, b.ppo_mask, ac.gamma, d.lam)
        if not self.value_pass:
            return returns, old_values, {}
        return returns, old_values, self.value_stats(d, values=old_values, returns=returns)

    def update_critic(self, d: StepData, *, returns: Tensor, old_values: Tensor) -> dict[str, float]:
        seen = None if self.value_pass else torch.zeros(d.batch.mask.shape)
        stats = critic_update(self.critic, d.batch, minibatches=d.critic_minibatches, returns=returns, old_values=old_values,
                              epochs=self.cfg.learner.ppo_epochs, limits=d.limits, value_clip=self.cfg.algo.value_clip,
                              record=seen)
        if seen is not None:
            stats.update(self.value_stats(d, values=seen, returns=returns, rows=d.critic_mine))
        return stats

    def value_stats(self, d: StepData, *, values: Tensor, returns: Tensor,
                    rows: Tensor | None = None) -> dict[str, float]:
        """Explained variance and mean of ``values`` over ``rows`` of every rank (default: the actor's deal)."""
        mine = d.mine if rows is None else rows
        ev, mean = global_explained_variance(values[mine], returns[mine], d.batch.ppo_mask[mine])
        return {"value_explained_variance": ev, "value_mean": mean}

    def gae_advantages(self, d: StepData, *, values: Tensor) -> Tensor:
        ac = self.cfg.algo
        if ac.baseline == "group_loo":
            values = group_baseline_values(values, d.batch.ppo_mask, d.batch.scores, d.batch.group_index)
        advantages, _ = decoupled_gae(d.rewards, values, d.batch.ppo_mask, ac.gamma, d.lam, ac.lambda_critic)
        return self.whiten(d, advantages)

    def grpo_advantages(self, d: StepData) -> Tensor:
        b = d.batch
        return self.whiten(d, grpo_advantages(b.scores, b.group_index, b.ppo_mask, self.cfg.algo.grpo_std_normalize))

    def whiten(self, d: StepData, advantages: Tensor) -> Tensor:
        """Whitened over the real tokens of every rank's rows (algo.whiten_advantages); in place."""
        if self.cfg.algo.whiten_advantages:
            advantages[d.mine] = global_whiten(advantages[d.mine], d.batch.ppo_mask[d.mine]).to(advantages.dtype)
        return advantages

    def lambda_actor_mean(self, d: StepData) -> float:
        real = ~d.batch.is_replay
        return float(d.lam[real].mean()) if real.any() else 0.0

    def proximal(self, d: StepData) -> tuple[Tensor, Tensor]:
        """(π_prox logprobs, the behaviour importance weight π_prox / π_behav): AReaL's decoupled objective
        (tokens whose weight exceeds ``learner.decoupled_weight_cap`` are masked) or verl's rollout
        correction (truncated at ``learner.rollout_correction_cap``, per token or per sequence)."""
        b, learner_cfg = d.batch, self.cfg.learner
        prox = compute_logprobs(self.policy, b, rows=d.minibatches, limits=d.limits)
        if learner_cfg.off_policy == "decoupled":
            return prox, behaviour_weight(prox, b.behaviour_logprobs, b.mask, learner_cfg.decoupled_weight_cap, mode="mask")
        return prox, behaviour_weight(prox, b.behaviour_logprobs, b.mask, learner_cfg.rollout_correction_cap,
                                      mode="truncate", level=learner_cfg.rollout_correction_level)


__all__ = ["Learner", "Phases"]  # Phases: the step's phase timer, which ops/bench/zero3_traffic.py wraps to count traffic per phase
