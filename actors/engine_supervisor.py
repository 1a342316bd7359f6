"""Process supervision of a worker's engine: start or reach it, notice it died or hung, restart or wait.

One supervisor per ``actors.engine_link.EngineLink`` (``link.supervisor``), by where the engine is:

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
engine does not hide it) declare the engine dead to its supervisor.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from actors.engine_address import EngineLinkError, as_version
from actors.link_state import LinkState
from actors.rollout_server.process import EngineStartError, RolloutServerProcess
from actors.weight_follower import WeightFollower
from common.sglang_client import SGLangError

log = logging.getLogger("vapo.actors.engine_link")


class EngineLost(EngineLinkError):
    """The engine cannot be kept: restarts exhausted, or a remote engine that did not come back."""


class SupervisedLink(LinkState, Protocol):
    """The link as its supervisor and health watch see it: its state, its weight follower and supervisor."""

    weights: WeightFollower
    supervisor: LocalSupervisor | RemoteSupervisor


class LocalSupervisor:
    """The worker's own rollout_server child: start, restart on exit, kill when declared dead."""

    def __init__(self, link: SupervisedLink) -> None:
        self.link = link
        self.process: RolloutServerProcess | None = None

    async def start(self) -> None:
        """Start (or restart) the child with the newest verified weights; caller holds ``link.control``."""
        link = self.link
        if self.process is None:
            self.process = RolloutServerProcess(link.cfg, link.actor_id,
                                                link.cfg.run_dir / "logs" / f"engine-{link.actor_id}.log")
        version, path = await asyncio.to_thread(link.weights.newest_verified)
        url = await self.process.start(path, version, api_key=link.api_key)
        await link.use_engine(url)
        link.engine_starts += 1
        link.set_version(version, path)

    async def run(self) -> None:
        """Runs for the worker's life: restart the child when it dies, with the newest verified weights."""
        link, e = self.link, self.link.cfg.engine
        assert self.process is not None
        while True:
            rc = await self.process.wait()
            if link.stopping():
                return
            log.warning("actor %d: engine (pid %s) exited with code %s; restarting", link.actor_id, self.process.pid, rc)
            async with link.control:
                link.gate.clear()
                while True:
                    if link.count_restart() > e.max_restarts:
                        raise EngineLost(f"engine died {link.counts.engine_restarts} times "
                                         f"(engine.max_restarts={e.max_restarts}); see {self.process.log_path}")
                    await link.watcher.query()
                    try:
                        await self.start()
                        break
                    except (EngineStartError, SGLangError) as ex:
                        log.warning("actor %d: engine restart failed: %s", link.actor_id, ex)
                link.gate.set()
            link.watcher.changed.set()

    def declare_dead(self, during_sync: bool) -> None:
        """Failed probes: kill the child (``run`` restarts it; a weight sync waiting on it fails at once)."""
        if self.process is not None and self.process.running():
            log.error("actor %d: engine (pid %s) failed %d %s in a row; killing it to restart it", self.link.actor_id,
                      self.process.pid, self.link.cfg.engine.health_failures,
                      "health probes during a weight sync" if during_sync else "/health probes")
            self.process.kill()

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop()


class RemoteSupervisor:
    """An engine someone else runs: wait for it, re-sync it when it comes back on older weights."""

    process = None  # nothing of ours to start, kill or stop

    def __init__(self, link: SupervisedLink, url: str) -> None:
        self.link, self.url = link, url

    async def start(self) -> None:
        """Reach the engine and load the newest verified weights; caller holds ``link.control``."""
        link = self.link
        client = await link.use_engine(self.url)
        await client.wait_healthy(link.cfg.engine.startup_timeout_s)
        link.engine_starts += 1
        served = as_version(await client.get_weight_version())
        link.set_version(served, link.model_path if served == link.version else link.cfg.model.path)
        await link.weights.sync_locked(idle=True)  # newest weights before the first request

    async def run(self) -> None:
        """Runs for the worker's life: on trouble, wait for an unreachable engine and re-sync a restarted one."""
        link = self.link
        while True:
            await link.trouble.wait()
            link.trouble.clear()
            async with link.control:
                checked = await self._recheck()
                link.gate.set()
            if checked:
                link.watcher.changed.set()

    async def _recheck(self) -> bool:
        """One trouble report, under ``link.control``: False after a blip (the engine answered its health
        check but not the version question; requests will fail again and bring us back here)."""
        link, e = self.link, self.link.cfg.engine
        client = link.client
        assert client is not None
        if not await client.health(e.health_timeout_s):
            link.gate.clear()
            log.warning("actor %d: engine %s unreachable; waiting for it", link.actor_id, client.base_url)
            try:
                await client.wait_healthy(e.startup_timeout_s * (e.max_restarts + 1))
            except SGLangError as ex:
                raise EngineLost(f"engine {client.base_url} did not come back: {ex}") from None
            # Unreachable and back: restarted, or at least not to be trusted to hold its weight-update
            # group (an engine that lost it answers "group not found" at the next push).
            link.engine_starts += 1
        try:
            served = as_version(await client.get_weight_version())
        except SGLangError:
            return False
        if served != link.version:
            link.gate.clear()
            link.count_restart()
            link.engine_starts += 1
            log.warning("actor %d: engine serves v%d, expected v%d (restarted?); re-syncing", link.actor_id,
                        served, link.version)
            link.set_version(served, link.cfg.model.path)
            await link.watcher.query()
            await link.weights.sync_locked(idle=True)
        return True

    def declare_dead(self, during_sync: bool) -> None:
        """Failed probes: the sync waiting on the engine gives up now, and ``run`` waits for it."""
        self.link.weights.cancel_call()
        self.link.trouble.set()

    async def stop(self) -> None:
        """Nothing to stop: the engine is someone else's."""


class HealthWatch:
    """Failed probes in a row declare the engine dead to the link's supervisor (module docstring)."""

    def __init__(self, link: SupervisedLink) -> None:
        self.link = link

    async def run(self) -> None:
        """One probe starts every ``engine.health_interval_s`` whatever the previous one is doing, each with a
        deadline of ``engine.health_timeout_s``, so ``engine.health_failures`` failures in a row are seen
        within ``health_failures x health_interval_s + health_timeout_s`` of the hang. No probe counts while
        the engine is restarted or the gate is closed for another reason."""
        link, e = self.link, self.link.cfg.engine
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
                    log.warning("actor %d: engine %s failed %s (%d/%d)", link.actor_id, link.url, endpoint,
                                failures, e.health_failures)
                    if failures >= e.health_failures:
                        failures = 0
                        for t in probes:  # they ask the engine being replaced
                            t.cancel()
                        probes = set()
                        link.supervisor.declare_dead(link.weights.syncing)
                        break
                if loop.time() >= next_at:
                    next_at += e.health_interval_s * max(1, int((loop.time() - next_at) / e.health_interval_s) + 1)
                    probes.add(loop.create_task(self._probe(loop.time())))
        finally:
            for t in probes:
                t.cancel()

    async def _probe(self, started: float) -> tuple[float, bool | None, str]:
        """One probe: (its start time, True ok | False failed | None does not count, endpoint)."""
        link, weights = self.link, self.link.weights
        client = link.client
        syncing, syncs = weights.syncing, weights.syncs
        endpoint = "/model_info" if syncing else "/health"
        if client is None or link.pushing_now or not (link.gate.is_set() or syncing):
            return started, None, endpoint
        ok = await client.probe(syncing, link.cfg.engine.health_timeout_s)
        # A /health that failed while this link paused or loaded the engine (SGLang's cannot run then), or
        # any probe of an engine restarted meanwhile, says nothing about the engine now.
        overlapped = not syncing and (weights.syncing or weights.syncs != syncs) or link.pushing_now
        if client is not link.client or not ok and (overlapped or not (link.gate.is_set() or weights.syncing)):
            return started, None, endpoint
        return started, ok, endpoint


__all__ = ["EngineLost", "HealthWatch", "LocalSupervisor", "RemoteSupervisor"]
