"""One rollout worker: prompts → G samples with behaviour logprobs → verified, version-stamped groups → buffer.

Launch: ``python -m actors [config.yaml] [key=value ...] --actor-id I`` (see ``actors.__main__``).

Per worker, on one asyncio loop:

- **Prompts** come from ``get_task(cfg.task).train_prompt(index)`` for this actor's shard
  ``index = actor_id + k·num_actors``; ``actors.cursor`` records which k are done under
  ``<run dir>/actors/cursor-<id>.json`` so a restart neither repeats nor skips a prompt.
- **Generation**: ``actors.prompts_in_flight`` loops each take one buffer credit (``AsyncGroupSender.acquire``,
  before generating, so a full buffer makes actors wait instead of producing groups that would be thrown
  away), wait until the engine serves the grant's learner version (the learner publishes a version before
  it asks for the batch the grant is for, but the grant can overtake the ``WeightUpdate``; a group started
  on older weights could be born stale), ask the engine for ``n = G`` samples of the prompt with
  ``return_logprob`` (``actors.groups.GroupMaker``), score the group's responses (``Task.verify_batch`` on
  ``decode_response``; a configured reward runs in a guarded process pool, off the loop), and send the
  ``SampleGroup`` (ack after the buffer's LMDB commit; ``group_id = a<actor>-p<index>``, so re-sends and
  re-generations are stored once).
- **Version stamp**: each sample carries the oldest weight version among its tokens (``GenerateOutput.
  min_weight_version``: rollout_server reports per-token versions; SGLang's ``meta_info.weight_version``
  otherwise); the group's version is the minimum over its samples.
- **Engine and weights** (``actors.engine_link.EngineLink``): starting or reaching the engine
  (``engine.kind``), restarting it (at most ``engine.max_restarts`` times, then the worker exits 1) or
  waiting for it, and loading each newer verified ``WeightUpdate`` (``actors.weight_follower``; announced
  versions are heard by ``actors.weight_watcher``, in-flight requests wait or abort per ``actors.weight_sync``). Prompts wait
  while the link's gate is closed; those in flight when an engine died are generated again.
  ``/generate`` calls time out after ``actors.generate_timeout_s`` (0 = derived from
  ``actors.max_new_tokens``).

On start the worker prints ``ACTOR READY {json}`` and on exit ``ACTOR DONE {json}`` (counters) to stdout,
and keeps ``<run dir>/actors/worker-<id>.json`` (pids, engine URL, weight version) up to date.

Deviations: a group interrupted by an abort is regenerated whole (all G samples on the new weights) rather
than only its unfinished samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from actors.cursor import PromptCursor
from actors.engine_address import EngineLinkError, engine_url
from actors.engine_link import EngineLink, EngineLost
from actors.groups import GroupMaker, WorkerError
from actors.report import ZEROED_METRICS, GroupCounts, LinkCounts, done_counters, emit_tagged
from actors.rollout_server.process import EngineStartError
from actors.weight_push_client import PushMember
from actors.weight_watcher import WeightWatcher
from buffer.client import AsyncGroupSender
from common.config import Config
from common.metrics import Metrics
from common.security import ClientKeys, client_curve_keys
from common.sglang_client import SGLangError
from common.tasks import REWARD_ERROR_KINDS, fit_task, get_task

log = logging.getLogger("vapo.actors.worker")
REPORT_EVERY_S = 10.0


def generate_timeout_s(cfg: Config) -> float:
    """``actors.generate_timeout_s``, or with 0 the time a ``max_new_tokens`` generation needs at the
    slowest decode rate still counted as progress: a fixed constant would abandon (and resubmit, forever)
    every long generation."""
    actors_cfg = cfg.actors
    return actors_cfg.generate_timeout_s or (actors_cfg.generate_timeout_base_s
                                             + actors_cfg.max_new_tokens / actors_cfg.min_tokens_per_s)


class RolloutWorker:
    """One actor: its prompt shard through its engine into the buffer (see the module docstring); the
    ``actors.engine_link.LinkOwner`` of its link."""

    def __init__(self, cfg: Config, actor_id: int) -> None:
        if not 0 <= actor_id < cfg.actors.num_actors:
            raise WorkerError(f"--actor-id {actor_id} outside [0, actors.num_actors={cfg.actors.num_actors})")
        self.cfg, self.actor_id = cfg, actor_id
        try:
            engine_url(cfg, actor_id)  # fail before any startup work when the engine address is missing
        except EngineLinkError as e:
            raise WorkerError(str(e)) from None
        if cfg.engine.kind == "rollout_server" and not (Path(cfg.model.path) / "config.json").is_file():
            raise WorkerError(f"model.path {cfg.model.path} is not an HF model directory (no config.json); "
                              "build the embedded base model with `python -m learner.sft [config]`")
        self.actors_cfg = cfg.actors
        self.metrics = Metrics("actor")
        self.label = str(actor_id)
        self.state_dir = cfg.run_dir / "actors"
        self.task = get_task(cfg.task)
        self.cursor = PromptCursor(self.state_dir / f"cursor-{actor_id}.json", actor_id,
                                   self.actors_cfg.num_actors, limit=self.actors_cfg.max_prompts)
        self.fatal: str | None = None
        self.metrics_port: int | None = None
        self.credit_wait_s = 0.0
        self.weight_wait_s = 0.0
        self.generate_timeout_s = generate_timeout_s(cfg)
        self.in_flight = 0
        self._started = time.monotonic()
        self._stop = asyncio.Event()
        self._all_done = asyncio.Event()  # actors.max_prompts prompts are done
        # Made by run(): the learner's weight announcements, the buffer's sender, the engine, and (once the
        # engine and the tokenizer are there) the group maker.
        self.watcher: WeightWatcher | None = None
        self.sender: AsyncGroupSender | None = None
        self.link: EngineLink | None = None
        self.groups: GroupMaker | None = None
        # Tasks that run for the worker's life, by name (one that ends is fatal), and the prompt loops.
        self.services: dict[str, asyncio.Task[None]] = {}
        self.prompt_tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ small helpers

    def metric(self, name: str, **labels: str) -> Any:
        """This actor's series of the metric ``vapo_actor_<name>``."""
        return getattr(self.metrics, name).labels(actor=self.label, **labels)

    @property
    def counts(self) -> GroupCounts:
        """What this worker's prompts came to (the group maker's; all zero before the engine is up)."""
        return self.groups.counts if self.groups is not None else GroupCounts()

    @property
    def version(self) -> int:
        """The weight version the engine serves (0 before it is reached)."""
        return self.link.version if self.link is not None else 0

    def engine_changed(self) -> None:
        """The engine's served version moved (or a version was refused): record it."""
        self._write_state()

    def stopping(self) -> bool:
        return self._stop.is_set()

    def _write_state(self) -> None:
        link = self.link
        state = {"actor_id": self.actor_id, "pid": os.getpid(), "engine_pid": link.pid if link else None,
                 "engine_url": link.url if link else None, "weight_version": self.version,
                 "model_path": link.model_path if link else self.cfg.model.path, "metrics_port": self.metrics_port}
        path = self.state_dir / f"worker-{self.actor_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)

    def stop(self) -> None:
        self._stop.set()

    def _fail(self, why: str) -> None:
        log.error("actor %d: %s", self.actor_id, why)
        self.fatal = self.fatal or why
        self._stop.set()

    def summary(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self._started
        link = self.link
        counters = done_counters(self.counts, link.counts if link else LinkCounts())
        return {"actor_id": self.actor_id, **counters, "weight_version": self.version,
                "refused_versions": sorted(link.refused) if link else [], "prompts_done": self.cursor.completed,
                "credit_wait_s": round(self.credit_wait_s, 3), "weight_wait_s": round(self.weight_wait_s, 3),
                "elapsed_s": round(elapsed, 3),
                "weight_sync_latency_s": [round(x, 4) for x in link.sync_latencies] if link else [],
                "engine_pid": link.pid if link else None, "fatal": self.fatal}

    # ------------------------------------------------------------------ main

    async def run(self) -> int:
        """Run until stopped (SIGTERM/SIGINT), ``actors.max_prompts`` is reached, or a fatal error; exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        if self.cursor.finished():
            log.info("actor %d: all %d prompts of actors.max_prompts are done", self.actor_id,
                     self.actors_cfg.max_prompts)
            emit_tagged("ACTOR DONE", self.summary())
            return 0
        self._serve_metrics()
        curve = client_curve_keys(self.cfg.buffer.curve, "actor", self.actor_id)  # its own actor-<i> key if any
        self._make_clients(curve)
        try:
            await self._reach_engine()
            self._start_services(curve)
            self.prompt_tasks = [loop.create_task(self._prompt_loop(), name=f"prompt-{i}")
                                 for i in range(self.actors_cfg.prompts_in_flight)]
            if self.cursor.finished():
                self._all_done.set()
            await self._until_done()
        except (WorkerError, EngineLinkError, EngineStartError, SGLangError) as e:
            self._fail(str(e))
        finally:
            await self._cancel_tasks()
            await self._shutdown()
        emit_tagged("ACTOR DONE", self.summary())
        return 1 if self.fatal else 0

    def _serve_metrics(self) -> None:
        """``/metrics`` when ``metrics.prometheus``; every series at zero either way."""
        cfg = self.cfg
        if cfg.metrics.prometheus:
            base = self.actors_cfg.metrics_base_port
            port = base + self.actor_id if base > 0 else 0
            try:
                self.metrics_port = self.metrics.serve(port, cfg.metrics.host)
            except OSError as e:
                raise WorkerError(f"cannot serve /metrics on {cfg.metrics.host}:{port}: {e}") from e
        for name in ZEROED_METRICS:
            self.metric(name)
        for kind in REWARD_ERROR_KINDS:
            self.metric("reward_errors", kind=kind)

    def _make_clients(self, curve: ClientKeys | None) -> None:
        """The weight watcher, the buffer's sender and the engine link (nothing is reached yet)."""
        cfg, actors_cfg = self.cfg, self.actors_cfg
        self.watcher = WeightWatcher(cfg.learner.publish_addr, cfg.learner.query_addr, curve=curve,
                                     poll_s=actors_cfg.weight_poll_s, query_timeout_s=actors_cfg.weight_query_timeout_s)
        self.sender = AsyncGroupSender(cfg.buffer.ingest_addr, self.actor_id, curve=curve,
                                       ack_timeout_s=actors_cfg.send_timeout_s)
        self.link = EngineLink(cfg, self.actor_id, self.watcher, self, self.metrics,
                               generate_timeout_s=self.generate_timeout_s)

    async def _reach_engine(self) -> None:
        """The newest announced weights, the tokenizer and the engine, then the group maker that uses both;
        then ``ACTOR READY``."""
        assert self.watcher is not None and self.link is not None
        link, model_path = self.link, self.cfg.model.path
        await self.watcher.query()

        def tokenizer() -> Any:
            from common.modeling import load_tokenizer  # noqa: PLC0415 - torch and transformers load in this thread, while the engine boots

            tok = load_tokenizer(model_path)
            try:
                fit_task(self.task, self.cfg, tok)  # prompts too long for the engine: skipped or refused, before any is drawn
            except ValueError as e:
                raise WorkerError(str(e)) from None
            return tok

        # The engine boots (seconds) while this process imports transformers for the tokenizer.
        tok, _ = await asyncio.gather(asyncio.to_thread(tokenizer), link.connect())
        self.groups = GroupMaker(self.cfg, self.actor_id, self.task, link, tok, self.metric,
                                 generate_timeout_s=self.generate_timeout_s)
        link.gate.set()
        emit_tagged("ACTOR READY", {"actor_id": self.actor_id, "pid": os.getpid(), "engine_url": link.url,
                                    "engine_pid": link.pid, "metrics_port": self.metrics_port, "weight_version": self.version,
                                    "prompts_done": self.cursor.completed})

    def _start_services(self, curve: ClientKeys | None) -> None:
        """Start the tasks that run for the worker's life, each under its name."""
        assert self.watcher is not None and self.link is not None
        loop, link = asyncio.get_running_loop(), self.link
        member = None
        if self.cfg.learner.weight_transport == "distributed":  # the learner broadcasts; disk is the fallback
            member = PushMember(link, self.cfg.learner.push_addr, self.actors_cfg.push_pause, curve=curve)
        services = {"weights": self.watcher.run(), "sync": link.sync_loop(), "supervise": link.supervise(),
                    "report": self._report_loop(), "health": link.watch_health()}
        if member is not None:
            services["push"] = member.run()
        self.services = {name: loop.create_task(coro, name=name) for name, coro in services.items()}
        self.watcher.nudge()  # apply anything newer than what the engine started with

    async def _until_done(self) -> None:
        """Wait until stopped or every prompt is done; a failed task, or a service that ended, is fatal."""
        loop = asyncio.get_running_loop()
        waiters = {loop.create_task(self._stop.wait()), loop.create_task(self._all_done.wait())}
        pending: set[asyncio.Task[Any]] = {*self.services.values(), *self.prompt_tasks}
        try:
            while not (self._stop.is_set() or self._all_done.is_set()):
                done, pending = await asyncio.wait(pending | waiters, return_when=asyncio.FIRST_COMPLETED)
                pending -= waiters
                for task in done - waiters:  # prompt loops return normally once the cursor is exhausted
                    self._task_ended(task)
        finally:
            for waiter in waiters:
                waiter.cancel()

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        name = task.get_name()
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, EngineLost):  # the link's verdict: its message is the reason
            self._fail(str(exc))
        elif exc is not None:
            log.error("task %s failed", name, exc_info=exc)
            self._fail(f"task {name} failed: {type(exc).__name__}: {exc}")
        elif self.services.get(name) is task:
            self._fail(f"task {name} ended unexpectedly")

    async def _cancel_tasks(self) -> None:
        tasks = [*self.services.values(), *self.prompt_tasks]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _shutdown(self) -> None:
        self.task.close()  # the reward pool's processes, if any
        if self.sender is not None:
            with contextlib.suppress(Exception):
                await self.sender.close()
        if self.watcher is not None:
            with contextlib.suppress(Exception):
                self.watcher.close()
        if self.link is not None:
            await self.link.close()

    # ------------------------------------------------------------------ prompts

    async def _prompt_loop(self) -> None:
        assert self.sender is not None and self.groups is not None
        while not self._stop.is_set():
            if self.cursor.exhausted():
                return
            t0 = time.monotonic()
            grant = await self.sender.acquire(1)
            waited = time.monotonic() - t0
            self.credit_wait_s += waited
            self.metric("credit_wait_seconds").inc(waited)
            await self._await_weights(grant.learner_version)
            k = self.cursor.take()
            if k is None:
                return  # the unused credit lapses after buffer.credit_ttl_s
            self.in_flight += 1
            self.metric("prompts_in_flight").set(self.in_flight)
            try:
                group = await self.groups.make(self.cursor.index(k))
                if group is None:
                    self.cursor.complete(k)
                    if self.cursor.finished():
                        self._all_done.set()
                    continue
                resent = self.sender.resent
                ack = await self.sender.send(group)
                self.cursor.complete(k)
                self.groups.record(group, ack, self.sender.resent - resent)
                if self.cursor.finished():
                    self._all_done.set()
            except BaseException:
                self.cursor.release(k)
                raise
            finally:
                self.in_flight -= 1
                self.metric("prompts_in_flight").set(self.in_flight)
        return

    async def _await_weights(self, needed: int) -> None:
        """Hold a granted prompt until the engine serves the grant's learner version (``EngineLink.
        await_version``, at most ``actors.weight_wait_s``); the wait is counted."""
        assert self.link is not None
        waited = await self.link.await_version(needed, self.actors_cfg.weight_wait_s)
        if waited:
            self.weight_wait_s += waited
            self.metric("weight_wait_seconds").inc(waited)

    # ------------------------------------------------------------------ progress

    async def _report_loop(self) -> None:
        last_t, last_samples = time.monotonic(), 0
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            now = time.monotonic()
            rate = (self.counts.samples - last_samples) / max(now - last_t, 1e-9)
            last_t, last_samples = now, self.counts.samples
            self.metric("samples_per_second").set(rate)
            log.info("actor %d: %d groups, %.1f samples/s, weights v%d, positives %.3f, in flight %d, restarts %d",
                     self.actor_id, self.counts.groups, rate, self.version,
                     self.counts.positives / max(self.counts.samples, 1), self.in_flight,
                     self.link.counts.engine_restarts if self.link else 0)


def run_worker(cfg: Config, actor_id: int) -> int:
    try:
        worker = RolloutWorker(cfg, actor_id)
        rc = asyncio.run(worker.run())
    except WorkerError as e:
        log.error("actor %d: %s", actor_id, e)
        return 1
    # After the engine has stopped (so that the launcher's stop grace can only cut this wait short): the
    # groups scored since the last scrape set the reward and throughput gauges, which Grafana would never see.
    if worker.metrics.stay_for_last_scrape(cfg.metrics.final_scrape_wait_s) is False:
        log.warning("actor %d: no Prometheus scrape within metrics.final_scrape_wait_s=%.0f s of stopping",
                    actor_id, cfg.metrics.final_scrape_wait_s)
    return rc


__all__ = ["RolloutWorker", "WorkerError", "run_worker"]
