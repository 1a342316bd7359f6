"""Process supervision of a worker's engine: start or reach it, notice it died or hung, restart or wait.

One supervisor per ``actors.engine_link.EngineLink`` (``link.supervisor``), by where the engine is; it owns
the engine's process and counts its starts (``starts``: a push member announces itself again whenever it
moves) and restarts, and tells the weight follower (``actors.weight_follower``, the served version's one
owner) what a (re)started or reached engine serves:

- ``LocalSupervisor`` (``engine.kind = rollout_server``): the engine is the worker's own child
  (``actors.rollout_server.process``), started with the newest verified weights; it is restarted when it
  exits or is declared dead (then killed), at most ``engine.max_restarts`` times, then ``EngineLost``.
- ``RemoteSupervisor`` (``sglang``: ``engine.host:engine.base_port + i``, started by ``ops/launch.sh``
  through ``actors.sglang_launcher``; ``external``: ``engine.urls[i]``): waited for, then loaded with the
  newest weights. One that stops answering is waited for (``EngineLost`` when it does not come back within
  ``engine.startup_timeout_s x (engine.max_restarts + 1)``); one that comes back on older weights (it was
  restarted) is re-synced. Either counts in ``engine_restarts``.

``HealthWatch`` is liveness beyond process exit, for both: ``engine.health_failures`` failed probes in a row
(one started every ``engine.health_interval_s``, each with a deadline of ``engine.health_timeout_s``;
``Engine.probe(updating=True)`` while the link updates the engine's weights, so a sync waiting on a hung
engine does not hide it) declare the engine dead to its supervisor. It owns the probe hold (``pushing``): a distributed push pauses
the engine, and a paused SGLang fails ``/health``.

Not a CLI; used by ``actors.engine_link``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from actors.engine_address import EngineLinkError, as_version
from actors.link_state import LinkState
from actors.rollout_server.process import EngineStartError, RolloutServerProcess
from actors.weight_follower import WeightFollower
from actors.weight_watcher import WeightWatcher
from common.config import Config
from common.sglang_client import SGLangError

log = logging.getLogger("vapo.actors.engine_link")


class EngineLost(EngineLinkError):
    """The engine cannot be kept: restarts exhausted, or a remote engine that did not come back."""


class Supervisor:
    """What both supervisors hold and count: the shared link state, the weight follower they tell what
    the engine serves, the watcher they ask for the newest version, the engine's starts and restarts.

    ``metric(name, **labels)``: this actor's series of ``vapo_actor_<name>``.
    """

    process: RolloutServerProcess | None = None

    def __init__(self, cfg: Config, actor_id: int, state: LinkState, weights: WeightFollower,
                 watcher: WeightWatcher, metric: Callable[..., Any]) -> None:
        self.cfg, self.actor_id, self.state, self.weights, self.watcher = cfg, actor_id, state, weights, watcher
        self._metric = metric
        self._starts = 0  # engines seen to start: every (re)start of ours, every remote restart noticed
        self._restarts = 0

    @property
    def starts(self) -> int:
        """Engines this link has seen start: +1 on every (re)start of ours and every restart of a remote
        engine it notices. A distributed-push member announces itself again whenever this moves: a
        restarted engine is in no weight-update group, whatever client object reaches it."""
        return self._starts

    @property
    def restarts(self) -> int:
        return self._restarts

    def count_start(self) -> None:
        """An engine (re)started or came back unreachable-then-reachable: count it."""
        self._starts += 1

    def _count_restart(self) -> int:
        self._restarts += 1
        self._metric("engine_restarts").inc()
        return self._restarts


class LocalSupervisor(Supervisor):
    """The worker's own rollout_server child: start, restart on exit, kill when declared dead.

    ``stopping()``: the worker is shutting down (an exit is then no failure).
    """

    def __init__(self, cfg: Config, actor_id: int, state: LinkState, weights: WeightFollower,
                 watcher: WeightWatcher, metric: Callable[..., Any], stopping: Callable[[], bool]) -> None:
        super().__init__(cfg, actor_id, state, weights, watcher, metric)
        self._stopping = stopping

    async def start(self) -> None:
        """Start (or restart) the child with the newest verified weights; caller holds ``state.control``."""
        if self.process is None:
            self.process = RolloutServerProcess(self.cfg, self.actor_id,
                                                self.cfg.run_dir / "logs" / f"engine-{self.actor_id}.log")
        version, path = await asyncio.to_thread(self.weights.newest_verified)
        url = await self.process.start(path, version, api_key=self.state.api_key)
        await self.state.use_engine(url)
        self.count_start()
        self.weights.started(version, path)

    async def run(self) -> None:
        """Runs for the worker's life: restart the child when it dies, with the newest verified weights."""
        state, e = self.state, self.cfg.engine
        assert self.process is not None
        while True:
            rc = await self.process.wait()
            if self._stopping():
                return
            log.warning("actor %d: engine (pid %s) exited with code %s; restarting", self.actor_id, self.process.pid, rc)
            async with state.control:
                state.gate.clear()
                while True:
                    if self._count_restart() > e.max_restarts:
                        raise EngineLost(f"engine died {self._restarts} times "
                                         f"(engine.max_restarts={e.max_restarts}); see {self.process.log_path}")
                    await self.watcher.query()
                    try:
                        await self.start()
                        break
                    except (EngineStartError, SGLangError) as ex:
                        log.warning("actor %d: engine restart failed: %s", self.actor_id, ex)
                state.gate.set()
            self.watcher.nudge()

    def declare_dead(self, during_sync: bool) -> None:
        """Failed probes: kill the child (``run`` restarts it; a weight sync waiting on it fails at once)."""
        if self.process is not None and self.process.running():
            log.error("actor %d: engine (pid %s) failed %d %s in a row; killing it to restart it", self.actor_id,
                      self.process.pid, self.cfg.engine.health_failures,
                      "health probes during a weight sync" if during_sync else "/health probes")
            self.process.kill()

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop()


class RemoteSupervisor(Supervisor):
    """An engine someone else runs (at ``url``): wait for it, re-sync it when it comes back on older weights."""

    def __init__(self, cfg: Config, actor_id: int, state: LinkState, weights: WeightFollower,
                 watcher: WeightWatcher, metric: Callable[..., Any], url: str) -> None:
        super().__init__(cfg, actor_id, state, weights, watcher, metric)
        self.url = url

    async def start(self) -> None:
        """Reach the engine and load the newest verified weights; caller holds ``state.control``."""
        client = await self.state.use_engine(self.url)
        await client.wait_healthy(self.cfg.engine.startup_timeout_s)
        self.count_start()
        self.weights.reached(as_version(await client.get_weight_version()))
        await self.weights.sync_locked(idle=True)  # newest weights before the first request

    async def run(self) -> None:
        """Runs for the worker's life: on trouble, wait for an unreachable engine and re-sync a restarted one."""
        state = self.state
        while True:
            await state.trouble.wait()
            state.trouble.clear()
            async with state.control:
                checked = await self._recheck()
                state.gate.set()
            if checked:
                self.watcher.nudge()

    async def _recheck(self) -> bool:
        """One trouble report, under ``state.control``: False after a blip (the engine answered its health
        check but not the version question; requests will fail again and bring us back here)."""
        state, e = self.state, self.cfg.engine
        client = state.client
        assert client is not None
        if not await client.health(e.health_timeout_s):
            state.gate.clear()
            log.warning("actor %d: engine %s unreachable; waiting for it", self.actor_id, client.base_url)
            try:
                await client.wait_healthy(e.startup_timeout_s * (e.max_restarts + 1))
            except SGLangError as ex:
                raise EngineLost(f"engine {client.base_url} did not come back: {ex}") from None
            # Unreachable and back: restarted, or at least not to be trusted to hold its weight-update
            # group (an engine that lost it answers "group not found" at the next push).
            self.count_start()
        try:
            served = as_version(await client.get_weight_version())
        except SGLangError:
            return False
        expected = self.weights.version
        if served != expected:
            state.gate.clear()
            self._count_restart()
            self.count_start()
            log.warning("actor %d: engine serves v%d, expected v%d (restarted?); re-syncing", self.actor_id,
                        served, expected)
            self.weights.reached(served)
            await self.watcher.query()
            await self.weights.sync_locked(idle=True)
        return True

    def declare_dead(self, during_sync: bool) -> None:
        """Failed probes: the sync waiting on the engine gives up now, and ``run`` waits for it."""
        self.weights.cancel_call()
        self.state.report_trouble()

    async def stop(self) -> None:
        """Nothing to stop: the engine is someone else's."""


class HealthWatch:
    """Failed probes in a row declare the engine dead to the link's supervisor (module docstring)."""

    def __init__(self, cfg: Config, actor_id: int, state: LinkState, weights: WeightFollower,
                 supervisor: LocalSupervisor | RemoteSupervisor) -> None:
        self.cfg, self.actor_id, self.state, self.weights, self.supervisor = cfg, actor_id, state, weights, supervisor
        self._held = 0  # distributed pushes in progress (``pushing``): probes neither run nor count

    @property
    def held(self) -> bool:
        """A distributed push is in progress: probes neither run nor count."""
        return self._held > 0

    @contextlib.contextmanager
    def pushing(self) -> Iterator[None]:
        """Marks a distributed push into the engine (``actors.weight_push_client``): SGLang's ``/health``
        runs a generation, which cannot run while the push pauses the engine, so no probe runs or counts
        meanwhile (a push that hangs fails on its own deadline, and its recovery reports trouble)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1

    async def run(self) -> None:
        """One probe starts every ``engine.health_interval_s`` whatever the previous one is doing, each with a
        deadline of ``engine.health_timeout_s``, so ``engine.health_failures`` failures in a row are seen
        within ``health_failures x health_interval_s + health_timeout_s`` of the hang. No probe counts while
        the engine is restarted or the gate is closed for another reason."""
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
                    log.warning("actor %d: engine %s failed %s (%d/%d)", self.actor_id, self.state.url, endpoint,
                                failures, e.health_failures)
                    if failures >= e.health_failures:
                        failures = 0
                        for t in probes:  # they ask the engine being replaced
                            t.cancel()
                        probes = set()
                        self.supervisor.declare_dead(self.weights.syncing)
                        break
                if loop.time() >= next_at:
                    next_at += e.health_interval_s * max(1, int((loop.time() - next_at) / e.health_interval_s) + 1)
                    probes.add(loop.create_task(self._probe(loop.time())))
        finally:
            for t in probes:
                t.cancel()

    async def _probe(self, started: float) -> tuple[float, bool | None, str]:
        """One probe: (its start time, True ok | False failed | None does not count, endpoint)."""
        state, weights = self.state, self.weights
        client = state.client
        syncing, syncs = weights.syncing, weights.syncs
        endpoint = "/model_info" if syncing else "/health"
        if client is None or self.held or not (state.gate.is_set() or syncing):
            return started, None, endpoint
        ok = await client.probe(syncing, self.cfg.engine.health_timeout_s)
        # A /health that failed while this link paused or loaded the engine (SGLang's cannot run then), or
        # any probe of an engine restarted meanwhile, says nothing about the engine now.
        overlapped = not syncing and (weights.syncing or weights.syncs != syncs) or self.held
        if client is not state.client or not ok and (overlapped or not (state.gate.is_set() or weights.syncing)):
            return started, None, endpoint
        return started, ok, endpoint


__all__ = ["EngineLost", "HealthWatch", "LocalSupervisor", "RemoteSupervisor", "Supervisor"]
