"""The VAPO learner loop: one step = a short list of named, timed phases (read this file first).

    python -m learner [config.yaml] [key=value ...]                 # one process (CPU: gloo, no compile)
    deepspeed --num_gpus 2 -m learner ops/configs/default.yaml       # data-parallel ranks (CUDA)
    torchrun --nproc_per_node 2 -m learner ...                       # CPU ranks

Step (VAPO arXiv 2504.05118 §3):

    fetch            groups with weight_version >= version - max_staleness (rank 0 asks the buffer,
                     broadcasts to the other ranks), + stored positives for NLL replay (optional)
    collate          padded prompt+response tensors, response mask, behaviour logprobs (learner.batch)
    values           V(s_t) of the batch from the critic before its update (skipped when the targets are
                     Monte-Carlo, λ_critic = 1 without value clipping: EV then comes from critic_update)
    critic_update    fit V to λ_critic (= 1: Monte-Carlo) returns, epochs × mini-batches
    fresh_values     V(s_t) again, from the updated critic (critic-then-actor)
    advantages       decoupled GAE with per-sample length-adaptive λ_actor = 1 − 1/(α·l); or GRPO
    proximal         (learner.off_policy=decoupled only) logprobs of the current policy, AReaL-style
    actor_update     clip-higher token-level PPO + μ·NLL on the batch's verified positives
    version += 1     then checkpoint (every N) → publish weights (every N) → evaluate (every N)

Deviations from the paper: mini-batches are cut from one seeded permutation per step and reused by every
epoch; the ratio is taken against the engine's behaviour logprobs (``behaviour``) unless ``decoupled`` is
set; tiny-model hyper-parameters live in ops/configs/default.yaml. ``algo.advantage=grpo`` (no critic) and
``algo.loss_agg=seq_mean`` turn the same loop into the GRPO / vanilla-PPO baselines.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from common import protocol
from common.config import Config
from common.metrics import Metrics
from learner.advantages import (
    decoupled_gae,
    gae,
    group_normalized_advantages,
    length_adaptive_lambda,
    terminal_rewards,
)
from learner.batch import Batch, collate, collate_samples, concat
from learner.data import DataSource
from learner.engines import build_critic_engine, build_policy_engine, rank, setup_distributed, world_size
from learner.update import (
    MicroLimits,
    actor_update,
    all_reduce_sum,
    broadcast_bytes,
    compute_logprobs,
    compute_values,
    critic_update,
    minibatch_rows,
    my_rows,
)

log = logging.getLogger("learner")


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


def pad_token_id(model_path: str | Path) -> int:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_path))
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)
    except (OSError, ValueError):
        return 0


def _global_stats(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(explained variance, mean value) over the real tokens of every rank's rows."""
    m = mask.double()
    v, r = values.double() * m, returns.double() * m
    d = (r - v) * m
    s = all_reduce_sum(torch.stack([m.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum(), v.sum()]))
    n = float(s[0])
    if n < 2:
        return 0.0, float(s[5] / max(n, 1.0))
    var_r = (float(s[2]) - float(s[1]) ** 2 / n) / (n - 1)
    var_d = (float(s[4]) - float(s[3]) ** 2 / n) / (n - 1)
    ev = 0.0 if var_r <= 1e-12 else 1.0 - var_d / var_r
    return ev, float(s[5]) / n


def _whiten(adv: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """masked_whiten with mean/variance over the real tokens of every rank's rows."""
    m = mask.double()
    a = adv.double() * m
    s = all_reduce_sum(torch.stack([m.sum(), a.sum(), (a * a).sum()]))
    n = float(s[0])
    if n < 1:
        return adv * mask
    mean = float(s[1]) / n
    var = (float(s[2]) - n * mean * mean) / max(n - 1.0, 1.0)
    return ((adv - mean) * torch.rsqrt(torch.tensor(var + eps, dtype=adv.dtype))) * mask


def fetch_groups(source: DataSource | None, version: int, n_groups: int, timeout_s: float,
                 replay_fraction: float = 0.0) -> tuple[list[protocol.SampleGroup], list[protocol.Sample]]:
    """Rank 0 asks the source; every rank gets the same groups (and stored positives for NLL replay:
    ``replay_fraction`` per verified positive of the batch). Frames travel as protocol bytes."""
    frame = reply = None
    if rank() == 0:
        assert source is not None, "rank 0 needs a data source"
        groups = source.get_batch(version, n_groups, timeout_s)
        n_pos = sum(1 for g in groups for s in g.samples if s.reward >= 1.0)
        extra = source.positives(int(round(replay_fraction * n_pos)))
        frame = protocol.encode_batch_reply([protocol.encode(g) for g in groups], 0, 0)
        reply = protocol.encode(protocol.PositivesReply(samples=extra))
    frame, reply = broadcast_bytes(frame), broadcast_bytes(reply)
    groups = protocol.decode_as(frame, protocol.BatchReply, max_frame_bytes=len(frame)).groups
    extra = protocol.decode_as(reply, protocol.PositivesReply, max_frame_bytes=len(reply)).samples
    return groups, extra


class Learner:
    """Policy + critic engines, the data source and the version counter; ``step()`` is one VAPO update."""

    def __init__(self, cfg: Config, source: DataSource | None, critic_path: str | Path | None = None,
                 engines: tuple[Any, Any] | None = None, metrics: Metrics | None = None) -> None:
        setup_distributed(cfg)
        self.cfg = cfg
        self.source = source
        torch.manual_seed(cfg.run.seed)
        if engines is not None:  # (policy, critic) objects with the engine interface (benchmark baseline)
            self.policy, self.critic = engines
        else:
            self.policy = build_policy_engine(cfg)
            self.critic = build_critic_engine(cfg, critic_path) if cfg.algo.advantage == "gae" else None
        self.pad_id = pad_token_id(cfg.model.path)
        self.version = 0
        self.samples_seen = 0
        self.metrics = metrics or Metrics("learner")
        self.last: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------ phases

    def fetch(self) -> tuple[list[protocol.SampleGroup], list[protocol.Sample]]:
        lc = self.cfg.learner
        return fetch_groups(self.source, self.version, lc.batch_groups, lc.batch_timeout_s, self.cfg.nll.replay_fraction)

    def make_batch(self, groups: list[protocol.SampleGroup], extra: list[protocol.Sample]) -> Batch:
        kw = {"max_new_tokens": self.cfg.actors.max_new_tokens, "overlong_buffer": self.cfg.algo.overlong_buffer,
              "overlong_penalty_value": self.cfg.algo.overlong_penalty}
        batch = collate(groups, self.pad_id, **kw)
        if extra:
            batch = concat(batch, collate_samples(extra, self.pad_id, is_replay=True), self.pad_id)
        return batch

    def advantages_grpo(self, batch: Batch) -> torch.Tensor:
        adv = torch.zeros(batch.mask.shape)
        for g in batch.group_index.unique().tolist():
            if g < 0:
                continue
            rows = (batch.group_index == g).nonzero().squeeze(-1)
            a = group_normalized_advantages(batch.scores[rows], len(rows), self.cfg.algo.grpo_std_normalize)
            adv[rows] = a.unsqueeze(-1)
        return adv * batch.ppo_mask

    # ------------------------------------------------------------------------------------------- step

    def step(self, groups: list[protocol.SampleGroup] | None = None, extra: list[protocol.Sample] | None = None) -> dict[str, Any]:
        """One VAPO update; ``groups`` given directly bypasses the fetch (tests, benchmarks)."""
        cfg, lc, ac = self.cfg, self.cfg.learner, self.cfg.algo
        t = Phases()
        t_start = time.perf_counter()
        if groups is None:
            with t("fetch"):
                groups, extra = self.fetch()
        with t("collate"):
            batch = self.make_batch(groups, extra or [])
        real = ~batch.is_replay
        staleness = (self.version - batch.weight_version[real]).clamp(min=0)
        mbs = MicroLimits.from_config(lc)
        minibatches = minibatch_rows(batch.size, lc.mini_batches, cfg.run.seed, self.version)
        mine = my_rows(minibatches, batch, mbs)
        ppo_mask = batch.ppo_mask
        rewards_tok = terminal_rewards(batch.scores, batch.mask) * ppo_mask
        stats: dict[str, Any] = {}

        if ac.advantage == "gae":
            assert self.critic is not None
            lam = length_adaptive_lambda(batch.lengths, ac.alpha) if ac.length_adaptive else torch.full((batch.size,), ac.lambda_actor)
            # With λ_critic = 1 the targets are Monte-Carlo returns, which do not depend on V, and without
            # value clipping nothing else reads the pre-update values: no separate value pass; the explained
            # variance comes from the critic update's own forwards (each mini-batch before its own step).
            needs_old = not (ac.decoupled_gae and ac.lambda_critic == 1.0 and ac.value_clip <= 0.0)
            seen = None
            with t("values"):
                old_values = compute_values(self.critic, batch, minibatches, mbs) if needs_old else torch.zeros(batch.mask.shape)
                if ac.decoupled_gae:
                    _, returns = decoupled_gae(rewards_tok, old_values, ppo_mask, ac.gamma, ac.lambda_actor, ac.lambda_critic)
                else:  # ablation: the critic regresses on the actor's λ-returns, A^λ + V
                    _, returns = gae(rewards_tok, old_values, ppo_mask, ac.gamma, lam)
                if needs_old:
                    stats["value_explained_variance"], stats["value_mean"] = _global_stats(old_values[mine], returns[mine], ppo_mask[mine])
                else:
                    seen = torch.zeros(batch.mask.shape)
            with t("critic_update"):
                stats.update(critic_update(self.critic, batch, minibatches, returns, old_values, lc.ppo_epochs, mbs,
                                           ac.value_clip, record=seen))
                if seen is not None:
                    stats["value_explained_variance"], stats["value_mean"] = _global_stats(seen[mine], returns[mine], ppo_mask[mine])
            with t("fresh_values"):
                values = compute_values(self.critic, batch, minibatches, mbs)
            with t("advantages"):
                advantages, _ = decoupled_gae(rewards_tok, values, ppo_mask, ac.gamma, lam, ac.lambda_critic)
                if ac.whiten_advantages:
                    advantages[mine] = _whiten(advantages[mine], ppo_mask[mine]).to(advantages.dtype)
                stats["lambda_actor_mean"] = float(lam[real].mean()) if real.any() else 0.0
        else:
            with t("advantages"):
                advantages = self.advantages_grpo(batch)
                if ac.whiten_advantages:
                    advantages[mine] = _whiten(advantages[mine], ppo_mask[mine]).to(advantages.dtype)

        importance_weight = None
        old_logprobs = batch.behaviour_logprobs
        if lc.off_policy == "decoupled":
            with t("proximal"):
                prox = compute_logprobs(self.policy, batch, minibatches, mbs)
                importance_weight = torch.exp(prox - batch.behaviour_logprobs).clamp(max=lc.decoupled_weight_cap) * batch.mask
                old_logprobs = prox
        with t("actor_update"):
            stats.update(actor_update(self.policy, batch, minibatches, advantages, old_logprobs, importance_weight,
                                      lc.ppo_epochs, mbs, ac.clip_low, ac.clip_high, ac.loss_agg,
                                      cfg.nll.coef, ac.entropy_coef))
        self.version += 1
        n_real = max(int(real.sum()), 1)
        tokens = int((batch.prompt_lengths + batch.lengths).sum())
        busy = time.perf_counter() - t_start - t.seconds.get("fetch", 0.0)
        stats.update({
            "step": self.version, "weight_version": self.version, "time": time.time(),
            "reward_mean": float(batch.rewards[real].sum()) / n_real,
            "positives_fraction": float((batch.rewards[real] >= 1.0).sum()) / n_real,
            "response_length_mean": float(batch.lengths[real].sum()) / n_real,
            "truncated_fraction": float(batch.truncated[real].sum()) / n_real,
            "samples": n_real, "replay_positives": int(batch.is_replay.sum()),
            "staleness_mean": float(staleness.float().mean()) if len(staleness) else 0.0,
            "tokens": tokens, "tokens_per_second": tokens / max(busy, 1e-9),
            "actor_lr": float(self.policy.get_lr()[0]),
            "phase_seconds": dict(t.seconds), "step_seconds": time.perf_counter() - t_start,
        })
        if self.critic is not None:
            stats["critic_lr"] = float(self.critic.get_lr()[0])
        self.samples_seen += n_real
        self._export(stats, staleness)
        self.last = stats
        return stats

    def _export(self, s: dict[str, Any], staleness: torch.Tensor) -> None:
        m = self.metrics
        m.step.set(s["step"])
        m.last_step_timestamp_seconds.set(s["time"])
        for key in ("critic_loss", "value_explained_variance", "value_mean", "policy_loss", "nll_loss",
                    "clip_fraction_low", "clip_fraction_high", "approx_kl", "entropy", "lambda_actor_mean",
                    "reward_mean", "positives_fraction", "response_length_mean", "tokens_per_second"):
            if key in s:
                getattr(m, key).set(s[key])
        m.grad_norm.labels(model="actor").set(s.get("actor_grad_norm", float("nan")))
        m.lr.labels(model="actor").set(s["actor_lr"])
        if "critic_lr" in s:
            m.grad_norm.labels(model="critic").set(s.get("critic_grad_norm", float("nan")))
            m.lr.labels(model="critic").set(s["critic_lr"])
        for v in staleness.tolist():
            m.staleness.observe(v)
        m.data_wait_seconds.inc(s["phase_seconds"].get("fetch", 0.0))
        for phase, sec in s["phase_seconds"].items():
            m.phase_seconds.labels(phase=phase).set(sec)
        m.samples.inc(s["samples"])


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps(record, default=float) + "\n")


# ---------------------------------------------------------------------------------------------- loop


def _load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def resolve_checkpoint(cfg: Config) -> Path | None:
    from learner import checkpoint

    if cfg.learner.resume == "never":
        return None
    if cfg.learner.resume == "auto":
        return checkpoint.latest_checkpoint(cfg.run_dir / "checkpoints")
    p = Path(cfg.learner.resume)
    if not p.is_dir():
        raise FileNotFoundError(f"learner.resume: checkpoint {p} does not exist")
    return p


class Runner:
    """The learner process: resume → (publish) → steps with checkpoint / weight push / eval → jsonl."""

    def __init__(self, cfg: Config, source: DataSource | None, critic_path: str | Path | None = None,
                 metrics: Metrics | None = None) -> None:
        from learner import checkpoint
        from learner.weights import WeightPublisher, latest_update, prune

        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.weights_root = self.run_dir / "weights"
        self.ckpt_root = self.run_dir / "checkpoints"
        ckpt = resolve_checkpoint(cfg)
        pretrained = self.run_dir / "critic_pretrained"
        if critic_path is None and pretrained.is_dir():
            critic_path = pretrained
        self.learner = Learner(cfg, source, critic_path=critic_path, metrics=metrics)
        self.tokenizer = _load_tokenizer(cfg.model.path)
        self.task: Any = None
        if ckpt is not None:
            checkpoint.load(ckpt, self.learner)
            log.info("resumed from %s at version %d", ckpt, self.learner.version)
        self.publisher = None
        if rank() == 0:
            self.weights_root.mkdir(parents=True, exist_ok=True)
            prune(self.weights_root, cfg.learner.keep_weights)  # drops *.tmp left by a crash
            published = latest_update(self.weights_root)
            self.publisher = WeightPublisher(cfg.learner.publish_addr, cfg.learner.query_addr, cfg.buffer.curve,
                                             latest=published)
        # Every rank decides alike from the newest published version (rank 0 reads it).
        mine = self.publisher.latest.version if self.publisher is not None and self.publisher.latest else -1
        published_v = int(all_reduce_sum(torch.tensor([mine if rank() == 0 else 0]))[0])
        if published_v > self.learner.version:
            # Weights were published after the last checkpoint, by updates that are now lost. The actors
            # serve them, so continuing under their number with the checkpoint's weights would make
            # groups from orphaned weights look fresh. Republish the checkpoint's weights under a new
            # number instead: a version is never reused and never names two different sets of weights.
            log.warning("weights v%d exist beyond checkpoint v%d; republishing the checkpoint's weights as v%d",
                        published_v, self.learner.version, published_v + 1)
            self.learner.version = published_v + 1
            if cfg.learner.checkpoint_every > 0:
                # Checkpoint the renumbered state before publishing it: a crash before the next update then
                # resumes at this version instead of skipping another, so repeated crashes move the version
                # at most two past the buffer's last served batch (buffer.learner_version_max_step).
                checkpoint.save(self.ckpt_root, self.learner, cfg.learner.keep_checkpoints)
        if published_v < self.learner.version:
            self.publish()
        self.learner.metrics.weight_version.set(self.learner.version)

    def publish(self) -> None:
        from learner.weights import publish_policy

        update = publish_policy(self.learner.policy, self.tokenizer, self.weights_root, self.learner.version,
                                self.cfg.learner.keep_weights, self.publisher)
        if update is not None:
            self.learner.metrics.weights_published.inc()
            self.learner.metrics.weight_version.set(update.version)

    def evaluate(self) -> dict[str, Any]:
        """Held-out evaluation of the current version, on rank 0 only (the other ranks return {} at once):
        in-process for a one-process learner, otherwise on a rollout engine serving the published weights."""
        from common.tasks import get_task
        from learner.evaluate import EngineEvalError, eval_target, evaluate, evaluate_on_engine

        if rank() != 0:
            return {}
        if self.task is None:
            self.task = get_task(self.cfg.task)
        lc = self.cfg.learner
        mode, url = eval_target(self.cfg, world_size())
        if mode == "engine":
            published = self.publisher.latest.version if self.publisher is not None and self.publisher.latest else 0
            try:
                rep = evaluate_on_engine(url, self.tokenizer, self.task, version=published, k=lc.eval_k,
                                         max_new_tokens=self.cfg.actors.max_new_tokens,
                                         temperature=self.cfg.actors.temperature, timeout_s=lc.eval_timeout_s)
            except EngineEvalError as e:
                log.error("held-out evaluation failed (training goes on): %s", e)
                return {"error": str(e)}
            rep["weight_version_evaluated"] = published
        else:
            model = self.learner.policy.module
            if self.learner.policy.zero_optimization_stage() == 3:
                # One rank holds every partition; a gathered copy runs plain forwards.
                from learner.engines import full_state_dict, load_policy_module

                state = full_state_dict(self.learner.policy)
                model = load_policy_module(self.cfg.model.path, self.cfg.model.dtype)
                model.load_state_dict(state)
                model.to(next(self.learner.policy.module.parameters()).device)
            rep = evaluate(model, self.tokenizer, self.task, k=lc.eval_k, max_new_tokens=self.cfg.actors.max_new_tokens,
                           temperature=self.cfg.actors.temperature, seed=self.cfg.run.seed)
        m = self.learner.metrics
        for key in ("avg_at_k", "pass_at_k", "greedy_accuracy"):
            if key in rep:
                m.eval_accuracy.labels(metric=key).set(rep[key])
        if "mean_response_length" in rep:
            m.eval_response_length.set(rep["mean_response_length"])
        return {k: v for k, v in rep.items() if isinstance(v, int | float | str)}

    def run(self) -> Learner:
        from learner import checkpoint

        cfg, lc, L = self.cfg, self.cfg.learner, self.learner
        t_end = time.monotonic() + cfg.run.max_wall_seconds if cfg.run.max_wall_seconds > 0 else float("inf")
        try:
            if lc.eval_every > 0 and L.version == 0 and rank() == 0:
                # The base policy's held-out accuracy: the reference every later evaluation is read against.
                t0 = time.perf_counter()
                rep = self.evaluate()
                log.info("base policy held-out: %s (%.1f s)", rep, time.perf_counter() - t0)
                if cfg.metrics.jsonl:
                    append_jsonl(self.run_dir / "metrics.jsonl",
                                 {"kind": "eval", "weight_version": 0, "step": 0, "time": time.time(), **rep})
            while L.version < lc.total_steps and time.monotonic() < t_end:
                stats = L.step()
                t0 = time.perf_counter()
                if lc.checkpoint_every > 0 and L.version % lc.checkpoint_every == 0:
                    checkpoint.save(self.ckpt_root, L, lc.keep_checkpoints)
                stats["phase_seconds"]["checkpoint"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                if L.version % max(lc.weights_every, 1) == 0 or L.version >= lc.total_steps:
                    self.publish()
                stats["phase_seconds"]["publish"] = time.perf_counter() - t0
                if lc.eval_every > 0 and L.version % lc.eval_every == 0 and rank() == 0:
                    t0 = time.perf_counter()
                    stats["eval"] = self.evaluate()
                    stats["phase_seconds"]["eval"] = time.perf_counter() - t0
                if rank() == 0:
                    # Cumulative groups the source dropped: with dynamic sampling these were generated
                    # (paid for) but never trained on, so samples-to-accuracy must count them.
                    for key in ("groups_consumed", "stale_dropped", "filtered"):
                        if hasattr(L.source, key):
                            stats[f"{key}_total"] = int(getattr(L.source, key))
                    if cfg.metrics.jsonl:
                        append_jsonl(self.run_dir / "metrics.jsonl", {"kind": "learner_step", **stats})
                    log.info("v%d reward %.3f critic %.4f EV %.3f policy %.4f nll %.3f len %.1f %.0f tok/s %.2fs",
                             L.version, stats["reward_mean"], stats.get("critic_loss", float("nan")),
                             stats.get("value_explained_variance", float("nan")), stats["policy_loss"],
                             stats["nll_loss"], stats["response_length_mean"], stats["tokens_per_second"],
                             stats["step_seconds"])
            if lc.checkpoint_every > 0 and L.version % lc.checkpoint_every != 0:
                checkpoint.save(self.ckpt_root, L, lc.keep_checkpoints)
        finally:
            if self.publisher is not None:
                self.publisher.close()
        return L


USAGE = """usage: python -m learner [config.yaml] [key=value ...]

Runs the VAPO learner: value pretraining (if enabled and no critic/checkpoint exists yet), then
learner.total_steps critic-then-actor steps on batches from the buffer at buffer.serve_addr, publishing
weights to <run dir>/weights and checkpointing to <run dir>/checkpoints (resume with learner.resume=auto).
Multi-rank: launch under `deepspeed` or `torchrun`; rank 0 talks to the buffer and publishes.
Fields: python -m common.config --help (sections learner, algo, value_pretrain, nll)."""


def main(argv: list[str] | None = None) -> int:
    import sys

    from common.config import ConfigError, load_config_args, save_config

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [a for a in argv if not a.startswith("--local_rank")]  # added by the deepspeed launcher
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        cfg = load_config_args(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.run.log_level, format=f"%(asctime)s learner[{rank()}] %(levelname)s %(message)s")
    # Ranks started by deepspeed/torchrun are not our launcher's children, so its parent-death signal
    # does not reach them: they watch the launcher named in VAPO_LIFELINE themselves.
    from common import lifeline

    lifeline.watch_ancestor()
    torch.set_num_threads(cfg.learner.threads)
    if not Path(cfg.model.path).is_dir():
        print(f"model.path {cfg.model.path} does not exist; build it first (python -m learner.sft)", file=sys.stderr)
        return 2
    from learner.data import BufferSource

    source = BufferSource(cfg.buffer.serve_addr, cfg.buffer.max_staleness, curve=cfg.buffer.curve) if rank() == 0 else None
    # One registry for the whole process, served from the start: value pretraining's metrics go to the
    # same /metrics as the RL steps', and Prometheus sees the learner during its slow startup too.
    metrics = Metrics("learner")
    if rank() == 0:
        save_config(cfg, cfg.run_dir / "learner_config.yaml")
        if cfg.metrics.prometheus:
            metrics.serve(cfg.learner.metrics_port, cfg.metrics.host)
    critic_path = None
    if (cfg.value_pretrain.enabled and cfg.algo.advantage == "gae" and resolve_checkpoint(cfg) is None):
        from learner.value_pretrain import pretrain_critic

        critic_path = pretrain_critic(cfg, source, metrics=metrics)
    Runner(cfg, source, critic_path=critic_path, metrics=metrics).run()
    if metrics.last_scrape > 0 and cfg.metrics.final_scrape_wait_s > 0:
        # Pull-based monitoring never sees values set after its last scrape: stay for one more, so that
        # the final step (and a short run's only steps) reach Grafana. Only when someone is scraping.
        if not metrics.wait_for_scrape(time.time(), cfg.metrics.final_scrape_wait_s):
            log.warning("no Prometheus scrape within metrics.final_scrape_wait_s=%.0f s of the last step",
                        cfg.metrics.final_scrape_wait_s)
    return 0
