"""The learner process: ``python -m learner [config.yaml] [key=value ...]``.

    python -m learner ops/configs/default.yaml                       # one process (CPU: gloo, no compile)
    deepspeed --num_gpus 2 -m learner ops/configs/default.yaml       # data-parallel ranks (CUDA)
    torchrun --nproc_per_node 2 -m learner ...                       # CPU ranks

The learner's listening sockets first (``learner.endpoints.Endpoints``: rank 0's weight publisher and, with the distributed
transport, the push coordinator's socket and its store's address), so that an address this host does not
have fails at start; then value pretraining (``learner.value_pretrain``, when enabled and there is no critic
or checkpoint yet), then ``Runner``: its ``start()`` resumes from the newest intact checkpoint (``learner.resume``,
verified by rank 0) → publishes the current weights if the actors lack them; its ``run()`` → ``learner.total_steps`` steps of
``learner.train.Learner``, each followed by a checkpoint (every ``learner.checkpoint_every``), a weight push
(every ``learner.weights_every``, to ``<run dir>/weights``) and an evaluation of the held-out slice and
``task.eval_sets`` (every ``learner.eval_every``), with one line per step in ``<run dir>/metrics.jsonl``. Rank 0 talks to the buffer,
publishes and evaluates.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common import lifeline
from common.cli import config_from_argv, setup_logging
from common.config import Config, save_config
from common.metrics import Metrics
from common.placement import LEARNER_DONE_FILE
from common.tasks import fit_task, get_task
from common.tasks.eval_sets import EvalSet, eval_sets
from learner import checkpoint
from learner.data import BufferSource, DataSource
from learner.dist import all_reduce_sum, broadcast_ints, rank, rank0_wait, shutdown_distributed, world_size
from learner.endpoints import Endpoints
from learner.eval_record import eval_line, set_eval_gauges
from learner.eval_worker import BackgroundEval
from learner.evaluate import eval_target, evaluate_sets
from learner.models import full_state_dict, load_policy_module
from learner.publisher import WeightPublisher
from learner.push_coordinator import PushCoordinator, pushed_version
from learner.records import RunRecords, write_json_atomic
from learner.step_stats import Phases
from learner.train import Learner
from learner.value_pretrain import pretrain_critic
from learner.weights import publish_policy

log = logging.getLogger("learner")


def resolve_checkpoint(cfg: Config) -> Path | None:
    if cfg.learner.resume == "never":
        return None
    if cfg.learner.resume == "auto":
        return checkpoint.latest_checkpoint(cfg.run_dir / "checkpoints")
    p = Path(cfg.learner.resume)
    if not p.is_dir():
        raise FileNotFoundError(f"learner.resume: checkpoint {p} does not exist")
    return p


def choose_resume(cfg: Config) -> Path | None:
    """Every rank: the checkpoint to resume from (None: start fresh), chosen and verified by rank 0 while
    the others wait on it (``learner.checkpoint.choose`` for ``auto``: the newest intact one, a damaged newer
    one set aside or refused per ``learner.resume_damaged``; ``check_explicit`` for a path)."""
    resume = cfg.learner.resume
    if resume == "never":
        return None
    root = cfg.run_dir / "checkpoints"

    def work() -> list[int]:
        if resume == "auto":
            p = checkpoint.choose(root, cfg.learner.resume_damaged)
            return [-1 if p is None else int(p.name[1:])]
        checkpoint.check_explicit(Path(resume))
        return [0]

    got = broadcast_ints(rank0_wait(work if rank() == 0 else None, "verifying the checkpoint to resume from"))[0]
    if resume != "auto":
        return Path(resume)
    return None if got < 0 else root / f"v{got}"


def source_totals(source: DataSource | None) -> dict[str, int]:
    """``{"<count>_total": n}`` for each count ``source`` keeps (``DataSource.totals``). Groups a source dropped
    were generated (paid for) but never trained on, so samples-to-accuracy must count them; no source (ranks
    other than 0) gives no totals."""
    return {} if source is None else {f"{key}_total": int(n) for key, n in source.totals().items()}


class Runner:
    """The learner process: ``start()`` (resume → renumber → publish), then ``run()``: steps with checkpoint /
    weight push / eval → jsonl. Constructing one builds the learner and nothing else: no checkpoint is loaded,
    no socket bound, nothing written or published until ``start()``."""

    def __init__(self, cfg: Config, source: DataSource | None, critic_path: str | Path | None = None,
                 metrics: Metrics | None = None, endpoints: Endpoints | None = None,
                 records: RunRecords | None = None) -> None:
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        # main() opens the sink with the experiment trackers; a Runner made on its own writes the file only.
        self.records = records if records is not None else RunRecords(cfg)
        self.weights_root = self.run_dir / "weights"
        self.ckpt_root = self.run_dir / "checkpoints"
        resolve_checkpoint(cfg)  # a check only: a learner.resume path that does not exist fails before the models are built
        pretrained = self.run_dir / "critic_pretrained"
        if critic_path is None and pretrained.is_dir():
            critic_path = pretrained
        self.learner = Learner(cfg, source, critic_path=critic_path, metrics=metrics)
        self.task: Any = None
        self.eval_sets: list[EvalSet] = []  # the sets each evaluation covers, loaded with the task
        self.evals: Any = None  # learner.eval_worker.BackgroundEval, rank 0's engine evaluations
        # main() opens them before value pretraining; a Runner made on its own (tests, tools) opens them in start().
        self.endpoints = endpoints
        self.publisher: WeightPublisher | None = None
        self.push: PushCoordinator | None = None
        self.started = False

    def start(self) -> Runner:
        """Resume from the chosen checkpoint, open the endpoints (unless given), and make the published weights
        agree with the learner's version: renumber past weights a lost update published, publish what the
        actors lack. Every rank calls it; returns the runner, ready to ``run()``."""
        resume_from = choose_resume(self.cfg)
        if resume_from is not None:
            checkpoint.load(resume_from, self.learner)
            log.info("resumed from %s at version %d", resume_from, self.learner.version)
        if self.endpoints is None:
            self.endpoints = Endpoints(self.cfg, self.learner.metrics)
        self.endpoints.attach(self.learner)
        self.publisher, self.push = self.endpoints.publisher, self.endpoints.push
        published = self._published_version()
        if published > self.learner.version:
            self._renumber_past(published)
        if published < self.learner.version:
            self.publish()
        self.learner.metrics.weight_version.set(self.learner.version)
        self.started = True
        return self

    def _published_version(self) -> int:
        """The newest published version (-1: none), read by rank 0: every rank decides alike from it."""
        newest = self.publisher.latest.version if self.publisher is not None and self.publisher.latest else -1
        if rank() == 0:  # a version pushed to the engines whose disk copy a crash cut short counts as published

            newest = max(newest, pushed_version(self.weights_root))
        return int(all_reduce_sum(torch.tensor([newest if rank() == 0 else 0]))[0])

    def _renumber_past(self, published: int) -> None:
        """Weights were published after the last checkpoint, by updates that are now lost.

        The actors serve them, so continuing under their number with the checkpoint's weights would make
        groups from orphaned weights look fresh. The checkpoint's weights are republished under a new
        number instead: a version is never reused and never names two different sets of weights."""
        log.warning("weights v%d exist beyond checkpoint v%d; republishing the checkpoint's weights as v%d",
                    published, self.learner.version, published + 1)
        self.learner.version = published + 1
        if self.cfg.learner.checkpoint_every > 0:
            # Checkpoint the renumbered state before publishing it: a crash before the next update then
            # resumes at this version instead of skipping another, so repeated crashes move the version
            # at most two past the buffer's last served batch (buffer.learner_version_max_step).
            checkpoint.save(self.ckpt_root, self.learner, self.cfg.learner.keep_checkpoints)

    def publish(self) -> None:
        if self.push is not None:  # broadcast now; the durable version is announced once written
            self.push.publish(self.learner.policy, self.learner.version)
            self.learner.metrics.weight_version.set(self.learner.version)
            return
        t0 = time.perf_counter()
        update = publish_policy(self.learner.policy, self.learner.tokenizer, self.weights_root, self.learner.version,
                                self.cfg.learner.keep_weights, self.publisher)
        self.learner.metrics.weight_sync_phase_seconds.labels(phase="disk_write", transport="disk").observe(
            time.perf_counter() - t0)
        if update is not None:
            self.learner.metrics.weights_published.inc()
            self.learner.metrics.weight_version.set(update.version)

    def evaluate(self) -> dict[str, Any]:
        """Evaluation of the current version on the held-out slice and ``task.eval_sets``
        (``common.tasks.eval_sets``), on rank 0 only (the other ranks return {} at once).

        A one-process learner evaluates in-process, now, and returns the record (``learner.eval_record``).
        Otherwise the published version goes to the background evaluator (``learner.eval_worker``: all
        engines, off the training path) and {} is returned; its ``eval`` record is appended to metrics.jsonl
        when it completes."""
        if rank() != 0:
            return {}
        if self.task is None:
            self.task = get_task(self.cfg.task)
            fit_task(self.task, self.cfg, self.learner.tokenizer)  # the held-out rows the actors' engines could take
            self.eval_sets = eval_sets(self.cfg, self.task)
        mode, _ = eval_target(self.cfg, world_size())
        if mode == "engine":
            if self.evals is None:
                self.evals = BackgroundEval(self.cfg, self.learner.tokenizer, self.task, self._record_eval,
                                            sets=self.eval_sets)
            self.evals.submit(self.publisher.latest.version if self.publisher is not None and self.publisher.latest else 0)
            return {}
        model = self.learner.policy.module
        if self.learner.policy.zero_optimization_stage() == 3:
            # One rank holds every partition; a gathered copy runs plain forwards.

            state = full_state_dict(self.learner.policy)
            model = load_policy_module(self.cfg.model.path, self.cfg.model.dtype)
            model.load_state_dict(state)
            model.to(next(self.learner.policy.module.parameters()).device)
        # Scalars plus the per-bucket, per-data_source and per-length tables (a report reads accuracy by
        # response length from the run record; the per-prompt lists stay out of metrics.jsonl).
        rec = evaluate_sets(model, self.learner.tokenizer, self.task, self.eval_sets,
                            temperature=self.cfg.actors.temperature, seed=self.cfg.run.seed)
        set_eval_gauges(self.learner.metrics, rec)
        log.info("v%d %s", self.learner.version, eval_line(rec))
        return rec

    def _record_eval(self, rec: dict[str, Any]) -> None:
        """The background evaluator's result (its thread): gauges and a metrics.jsonl ``eval`` record."""
        set_eval_gauges(self.learner.metrics, rec)
        self.records.append(rec)

    def run(self) -> Learner:
        """``learner.total_steps`` steps (or until ``run.max_wall_seconds``), then the final checkpoint and
        evaluations; the endpoints are closed on the way out."""
        if not self.started or self.endpoints is None:
            raise RuntimeError("Runner.run() needs Runner.start() first (resume, renumber, publish)")
        endpoints, learner_cfg = self.endpoints, self.cfg.learner
        max_wall = self.cfg.run.max_wall_seconds
        deadline = time.monotonic() + max_wall if max_wall > 0 else float("inf")
        try:
            if learner_cfg.eval_every > 0 and self.learner.version == 0 and rank() == 0:
                self._evaluate_base_policy()
            while self.learner.version < learner_cfg.total_steps and time.monotonic() < deadline:
                self._train_step()
            self._finish()
        finally:
            endpoints.close()  # the last durable version is written and announced first
            if self.task is not None:
                self.task.close()  # a reward pool's processes (evaluation scores through it)
        return self.learner

    def _evaluate_base_policy(self) -> None:
        """The base policy's accuracy on every set: the reference every later evaluation is read against."""
        t0 = time.perf_counter()
        rep = self.evaluate()
        if rep:  # in-process; an engine evaluation writes its own record when it completes
            log.info("base policy evaluated in %.1f s", time.perf_counter() - t0)
            self.records.append({"kind": "eval", "weight_version": 0, "step": 0, "time": time.time(), **rep})

    def _train_step(self) -> None:
        """One learner step, then whichever of its checkpoint, weight push and evaluation is due: each is a named
        phase of the step's record and gauges only when it ran (a step that saved nothing reports no checkpoint)."""
        learner_cfg, learner = self.cfg.learner, self.learner
        stats = learner.step()
        version, phases = learner.version, Phases()
        if learner_cfg.checkpoint_every > 0 and version % learner_cfg.checkpoint_every == 0:
            with phases("checkpoint"):
                checkpoint.save(self.ckpt_root, learner, learner_cfg.keep_checkpoints)
        if version % max(learner_cfg.weights_every, 1) == 0 or version >= learner_cfg.total_steps:
            with phases("publish"):
                self.publish()
        if learner_cfg.eval_every > 0 and version % learner_cfg.eval_every == 0 and rank() == 0:
            with phases("eval"):
                rep = self.evaluate()
            if rep:
                stats["eval"] = rep
        stats["phase_seconds"].update(phases.seconds)
        for name, seconds in phases.seconds.items():
            learner.metrics.phase_seconds.labels(phase=name).set(seconds)
        if rank() == 0:
            self._record_step(stats)

    def _record_step(self, stats: dict[str, Any]) -> None:
        """Rank 0: the step's metrics.jsonl record (with the source's running totals) and its log line."""
        stats.update(source_totals(self.learner.source))
        self.records.append({"kind": "learner_step", **stats})
        log.info("v%d reward %.3f critic %.4f EV %.3f policy %.4f nll %.3f len %.1f %.0f tok/s MFU %.1f%% %.2fs",
                 self.learner.version, stats["reward_mean"], stats.get("critic_loss", float("nan")),
                 stats.get("value_explained_variance", float("nan")), stats["policy_loss"],
                 stats["nll_loss"], stats["response_length_mean"], stats["tokens_per_second"],
                 100 * stats.get("mfu", float("nan")), stats["step_seconds"])

    def _finish(self) -> None:
        """The final checkpoint, the last evaluations, and the done file the launcher trusts (not exit 0)."""
        learner_cfg, version = self.cfg.learner, self.learner.version
        if learner_cfg.checkpoint_every > 0 and version % learner_cfg.checkpoint_every != 0:
            checkpoint.save(self.ckpt_root, self.learner, learner_cfg.keep_checkpoints)
        if self.evals is not None:  # the run's last evaluations land in metrics.jsonl before it ends
            self.evals.finish()
        if rank() == 0:
            reason = "total_steps" if version >= learner_cfg.total_steps else "run.max_wall_seconds"
            write_json_atomic(self.run_dir / LEARNER_DONE_FILE, {"version": version, "total_steps": learner_cfg.total_steps,
                                                                 "reason": reason, "time": time.time()})


USAGE = """usage: python -m learner [config.yaml] [key=value ...]

Runs the VAPO learner: value pretraining (if enabled and no critic/checkpoint exists yet), then
learner.total_steps critic-then-actor steps on batches from the buffer at buffer.serve_addr, publishing
weights to <run dir>/weights and checkpointing to <run dir>/checkpoints (resume with learner.resume=auto).
Multi-rank: launch under `deepspeed` or `torchrun`; rank 0 talks to the buffer and publishes.
Fields: python -m common.config --help (sections learner, algo, value_pretrain, nll)."""


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv("learner", USAGE, argv)
    if isinstance(cfg, int):
        return cfg
    setup_logging(cfg.run.log_level, f"learner[{rank()}]")
    # Ranks started by deepspeed/torchrun are not our launcher's children, so its parent-death signal
    # does not reach them: they watch the launcher named in VAPO_LIFELINE themselves.

    lifeline.watch_ancestor()
    torch.set_num_threads(cfg.learner.threads)
    if not Path(cfg.model.path).is_dir():
        print(f"model.path {cfg.model.path} does not exist; build it first (python -m learner.sft)", file=sys.stderr)
        return 2

    source = BufferSource(cfg.buffer.serve_addr, cfg.buffer.max_staleness, curve=cfg.buffer.curve) if rank() == 0 else None
    # One registry for the whole process, served from the start: value pretraining's metrics go to the
    # same /metrics as the RL steps', and Prometheus sees the learner during its slow startup too.
    metrics = Metrics("learner")
    # Rank 0's metrics.jsonl and experiment trackers (metrics.trackers), opened once, closed on the way out.
    records = RunRecords.open(cfg) if rank() == 0 else RunRecords(cfg)
    endpoints: Endpoints | None = None
    finished = False
    try:
        if rank() == 0:
            save_config(cfg, cfg.run_dir / "learner_config.yaml")
            records.append_header()  # before value pretraining: every record below was produced by this
            if cfg.metrics.prometheus:
                metrics.serve(cfg.learner.metrics_port, cfg.metrics.host)
        # Bound before value pretraining: a socket address this host lacks (a placeholder) fails now, not hours in.
        endpoints = Endpoints(cfg, metrics)
        critic_path = None
        if (cfg.value_pretrain.enabled and cfg.algo.advantage == "gae" and resolve_checkpoint(cfg) is None):
            critic_path = pretrain_critic(cfg, source, metrics=metrics, records=records)
        Runner(cfg, source, critic_path=critic_path, metrics=metrics, endpoints=endpoints, records=records).start().run()
        finished = True
    finally:
        records.close(failed=not finished)  # a crash keeps every record so far; W&B marks the run failed
        if endpoints is not None:
            endpoints.close()  # a no-op after run(): it closed them
        shutdown_distributed()
    if metrics.stay_for_last_scrape(cfg.metrics.final_scrape_wait_s) is False:
        log.warning("no Prometheus scrape within metrics.final_scrape_wait_s=%.0f s of the last step",
                    cfg.metrics.final_scrape_wait_s)
    return 0
