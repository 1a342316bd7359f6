"""A worker's link to its engine: start or reach it, keep it alive, keep its weights current.

``EngineLink`` is the one owner of everything between a rollout worker and its inference engine
(``engine.kind``): the ``SGLangClient``, the ``actors.rollout_server`` child process for ``rollout_server``
(``actors.rollout_server.process``), its supervision, and weight sync. The worker only reads ``gate``
(open while the engine takes requests), ``client``, ``version`` and ``counts``, waits with
``wait_changed``, and calls ``report_trouble`` when a request failed; the link tells it through
``LinkOwner`` when the served version moved and asks it whether it is stopping. An engine that cannot be
kept ends ``supervise`` with ``EngineLost``.

- **Start**: ``rollout_server``: a child server started with the newest verified weights; ``sglang``: the
  engine at ``engine.host:engine.base_port + i`` (started by ``ops/launch.sh`` through
  ``actors.sglang_launcher``); ``external``: ``engine.urls[i]``. Those two are waited for, then loaded with
  the newest weights.
- **Supervision**: our server is restarted when it exits or fails ``engine.health_failures`` ``/health``
  probes in a row (one started every ``engine.health_interval_s``, each with a deadline of
  ``engine.health_timeout_s``; ``/model_info`` while the link updates the engine's weights, so a sync
  waiting on a hung engine does not hide it), at most ``engine.max_restarts`` times, then the worker fails.
  Every request to the engine has a deadline (``_client``), and carries the engine's admin API key
  (``engine_api_key``). A remote engine that stops answering is
  waited for; one that comes back on older weights (it was restarted) is re-synced. Either counts in
  ``engine_restarts``.
- **Weight sync** (``actors.weight_sync``): a newer ``WeightUpdate`` is verified (checksum, and with
  ``actors.verify_tensors`` every tensor of ``model.path`` with its shape, all finite), then loaded with
  ``/update_weights_from_disk``; ``wait`` lets requests in flight finish on the old weights, ``abort``
  pauses generation (``mode=abort``) around the update. A refused update is counted in
  ``vapo_actor_weight_sync_failures{reason}`` and the old weights keep serving. An update answered with an
  error whose version the engine generates with anyway (SGLang: 400 after a completed load whose cache
  flush was refused) is accepted.

Deviations: none from SGLang's API; the link uses only what ``common.sglang_client`` speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from actors.engine_address import EngineLinkError, as_version, engine_api_key, engine_url
from actors.rollout_server.process import EngineStartError, RolloutServerProcess
from actors.weight_sync import WeightWatcher, checkpoint_tensors, verify_tensors, verify_update
from common.config import Config
from common.metrics import Metrics
from common.protocol import WeightUpdate
from common.sglang_client import SGLangClient, SGLangError

log = logging.getLogger("vapo.actors.engine_link")
Result = TypeVar("Result")


class EngineLost(EngineLinkError):
    """The engine cannot be kept: restarts exhausted, or a remote engine that did not come back."""


class LinkOwner(Protocol):
    """What the link needs from the worker that owns it."""

    def engine_changed(self) -> None:
        """The served version moved, or a version was refused (the worker records its state)."""

    def stopping(self) -> bool:
        """The worker is shutting down: an engine exit is then no failure."""


@dataclasses.dataclass
class LinkCounts:
    """What the link did, for the worker's ``ACTOR DONE`` line."""

    engine_restarts: int = 0
    weight_syncs: int = 0  # from disk and by distributed push
    weight_sync_failures: int = 0
    weight_pushes: int = 0
    push_pause_ms: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name; the push counters only once a push arrived (as they always appeared)."""
        out = dataclasses.asdict(self)
        if not self.weight_pushes:
            del out["weight_pushes"], out["push_pause_ms"]
        return out


class EngineLink:
    """One worker's engine: connection, supervision, weight sync (see the module docstring).

    ``metrics``: the worker's (the link's series carry ``actor=<actor_id>`` like the worker's own).
    """

    def __init__(self, cfg: Config, actor_id: int, watcher: WeightWatcher, owner: LinkOwner, metrics: Metrics, *,
                 generate_timeout_s: float) -> None:
        self.cfg, self.actor_id, self.watcher = cfg, actor_id, watcher
        self.actors_cfg = cfg.actors
        self.generate_timeout_s = generate_timeout_s
        self.counts = LinkCounts()
        self.metrics = metrics
        self._owner = owner
        self._changed = asyncio.Event()  # replaced (and the old one set) on every change of the served version
        self.version = 0
        self.model_path = cfg.model.path
        self.refused: dict[int, str] = {}  # version -> reason
        self.sync_latencies: list[float] = []
        self.client: SGLangClient | None = None
        self.process: RolloutServerProcess | None = None
        self._expected: dict[str, tuple[int, ...]] | None = None  # base model's tensor shapes, read once
        self.gate = asyncio.Event()  # set while the engine accepts requests
        self.control = asyncio.Lock()  # weight syncs and engine restarts, one at a time
        self.trouble = asyncio.Event()  # a request failed: the engine may be gone
        self._syncing = False  # a weight sync talks to the engine (health probes use /model_info)
        self._syncs = 0  # weight syncs started so far
        self._sync_call: asyncio.Future[Any] | None = None  # the sync's request in flight
        # Engines this link has seen start: +1 on every (re)start of ours and every restart of a remote engine
        # it notices. A distributed-push member announces itself again whenever this moves: a restarted
        # engine is in no weight-update group, whatever client object reaches it.
        self.engine_starts = 0
        self._pushing = 0  # distributed pushes in progress (``pushing``): health probes neither run nor count
        # The engine's API key: ours is fresh per worker (passed to the child in its environment, never
        # on its command line), a remote engine's is read from engine.admin_api_key_file.
        self.api_key = engine_api_key(cfg)

    @property
    def owned(self) -> bool:
        """True when the engine is our own child process (its exit is noticed without a request failing)."""
        return self.process is not None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def url(self) -> str | None:
        return self.client.base_url if self.client is not None else None

    def metric(self, name: str, **labels: str) -> Any:
        """This actor's series of the metric ``vapo_actor_<name>``."""
        return getattr(self.metrics, name).labels(actor=str(self.actor_id), **labels)

    def report_trouble(self) -> None:
        """A request failed or came back on older weights: check the engine."""
        self.trouble.set()

    async def wait_changed(self, timeout_s: float) -> None:
        """Until the served version moves or a version is refused, or ``timeout_s`` passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    def _notify_change(self) -> None:
        self._owner.engine_changed()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _set_version(self, version: int, path: str) -> None:
        self.version, self.model_path = version, path
        self.metric("weight_version").set(version)
        self._notify_change()

    def pushed(self, version: int, pause_s: float) -> None:
        """A distributed push (``actors.weight_push_client``) moved the engine to ``version``; caller holds
        ``control``."""
        self._set_version(version, self.model_path)
        self.counts.weight_syncs += 1
        self.counts.weight_pushes += 1
        self.counts.push_pause_ms += round(pause_s * 1000)

    @contextlib.contextmanager
    def pushing(self) -> Any:
        """Marks a distributed push into the engine (``actors.weight_push_client``): SGLang's ``/health``
        runs a generation, which cannot run while the push pauses the engine, so no probe runs or counts
        meanwhile (a push that hangs fails on its own deadline, and its recovery reports trouble)."""
        self._pushing += 1
        try:
            yield
        finally:
            self._pushing -= 1

    def _count_restart(self) -> int:
        self.counts.engine_restarts += 1
        self.metric("engine_restarts").inc()
        return self.counts.engine_restarts

    async def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
        if self.process is not None:
            await self.process.stop()

    # ------------------------------------------------------------------ engine

    def _verify(self, upd: WeightUpdate) -> tuple[str, str] | None:
        """Checksum, then (``actors.verify_tensors``) names, shapes and finiteness; blocking (a thread)."""
        bad = verify_update(upd)
        if bad is None and self.actors_cfg.verify_tensors:
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

    async def connect(self) -> None:
        """Start (rollout_server) or reach (sglang/external) the engine with the newest verified weights;
        the gate stays closed until the caller opens it."""
        async with self.control:
            await self._connect()

    async def _connect(self) -> None:
        """``connect``; caller holds ``control``."""
        url = engine_url(self.cfg, self.actor_id)
        if self.client is not None:
            await self.client.close()
        if url is None:
            if self.process is None:
                self.process = RolloutServerProcess(self.cfg, self.actor_id,
                                                   self.cfg.run_dir / "logs" / f"engine-{self.actor_id}.log")
            version, path = await asyncio.to_thread(self._newest_verified)
            url = await self.process.start(path, version, api_key=self.api_key)
            self.client = self._client(url)
            self.engine_starts += 1
            self._set_version(version, path)
            return
        self.client = self._client(url)
        await self.client.wait_healthy(self.cfg.engine.startup_timeout_s)
        self.engine_starts += 1
        served = as_version(await self.client.get_weight_version())
        self._set_version(served, self.model_path if served == self.version else self.cfg.model.path)
        await self._sync_locked(idle=True)  # newest weights before the first request

    def _client(self, url: str) -> SGLangClient:
        # Control requests (pause, continue, model info) get a probe's deadline.
        return SGLangClient(url, timeout_s=self.generate_timeout_s, control_timeout_s=self.cfg.engine.health_timeout_s,
                            api_key=self.api_key or None)

    async def supervise(self) -> None:
        """Runs for the worker's life: restart our engine when it dies, or wait for and re-sync a remote one."""
        if self.process is not None:
            await self._supervise_process()
        else:
            await self._supervise_remote()

    async def _supervise_process(self) -> None:
        """Restart our rollout_server when it dies, with the newest verified weights."""
        assert self.process is not None
        while True:
            rc = await self.process.wait()
            if self._owner.stopping():
                return
            log.warning("actor %d: engine (pid %s) exited with code %s; restarting", self.actor_id, self.process.pid, rc)
            async with self.control:
                self.gate.clear()
                while True:
                    if self._count_restart() > self.cfg.engine.max_restarts:
                        raise EngineLost(f"engine died {self.counts.engine_restarts} times "
                                         f"(engine.max_restarts={self.cfg.engine.max_restarts}); see {self.process.log_path}")
                    await self.watcher.query()
                    try:
                        await self._connect()
                        break
                    except (EngineStartError, SGLangError) as e:
                        log.warning("actor %d: engine restart failed: %s", self.actor_id, e)
                self.gate.set()
            self.watcher.changed.set()

    async def watch_health(self) -> None:
        """Liveness beyond process exit: an engine whose scheduler hung (or a remote one that stopped
        answering) fails its probes. One probe starts every ``engine.health_interval_s`` whatever the
        previous one is doing, each with a deadline of ``engine.health_timeout_s``, so
        ``engine.health_failures`` failures in a row are seen within ``health_failures x health_interval_s
        + health_timeout_s`` of the hang. Then our own rollout_server is killed (its supervisor restarts it;
        a weight sync waiting on it fails at once), and a remote engine is waited for and re-synced.
        While this link updates the engine the probe is ``/model_info`` instead of ``/health``: SGLang's
        /health runs a generation, which cannot run while paused or loading, but its HTTP front end still
        answers. No probe counts while the engine is restarted or the gate is closed for another reason."""
        e = self.cfg.engine
        loop = asyncio.get_running_loop()
        failures = 0
        probes: set[asyncio.Task[tuple[float, bool | None, str]]] = set()
        next_at = loop.time() + e.health_interval_s
        try:
            while True:
                wait_s = max(0.0, next_at - loop.time())
                if probes:
                    done, probes = await asyncio.wait(probes, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(wait_s)
                    done = set()
                results = sorted(t.result() for t in done if not t.cancelled())
                for _, verdict, endpoint in results:  # in the order the probes started
                    if verdict is None or verdict:
                        failures = 0
                        continue
                    failures += 1
                    log.warning("actor %d: engine %s failed %s (%d/%d)", self.actor_id, self.url, endpoint,
                                failures, e.health_failures)
                    if failures >= e.health_failures:
                        failures = 0
                        for t in probes:  # they ask the engine being replaced
                            t.cancel()
                        probes = set()
                        self._declare_dead()
                        break
                if loop.time() >= next_at:
                    next_at += e.health_interval_s * max(1, int((loop.time() - next_at) / e.health_interval_s) + 1)
                    probes.add(loop.create_task(self._probe(loop.time())))
        finally:
            for t in probes:
                t.cancel()

    async def _probe(self, started: float) -> tuple[float, bool | None, str]:
        """One probe: (its start time, True ok | False failed | None does not count, endpoint)."""
        client = self.client
        syncing, syncs = self._syncing, self._syncs
        endpoint = "/model_info" if syncing else "/health"
        if client is None or self._pushing or not (self.gate.is_set() or syncing):
            return started, None, endpoint
        if syncing:
            try:
                await client.model_info(self.cfg.engine.health_timeout_s)
                ok = True
            except SGLangError:
                ok = False
        else:
            ok = await client.health(self.cfg.engine.health_timeout_s)
        # A /health that failed while this link paused or loaded the engine (SGLang's cannot run then), or
        # any probe of an engine restarted meanwhile, says nothing about the engine now.
        overlapped = not syncing and (self._syncing or self._syncs != syncs) or self._pushing > 0
        if client is not self.client or not ok and (overlapped or not (self.gate.is_set() or self._syncing)):
            return started, None, endpoint
        return started, ok, endpoint

    def _declare_dead(self) -> None:
        e = self.cfg.engine
        if self.process is not None and self.process.running():
            log.error("actor %d: engine (pid %s) failed %d %s in a row; killing it to restart it", self.actor_id,
                      self.process.pid, e.health_failures,
                      "health probes during a weight sync" if self._syncing else "/health probes")
            self.process.kill()
        elif self.process is None:
            if self._sync_call is not None:  # a remote engine: the sync waiting on it gives up now
                self._sync_call.cancel()
            self.trouble.set()

    async def _supervise_remote(self) -> None:
        """An engine we do not own stopped answering or went back to older weights (it was restarted):
        wait for it, then re-sync the newest weights before generating again."""
        assert self.client is not None
        while True:
            await self.trouble.wait()
            self.trouble.clear()
            async with self.control:
                if not await self.client.health(self.cfg.engine.health_timeout_s):
                    self.gate.clear()
                    log.warning("actor %d: engine %s unreachable; waiting for it", self.actor_id, self.client.base_url)
                    try:
                        await self.client.wait_healthy(self.cfg.engine.startup_timeout_s * (self.cfg.engine.max_restarts + 1))
                    except SGLangError as e:
                        raise EngineLost(f"engine {self.client.base_url} did not come back: {e}") from None
                    # Unreachable and back: restarted, or at least not to be trusted to hold its weight-update
                    # group (an engine that lost it answers "group not found" at the next push).
                    self.engine_starts += 1
                try:
                    served = as_version(await self.client.get_weight_version())
                except SGLangError:
                    self.gate.set()
                    continue  # a blip: requests will fail again and bring us back here
                if served != self.version:
                    self.gate.clear()
                    self._count_restart()
                    self.engine_starts += 1
                    log.warning("actor %d: engine serves v%d, expected v%d (restarted?); re-syncing", self.actor_id,
                                served, self.version)
                    self._set_version(served, self.cfg.model.path)
                    await self.watcher.query()
                    await self._sync_locked(idle=True)
                self.gate.set()
            self.watcher.changed.set()

    # ------------------------------------------------------------------ weight sync

    def _refuse(self, upd: WeightUpdate, reason: str, message: str) -> None:
        if upd.version in self.refused:
            return
        self.refused[upd.version] = reason
        self.counts.weight_sync_failures += 1
        self.metric("weight_sync_failures", reason=reason).inc()
        log.error("actor %d: refusing weights v%d (%s): %s; still serving v%d", self.actor_id, upd.version, reason,
                  message, self.version)
        self._notify_change()  # prompts held for this version go ahead on the current weights

    async def sync_loop(self) -> None:
        """Runs for the worker's life: load each newer announced version once the engine is up."""
        while True:
            await self.watcher.changed.wait()
            self.watcher.changed.clear()
            await self._sync_to_latest()

    async def _sync_to_latest(self) -> None:
        async with self.control:
            if self.gate.is_set():  # else the engine is down and its restart loads the newest weights
                await self._sync_locked(idle=False)

    async def _sync_locked(self, idle: bool) -> bool:
        """Load the newest announced weights if they verify; caller holds ``control``. True if loaded.

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
        # The update's deadline: the engine's own read deadline, plus one probe's worth for the rest.
        load_s = self.cfg.engine.weight_load_timeout_s + self.cfg.engine.health_timeout_s
        self._syncing = True
        self._syncs += 1
        try:
            if self.actors_cfg.weight_sync == "abort" and not idle:
                self.gate.clear()
                try:
                    await self._call(client.pause_generation("abort"))
                    await self._call(client.update_weights_from_disk(upd.path, weight_version=upd.version,
                                                                     timeout_s=load_s))
                finally:
                    with contextlib.suppress(SGLangError):
                        await self._call(client.continue_generation())
                    self.gate.set()
            else:
                await self._call(client.update_weights_from_disk(upd.path, weight_version=upd.version, timeout_s=load_s))
        except SGLangError as e:
            if e.status is None:  # engine unreachable: the supervisor reloads the newest weights
                log.warning("actor %d: weight update v%d failed, engine unreachable: %s", self.actor_id, upd.version, e)
                self.trouble.set()
                return False
            if not await self._served_anyway(client, upd, e):
                self._refuse(upd, "load_error", e.message)
                return False
        finally:
            self._syncing = False
        latency = max(0.0, time.time() - upd.created_at)
        self._set_version(upd.version, upd.path)
        self.counts.weight_syncs += 1
        self.sync_latencies.append(latency)
        self.metric("weight_sync_seconds").observe(latency)
        log.info("actor %d: serving weights v%d (%.3f s after publish)", self.actor_id, upd.version, latency)
        return True

    async def _call(self, coro: Coroutine[Any, Any, Result]) -> Result:
        """Await one of the sync's requests as a task the health watcher can cancel when it finds the
        engine dead (a cancelled request reads as an unreachable engine)."""
        task = asyncio.ensure_future(coro)
        self._sync_call = task
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise SGLangError("engine", None, "declared dead by its health probes") from None
            task.cancel()
            raise
        finally:
            self._sync_call = None

    async def _served_anyway(self, client: SGLangClient, upd: WeightUpdate, e: SGLangError) -> bool:
        """After an update answered with an error: True when the engine generates with ``upd`` anyway.
        SGLang answers 400 when the cache flush after a completed load is refused (requests still queued),
        with the new weights live: refusing that version would misstamp every sample from then on."""
        try:
            served = await client.served_weight_version(timeout_s=self.generate_timeout_s)
        except SGLangError as e2:
            log.warning("actor %d: cannot ask the engine which weights it serves after a failed update: %s",
                        self.actor_id, e2)
            return False
        if as_version(served) != upd.version:
            return False
        log.warning("actor %d: engine answered %s to the update to v%d but generates with it; accepting v%d",
                    self.actor_id, e, upd.version, upd.version)
        return True


__all__ = ["EngineLink", "EngineLost", "LinkCounts", "LinkOwner"]
