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
  ``return_logprob``, verify every response (``Task.verify`` on ``decode_response``), and send the
  ``SampleGroup`` (ack after the buffer's LMDB commit; ``group_id = a<actor>-p<index>``, so re-sends and
  re-generations are stored once).
- **Version stamp**: each sample carries the oldest weight version among its tokens (``GenerateOutput.
  min_weight_version``: rollout_server reports per-token versions; SGLang's ``meta_info.weight_version``
  otherwise); the group's version is the minimum over its samples.
- **Weight sync** (``actors.weight_sync``): on a newer ``WeightUpdate`` the checksum is verified, then the
  engine is told ``/update_weights_from_disk(model_path, weight_version)``. ``actors.weight_sync = wait``:
  requests in flight finish on the old weights (the engine applies the update between them, as SGLang's
  update lock does); ``abort``: ``/pause_generation(mode=abort)`` → update → ``/continue_generation`` and
  the aborted prompts are generated again. Before the engine is asked, the weights must match their
  checksum and (``actors.verify_tensors``) hold every tensor of ``model.path`` with its shape, all finite.
  A refused update (reasons ``missing``, ``checksum``, ``missing_tensors``, ``shape``, ``non_finite``,
  ``unreadable``, ``load_error``) is counted in ``vapo_actor_weight_sync_failures{reason}`` and the old
  weights keep serving. When the engine answers an update with an error but generates with the new
  version anyway (SGLang: 400 after a completed load whose cache flush was refused), that version is
  accepted. ``/generate`` calls time out after ``actors.generate_timeout_s`` (0 = derived from
  ``actors.max_new_tokens``). Latency
  (``WeightUpdate.created_at`` → engine serving it) goes to ``vapo_actor_weight_sync_seconds``.
- **Engine**: ``engine.kind = rollout_server``: the worker starts its own ``actors.rollout_server`` with the
  newest verified weights, and restarts it when it dies or stops answering ``/health``
  (``engine.health_failures`` probes in a row, every ``engine.health_interval_s``, none while the worker
  itself pauses or updates the engine) (at most ``engine.max_restarts`` times, then the worker exits 1);
  the prompts in flight are generated again on the new engine. ``sglang``: the engine at
  ``engine.host:engine.base_port + i`` (started by ``ops/launch.sh`` through ``actors.sglang_launcher``);
  ``external``: ``engine.urls[i]``. When those go away the worker waits for them and re-syncs weights.

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
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from actors.cursor import PromptCursor, group_id_for
from actors.rollout_server.process import EngineStartError, RolloutServerProcess
from actors.sglang_client import GenerateOutput, SGLangClient, SGLangError
from actors.weight_sync import WeightWatcher, checkpoint_tensors, verify_tensors, verify_update
from buffer.client import AsyncGroupSender
from common.config import Config
from common.metrics import Metrics
from common.protocol import FINISH_REASONS, Sample, SampleGroup
from common.security import client_curve_keys
from common.tasks import Prompt, decode_response, encode_prompt, get_task

log = logging.getLogger("vapo.actors.worker")
REPORT_EVERY_S = 10.0


def emit_tagged(tag: str, obj: dict[str, Any]) -> None:
    """Print ``TAG {json}`` as one write: sibling workers share their parent's stdout pipe, unbuffered under
    ``PYTHONUNBUFFERED``, where ``print``'s separate newline write lets two workers' lines run together."""
    sys.stdout.write(f"{tag} {json.dumps(obj)}\n")
    sys.stdout.flush()


class WorkerError(RuntimeError):
    """A condition the worker cannot recover from (engine restarts exhausted, bad engine output)."""


def generate_timeout_s(cfg: Config) -> float:
    """``actors.generate_timeout_s``, or with 0 the time a ``max_new_tokens`` generation needs at the
    slowest decode rate still counted as progress: a fixed constant would abandon (and resubmit, forever)
    every long generation."""
    a = cfg.actors
    return a.generate_timeout_s or a.generate_timeout_base_s + a.max_new_tokens / a.min_tokens_per_s


def engine_url(cfg: Config, actor_id: int) -> str | None:
    """The URL of an engine vapo does not start itself (None for rollout_server: known once started)."""
    e = cfg.engine
    if e.kind == "external":
        if actor_id >= len(e.urls):
            raise WorkerError(f"engine.kind=external: engine.urls has {len(e.urls)} URLs, actor {actor_id} needs one")
        return e.urls[actor_id].rstrip("/")
    if e.kind == "sglang":
        return f"http://{e.host}:{e.base_port + actor_id}"
    return None


class RolloutWorker:
    def __init__(self, cfg: Config, actor_id: int) -> None:
        if not 0 <= actor_id < cfg.actors.num_actors:
            raise WorkerError(f"--actor-id {actor_id} outside [0, actors.num_actors={cfg.actors.num_actors})")
        self.cfg, self.actor_id = cfg, actor_id
        engine_url(cfg, actor_id)  # fail before any startup work when the engine address is missing
        if cfg.engine.kind == "rollout_server" and not (Path(cfg.model.path) / "config.json").is_file():
            raise WorkerError(f"model.path {cfg.model.path} is not an HF model directory (no config.json); "
                              "build the embedded base model with `python -m learner.sft [config]`")
        self.a = cfg.actors
        self.metrics = Metrics("actor")
        self.label = str(actor_id)
        self.state_dir = cfg.run_dir / "actors"
        self.version = 0
        self.model_path = cfg.model.path
        self.client: SGLangClient | None = None
        self.engine: RolloutServerProcess | None = None
        self.refused: dict[int, str] = {}  # version -> reason
        self.fatal: str | None = None
        self.metrics_port: int | None = None
        self.counts = {"groups": 0, "samples": 0, "tokens": 0, "positives": 0, "resubmits": 0, "engine_restarts": 0,
                       "weight_syncs": 0, "weight_sync_failures": 0, "skipped": 0, "duplicates": 0, "not_served": 0}
        self.sync_latencies: list[float] = []
        self.credit_wait_s = 0.0
        self.weight_wait_s = 0.0
        self.generate_timeout_s = generate_timeout_s(cfg)
        self._expected: dict[str, tuple[int, ...]] | None = None  # base model's tensor shapes, read once
        self._version_changed = asyncio.Event()  # replaced (and the old one set) on every version change
        self.in_flight = 0
        self._started = time.monotonic()

    # ------------------------------------------------------------------ small helpers

    def _m(self, name: str, **labels: str) -> Any:
        return getattr(self.metrics, name).labels(actor=self.label, **labels)

    def _set_version(self, version: int, path: str) -> None:
        self.version, self.model_path = version, path
        self._m("weight_version").set(version)
        self._write_state()
        self._wake_version_waiters()

    def _wake_version_waiters(self) -> None:
        ev, self._version_changed = self._version_changed, asyncio.Event()
        ev.set()

    def _write_state(self) -> None:
        state = {"actor_id": self.actor_id, "pid": os.getpid(), "engine_pid": self.engine.pid if self.engine else None,
                 "engine_url": self.client.base_url if self.client else None, "weight_version": self.version,
                 "model_path": self.model_path, "metrics_port": self.metrics_port}
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
        return {"actor_id": self.actor_id, **self.counts, "weight_version": self.version,
                "refused_versions": sorted(self.refused), "prompts_done": self.cursor.completed,
                "credit_wait_s": round(self.credit_wait_s, 3), "weight_wait_s": round(self.weight_wait_s, 3),
                "elapsed_s": round(elapsed, 3),
                "weight_sync_latency_s": [round(x, 4) for x in self.sync_latencies],
                "engine_pid": self.engine.pid if self.engine else None, "fatal": self.fatal}

    # ------------------------------------------------------------------ main

    async def run(self) -> int:
        """Run until stopped (SIGTERM/SIGINT), ``actors.max_prompts`` is reached, or a fatal error; exit code."""
        self._stop = asyncio.Event()
        self._gate = asyncio.Event()  # set while the engine accepts requests
        self._control = asyncio.Lock()  # weight syncs and engine restarts, one at a time
        self._trouble = asyncio.Event()  # a request failed: the engine may be gone
        self._all_done = asyncio.Event()  # actors.max_prompts prompts are done
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        cfg = self.cfg
        self.task = get_task(cfg.task)
        self.cursor = PromptCursor(self.state_dir / f"cursor-{self.actor_id}.json", self.actor_id,
                                   self.a.num_actors, limit=self.a.max_prompts)
        if self.cursor.finished():
            log.info("actor %d: all %d prompts of actors.max_prompts are done", self.actor_id, self.a.max_prompts)
            emit_tagged("ACTOR DONE", self.summary())
            return 0
        if cfg.metrics.prometheus:
            port = self.a.metrics_base_port + self.actor_id if self.a.metrics_base_port > 0 else 0
            try:
                self.metrics_port = self.metrics.serve(port, cfg.metrics.host)
            except OSError as e:
                raise WorkerError(f"cannot serve /metrics on {cfg.metrics.host}:{port}: {e}") from e
        for name in ("samples", "tokens", "groups_sent", "groups_resent", "credit_wait_seconds", "weight_wait_seconds",
                     "engine_restarts", "prompts_skipped", "weight_sync_seconds", "generation_seconds", "weight_version",
                     "samples_per_second", "prompts_in_flight"):
            self._m(name)  # every series exists (zero) from the start, so dashboards show it before the first event
        curve = client_curve_keys(cfg.buffer.curve)
        self.watcher = WeightWatcher(cfg.learner.publish_addr, cfg.learner.query_addr, curve=curve,
                                     poll_s=self.a.weight_poll_s, query_timeout_s=self.a.weight_query_timeout_s)
        self.sender = AsyncGroupSender(cfg.buffer.ingest_addr, self.actor_id, curve=curve,
                                       ack_timeout_s=self.a.send_timeout_s)
        tasks: list[asyncio.Task[Any]] = []
        try:
            await self.watcher.query()

            async def connect() -> None:
                async with self._control:
                    await self._connect_engine()

            # The engine boots (seconds) while this process imports transformers for the tokenizer.
            self.tokenizer, _ = await asyncio.gather(asyncio.to_thread(_load_tokenizer, cfg.model.path), connect())
            self._gate.set()
            emit_tagged("ACTOR READY", {"actor_id": self.actor_id, "pid": os.getpid(), "engine_url": self.client.base_url,
                                        "engine_pid": self.engine.pid if self.engine else None,
                                        "metrics_port": self.metrics_port, "weight_version": self.version,
                                        "prompts_done": self.cursor.completed})
            tasks = [loop.create_task(self.watcher.run(), name="weights"),
                     loop.create_task(self._sync_loop(), name="sync"),
                     loop.create_task(self._supervise(), name="supervise"),
                     loop.create_task(self._report_loop(), name="report"),
                     loop.create_task(self._watch_health(), name="health")]
            self.watcher.changed.set()  # apply anything newer than what the engine started with
            prompts = [loop.create_task(self._prompt_loop(), name=f"prompt-{i}") for i in range(self.a.prompts_in_flight)]
            tasks += prompts
            if self.cursor.finished():
                self._all_done.set()
            waiters = {loop.create_task(self._stop.wait()), loop.create_task(self._all_done.wait())}
            pending = set(tasks)
            while not (self._stop.is_set() or self._all_done.is_set()):
                done, pending = await asyncio.wait(pending | waiters, return_when=asyncio.FIRST_COMPLETED)
                pending -= waiters
                for t in done - waiters:  # prompt loops return normally once the cursor is exhausted
                    exc = None if t.cancelled() else t.exception()
                    if exc is not None:
                        log.error("task %s failed", t.get_name(), exc_info=exc)
                        self._fail(f"task {t.get_name()} failed: {type(exc).__name__}: {exc}")
                    elif t in tasks[:5]:
                        self._fail(f"task {t.get_name()} ended unexpectedly")
            for w in waiters:
                w.cancel()
        except (WorkerError, EngineStartError, SGLangError) as e:
            self._fail(str(e))
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await self._shutdown()
        emit_tagged("ACTOR DONE", self.summary())
        return 1 if self.fatal else 0

    async def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            await self.sender.close()
        with contextlib.suppress(Exception):
            self.watcher.close()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
        if self.engine is not None:
            await self.engine.stop()

    # ------------------------------------------------------------------ engine

    def _verify(self, upd: Any) -> tuple[str, str] | None:
        """Checksum, then (``actors.verify_tensors``) names, shapes and finiteness; blocking (a thread)."""
        bad = verify_update(upd)
        if bad is None and self.a.verify_tensors:
            if self._expected is None:
                self._expected = checkpoint_tensors(self.cfg.model.path)
            bad = verify_tensors(upd.path, self._expected)
        return bad

    def _newest_verified(self) -> tuple[int, str]:
        """(version, path) to start an engine with: the newest announced weights that verify, else current."""
        upd = self.watcher.latest
        if upd is not None and upd.version > self.version and upd.version not in self.refused:
            bad = self._verify(upd)
            if bad is None:
                return upd.version, upd.path
            self._refuse(upd, *bad)
        return self.version, self.model_path

    async def _connect_engine(self) -> None:
        """Start (rollout_server) or reach (sglang/external) the engine; caller holds ``_control``."""
        url = engine_url(self.cfg, self.actor_id)
        if self.client is not None:
            await self.client.close()
        if url is None:
            if self.engine is None:
                self.engine = RolloutServerProcess(self.cfg, self.actor_id,
                                                   self.cfg.run_dir / "logs" / f"engine-{self.actor_id}.log")
            version, path = await asyncio.to_thread(self._newest_verified)
            url = await self.engine.start(path, version)
            self.client = SGLangClient(url, timeout_s=self.generate_timeout_s)
            self._set_version(version, path)
            return
        self.client = SGLangClient(url, timeout_s=self.generate_timeout_s)
        await self.client.wait_healthy(self.cfg.engine.startup_timeout_s)
        served = _as_version(await self.client.get_weight_version())
        self._set_version(served, self.model_path if served == self.version else self.cfg.model.path)
        await self._sync_locked(idle=True)  # newest weights before the first request

    async def _supervise(self) -> None:
        if self.engine is not None:
            await self._supervise_process()
        else:
            await self._supervise_remote()

    async def _supervise_process(self) -> None:
        """Restart our rollout_server when it dies, with the newest verified weights."""
        assert self.engine is not None
        while True:
            rc = await self.engine.wait()
            if self._stop.is_set():
                return
            log.warning("actor %d: engine (pid %s) exited with code %s; restarting", self.actor_id, self.engine.pid, rc)
            async with self._control:
                self._gate.clear()
                while True:
                    self.counts["engine_restarts"] += 1
                    self._m("engine_restarts").inc()
                    if self.counts["engine_restarts"] > self.cfg.engine.max_restarts:
                        self._fail(f"engine died {self.counts['engine_restarts']} times "
                                   f"(engine.max_restarts={self.cfg.engine.max_restarts}); see {self.engine.log_path}")
                        return
                    await self.watcher.query()
                    try:
                        await self._connect_engine()
                        break
                    except (EngineStartError, SGLangError) as e:
                        log.warning("actor %d: engine restart failed: %s", self.actor_id, e)
                self._gate.set()
            self.watcher.changed.set()

    async def _watch_health(self) -> None:
        """Liveness beyond process exit: an engine whose scheduler hung (or a remote one that stopped
        answering) fails ``/health``. ``engine.health_failures`` consecutive failures, one probe every
        ``engine.health_interval_s`` of at most ``engine.health_timeout_s`` each, count as dead: our own
        rollout_server is killed (its supervisor restarts it), a remote engine is waited for and re-synced.
        No probe counts while this worker pauses, updates or restarts the engine: SGLang's /health runs a
        generation, which cannot run then."""
        e = self.cfg.engine
        failures = 0
        while True:
            await asyncio.sleep(e.health_interval_s)
            client = self.client
            if client is None or not self._gate.is_set() or self._control.locked():
                failures = 0
                continue
            ok = await client.health(e.health_timeout_s)
            if ok or self._control.locked() or client is not self.client:
                failures = 0
                continue
            failures += 1
            log.warning("actor %d: engine %s failed /health (%d/%d)", self.actor_id, client.base_url, failures,
                        e.health_failures)
            if failures < e.health_failures:
                continue
            failures = 0
            if self.engine is not None and self.engine.running():
                log.error("actor %d: engine (pid %s) failed %d /health probes in a row; killing it to restart it",
                          self.actor_id, self.engine.pid, e.health_failures)
                self.engine.kill()
            else:
                self._trouble.set()

    async def _supervise_remote(self) -> None:
        """An engine we do not own stopped answering or went back to older weights (it was restarted):
        wait for it, then re-sync the newest weights before generating again."""
        assert self.client is not None
        while True:
            await self._trouble.wait()
            self._trouble.clear()
            async with self._control:
                if not await self.client.health(self.cfg.engine.health_timeout_s):
                    self._gate.clear()
                    log.warning("actor %d: engine %s unreachable; waiting for it", self.actor_id, self.client.base_url)
                    try:
                        await self.client.wait_healthy(self.cfg.engine.startup_timeout_s * (self.cfg.engine.max_restarts + 1))
                    except SGLangError as e:
                        self._fail(f"engine {self.client.base_url} did not come back: {e}")
                        return
                try:
                    served = _as_version(await self.client.get_weight_version())
                except SGLangError:
                    self._gate.set()
                    continue  # a blip: requests will fail again and bring us back here
                if served != self.version:
                    self._gate.clear()
                    self.counts["engine_restarts"] += 1
                    self._m("engine_restarts").inc()
                    log.warning("actor %d: engine serves v%d, expected v%d (restarted?); re-syncing", self.actor_id,
                                served, self.version)
                    self._set_version(served, self.cfg.model.path)
                    await self.watcher.query()
                    await self._sync_locked(idle=True)
                self._gate.set()
            self.watcher.changed.set()

    # ------------------------------------------------------------------ weights

    def _refuse(self, upd: Any, reason: str, message: str) -> None:
        if upd.version in self.refused:
            return
        self.refused[upd.version] = reason
        self.counts["weight_sync_failures"] += 1
        self._m("weight_sync_failures", reason=reason).inc()
        log.error("actor %d: refusing weights v%d (%s): %s; still serving v%d", self.actor_id, upd.version, reason,
                  message, self.version)
        self._wake_version_waiters()  # prompts held for this version go ahead on the current weights

    async def _sync_loop(self) -> None:
        while True:
            await self.watcher.changed.wait()
            self.watcher.changed.clear()
            await self._sync_to_latest()

    async def _sync_to_latest(self) -> None:
        async with self._control:
            if self._gate.is_set():  # else the engine is down and its restart loads the newest weights
                await self._sync_locked(idle=False)

    async def _sync_locked(self, idle: bool) -> bool:
        """Load the newest announced weights if they verify; caller holds ``_control``. True if loaded.

        ``idle``: the gate is closed and nothing is generating (startup, after a restart), so the update
        needs no pause whatever ``actors.weight_sync`` says.
        """
        upd = self.watcher.latest
        if upd is None or upd.version <= self.version or upd.version in self.refused:
            return False
        bad = await asyncio.to_thread(self._verify, upd)
        if bad is not None:
            self._refuse(upd, *bad)
            return False
        assert self.client is not None
        client = self.client
        try:
            if self.a.weight_sync == "abort" and not idle:
                self._gate.clear()
                try:
                    await client.pause_generation("abort")
                    await client.update_weights_from_disk(upd.path, weight_version=upd.version)
                finally:
                    with contextlib.suppress(SGLangError):
                        await client.continue_generation()
                    self._gate.set()
            else:
                await client.update_weights_from_disk(upd.path, weight_version=upd.version)
        except SGLangError as e:
            if e.status is None:  # engine unreachable: the supervisor reloads the newest weights
                log.warning("actor %d: weight update v%d failed, engine unreachable: %s", self.actor_id, upd.version, e)
                self._trouble.set()
                return False
            if not await self._served_anyway(client, upd, e):
                self._refuse(upd, "load_error", e.message)
                return False
        latency = max(0.0, time.time() - upd.created_at)
        self._set_version(upd.version, upd.path)
        self.counts["weight_syncs"] += 1
        self.sync_latencies.append(latency)
        self._m("weight_sync_seconds").observe(latency)
        log.info("actor %d: serving weights v%d (%.3f s after publish)", self.actor_id, upd.version, latency)
        return True

    async def _served_anyway(self, client: SGLangClient, upd: Any, e: SGLangError) -> bool:
        """After an update answered with an error: True when the engine generates with ``upd`` anyway.
        SGLang answers 400 when the cache flush after a completed load is refused (requests still queued),
        with the new weights live: refusing that version would misstamp every sample from then on."""
        try:
            served = await client.served_weight_version(timeout_s=self.generate_timeout_s)
        except SGLangError as e2:
            log.warning("actor %d: cannot ask the engine which weights it serves after a failed update: %s",
                        self.actor_id, e2)
            return False
        if _as_version(served) != upd.version:
            return False
        log.warning("actor %d: engine answered %s to the update to v%d but generates with it; accepting v%d",
                    self.actor_id, e, upd.version, upd.version)
        return True

    # ------------------------------------------------------------------ prompts

    async def _prompt_loop(self) -> None:
        while not self._stop.is_set():
            if self.cursor.exhausted():
                return
            t0 = time.monotonic()
            grant = await self.sender.acquire(1)
            waited = time.monotonic() - t0
            self.credit_wait_s += waited
            self._m("credit_wait_seconds").inc(waited)
            await self._await_weights(grant.learner_version)
            k = self.cursor.take()
            if k is None:
                return  # the unused credit lapses after buffer.credit_ttl_s
            self.in_flight += 1
            self._m("prompts_in_flight").set(self.in_flight)
            try:
                group = await self._generate_group(k)
                if group is None:
                    self.cursor.complete(k)
                    if self.cursor.finished():
                        self._all_done.set()
                    continue
                resent = self.sender.resent
                ack = await self.sender.send(group)
                self.cursor.complete(k)
                self._record(group, ack, self.sender.resent - resent)
                if self.cursor.finished():
                    self._all_done.set()
            except BaseException:
                self.cursor.release(k)
                raise
            finally:
                self.in_flight -= 1
                self._m("prompts_in_flight").set(self.in_flight)
        return

    async def _await_weights(self, needed: int) -> None:
        """Hold a granted prompt until the engine serves weights ``>= needed`` (the grant's learner version).

        Only a version that has been announced and not refused is waited for (one that was never published,
        with ``learner.weights_every > 1``, is not), and never longer than ``actors.weight_wait_s``. A grant
        that overtook its ``WeightUpdate`` triggers an immediate ``WeightQuery`` rather than waiting for the
        next poll.
        """
        if self.version >= needed or self.a.weight_wait_s <= 0:
            return
        t0 = time.monotonic()
        latest = self.watcher.latest
        if latest is None or latest.version < needed:
            await self.watcher.query()  # the PUB message is on its way or was dropped: ask
            latest = self.watcher.latest
        if latest is None:
            return
        target = min(needed, latest.version)
        deadline = t0 + self.a.weight_wait_s
        # The sync loop loads only the newest announced update: while that one is refused, nothing moves.
        while self.version < target and self.watcher.latest.version not in self.refused:
            changed = self._version_changed
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("actor %d: still serving v%d %.0f s after a grant for learner v%d; generating anyway "
                            "(actors.weight_wait_s)", self.actor_id, self.version, self.a.weight_wait_s, needed)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)
        waited = time.monotonic() - t0
        self.weight_wait_s += waited
        self._m("weight_wait_seconds").inc(waited)

    def _record(self, group: SampleGroup, ack: Any, resent: int) -> None:
        rewards = [s.reward for s in group.samples]
        n_pos = sum(1 for r in rewards if r >= 1.0)
        tokens = sum(s.response_length for s in group.samples)
        self.counts["groups"] += 1
        self.counts["samples"] += len(rewards)
        self.counts["tokens"] += tokens
        self.counts["positives"] += n_pos
        self.counts["duplicates"] += int(bool(ack.duplicate))
        if ack.error:  # committed but never served: "stale" or "filtered:<why>"
            self.counts["not_served"] += 1
            self._m("groups_not_served", reason=ack.error.split(":", 1)[0]).inc()
        self._m("groups_sent").inc()
        self._m("samples").inc(len(rewards))
        self._m("tokens").inc(tokens)
        self._m("reward_mean").set(sum(rewards) / len(rewards))
        self._m("positives_rate").set(n_pos / len(rewards))
        if resent > 0:
            self._m("groups_resent").inc(resent)

    async def _generate_group(self, k: int) -> SampleGroup | None:
        """G verified samples of this actor's k-th prompt; None if the engine refuses the prompt."""
        index = self.cursor.index(k)
        prompt = self.task.train_prompt(index)
        ids = encode_prompt(self.tokenizer, prompt)
        sp: dict[str, Any] = {"n": self.a.group_size, "temperature": self.a.temperature, "top_p": self.a.top_p,
                              "top_k": self.a.top_k, "max_new_tokens": self.a.max_new_tokens}
        failures = 0
        while True:
            await self._gate.wait()
            client, v_before = self.client, self.version
            assert client is not None
            t0 = time.monotonic()
            try:
                outs = await client.generate(ids, sp, return_logprob=True, timeout_s=self.generate_timeout_s)
            except SGLangError as e:
                if e.status is not None and 400 <= e.status < 500:
                    log.error("actor %d: engine refused prompt %d (%s): %s; skipping it", self.actor_id, index,
                              prompt.prompt_id, e.message)
                    self.counts["skipped"] += 1
                    self._m("prompts_skipped").inc()
                    return None
                failures += 1
                self.counts["resubmits"] += 1
                self._m("resubmits", reason="engine_error").inc()
                self._trouble.set()
                if failures % 10 == 1:
                    log.warning("actor %d: generate failed (%s); will resubmit", self.actor_id, e)
                # Back off while the supervisor notices a dead engine (its exit or /health) and restarts it.
                await asyncio.sleep(min(0.05 * 2 ** min(failures, 6), 2.0))
                continue
            reported = [o.weight_version_int for o in outs if o.weight_version_int is not None]
            if self.engine is None and reported and min(reported) < v_before:
                self._trouble.set()  # an engine we do not own lost our weights: re-sync (samples stay honest)
            if any(o.finish_reason == "abort" for o in outs):
                self.counts["resubmits"] += 1
                self._m("resubmits", reason="abort").inc()
                continue  # aborted for a weight update: generate the whole group again on the new weights
            self._m("generation_seconds").observe(time.monotonic() - t0)
            v_now = min(v_before, self.version)
            samples = [self._sample(prompt, ids, o, v_now) for o in outs]
            return SampleGroup(group_id=group_id_for(self.actor_id, index), prompt_id=prompt.prompt_id,
                               task=self.task.name, actor_id=self.actor_id, samples=samples, created_at=time.time())

    def _sample(self, prompt: Prompt, prompt_ids: list[int], o: GenerateOutput, fallback_version: int) -> Sample:
        if o.output_logprobs is None or any(not math.isfinite(x) for x in o.output_logprobs):
            raise WorkerError(f"engine returned no or non-finite output logprobs (rid {o.rid}); behaviour logprobs are required")
        version = o.weight_version_int
        if version is None:  # SGLang started without --weight-version: what this worker loaded
            version = fallback_version
        verdict = self.task.verify(prompt, decode_response(self.tokenizer, o.output_ids))
        return Sample(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            output_ids=np.asarray(o.output_ids, dtype=np.int32),
            output_logprobs=np.asarray(o.output_logprobs, dtype=np.float32),
            reward=float(verdict.reward),
            finish_reason=o.finish_reason if o.finish_reason in FINISH_REASONS else "stop",
            weight_version=int(version),
            response_length=len(o.output_ids),
        )

    # ------------------------------------------------------------------ progress

    async def _report_loop(self) -> None:
        last_t, last_samples = time.monotonic(), 0
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            now = time.monotonic()
            rate = (self.counts["samples"] - last_samples) / max(now - last_t, 1e-9)
            last_t, last_samples = now, self.counts["samples"]
            self._m("samples_per_second").set(rate)
            log.info("actor %d: %d groups, %.1f samples/s, weights v%d, positives %.3f, in flight %d, restarts %d",
                     self.actor_id, self.counts["groups"], rate, self.version,
                     self.counts["positives"] / max(self.counts["samples"], 1), self.in_flight,
                     self.counts["engine_restarts"])


def _load_tokenizer(path: str) -> Any:
    from common.modeling import load_tokenizer

    return load_tokenizer(path)


def _as_version(v: Any) -> int:
    """SGLang's weight_version is a string ('default' when never set): vapo's versions are its integers."""
    try:
        return max(0, int(v))
    except (TypeError, ValueError):
        return 0


def run_worker(cfg: Config, actor_id: int) -> int:
    try:
        return asyncio.run(RolloutWorker(cfg, actor_id).run())
    except WorkerError as e:
        log.error("actor %d: %s", actor_id, e)
        return 1


__all__ = ["RolloutWorker", "WorkerError", "engine_url", "run_worker"]
