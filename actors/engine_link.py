"""A worker's link to its engine: start or reach it, keep it alive, keep its weights current.

``EngineLink`` builds the three parts of a worker's hold on its inference engine (``engine.kind``) and
passes each what it needs; each part owns its own state and is its only writer:

- ``weights`` (``actors.weight_follower.WeightFollower``) owns the served version: the version and path the
  engine serves, the refused versions, the sync in flight. Each newer verified ``WeightUpdate`` is loaded
  from disk (``sync_loop``); a refused one is counted in ``vapo_actor_weight_sync_failures{reason}`` and the
  old weights keep serving; distributed pushes are recorded through ``pushed``.
- ``supervisor`` (``actors.engine_supervisor``) owns the engine's process and its start and restart counts:
  ``LocalSupervisor`` for ``rollout_server`` (a child server started with the newest verified weights,
  restarted when it exits or is declared dead, at most ``engine.max_restarts`` times), ``RemoteSupervisor``
  for ``sglang`` (``engine.host:engine.base_port + i``, started by ``ops/launch.sh`` through
  ``actors.sglang_launcher``) and ``external`` (``engine.urls[i]``): waited for, loaded with the newest
  weights, re-synced when it comes back on older ones. An engine that cannot be kept ends ``supervise``
  with ``EngineLost``.
- ``health`` (``engine_supervisor.HealthWatch``) owns the probes and their hold during a push:
  ``engine.health_failures`` failed probes in a row declare the engine dead (``watch_health``).

What they share, and nothing else, is ``state`` (``actors.link_state.LinkState``): the engine's client, the
gate (open while the engine takes requests), the control lock (weight syncs, pushes and restarts, one at a
time) and the trouble flag. The worker reads ``gate``, ``client``, ``version`` and ``counts``, waits with
``wait_changed``, and calls ``report_trouble`` when a request failed; the link tells it through
``LinkOwner`` when the served version moved and asks it whether it is stopping. Every request to the
engine has a deadline and carries the engine's admin API key (``engine_api_key``).

Deviations: none from SGLang's API; the link uses only what ``actors.engine.Engine`` speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

from actors.engine import Engine
from actors.engine_address import engine_api_key, engine_url
from actors.engine_supervisor import EngineLost, HealthWatch, LocalSupervisor, RemoteSupervisor
from actors.link_state import LinkState
from actors.report import LinkCounts
from actors.rollout_server.process import RolloutServerProcess
from actors.weight_follower import WeightFollower
from actors.weight_watcher import WeightWatcher
from common.config import Config
from common.metrics import Metrics


class LinkOwner(Protocol):
    """What the link needs from the worker that owns it."""

    def engine_changed(self) -> None:
        """The served version moved, or a version was refused (the worker records its state)."""

    def stopping(self) -> bool:
        """The worker is shutting down: an engine exit is then no failure."""


class EngineLink:
    """One worker's engine: its weight follower, supervisor and health watch over their shared state (see
    the module docstring). Everything it shows the worker is read from the part that owns it.

    ``metrics``: the worker's (the link's series carry ``actor=<actor_id>`` like the worker's own).
    """

    def __init__(self, cfg: Config, actor_id: int, watcher: WeightWatcher, owner: LinkOwner, metrics: Metrics, *,
                 generate_timeout_s: float) -> None:
        self.cfg, self.actor_id, self.watcher, self.metrics = cfg, actor_id, watcher, metrics
        # The engine's API key: ours is fresh per worker (passed to the child in its environment, never
        # on its command line), a remote engine's is read from engine.admin_api_key_file.
        self.state = LinkState(cfg, engine_api_key(cfg), generate_timeout_s)
        self.weights = WeightFollower(cfg, actor_id, self.state, watcher, self.metric, owner.engine_changed)
        url = engine_url(cfg, actor_id)
        self.supervisor: LocalSupervisor | RemoteSupervisor = (
            LocalSupervisor(cfg, actor_id, self.state, self.weights, watcher, self.metric, owner.stopping)
            if url is None else RemoteSupervisor(cfg, actor_id, self.state, self.weights, watcher, self.metric, url))
        self.health = HealthWatch(cfg, actor_id, self.state, self.weights, self.supervisor)

    # ------------------------------------------------------------------ what the worker reads

    @property
    def client(self) -> Engine | None:
        return self.state.client

    @property
    def gate(self) -> asyncio.Event:
        """Set while the engine accepts requests."""
        return self.state.gate

    @property
    def control(self) -> asyncio.Lock:
        """Weight syncs, pushes and engine restarts, one at a time."""
        return self.state.control

    @property
    def trouble(self) -> asyncio.Event:
        return self.state.trouble

    @property
    def url(self) -> str | None:
        return self.state.url

    @property
    def version(self) -> int:
        """The weight version the engine serves (``WeightFollower`` owns it)."""
        return self.weights.version

    @property
    def model_path(self) -> str:
        return self.weights.model_path

    @property
    def refused(self) -> dict[int, str]:
        """Refused versions -> reason."""
        return self.weights.refused

    @property
    def sync_latencies(self) -> list[float]:
        """Seconds from publish to served, per version loaded from disk."""
        return self.weights.sync_latencies

    @property
    def engine_starts(self) -> int:
        """Engines this link has seen start (``Supervisor.starts``)."""
        return self.supervisor.starts

    @property
    def counts(self) -> LinkCounts:
        """What the link did so far, gathered from the parts that count it (a snapshot)."""
        w = self.weights
        return LinkCounts(engine_restarts=self.supervisor.restarts, weight_loads=w.loads,
                          weight_sync_failures=w.failures, weight_pushes=w.pushes, push_pause_ms=w.push_pause_ms)

    @property
    def process(self) -> RolloutServerProcess | None:
        """Our own engine process (None for an engine someone else runs, or before the first start)."""
        return self.supervisor.process

    @property
    def owned(self) -> bool:
        """True when the engine is our own child process (its exit is noticed without a request failing)."""
        return self.process is not None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def pushing_now(self) -> bool:
        """A distributed push is in progress (health probes neither run nor count)."""
        return self.health.held

    def metric(self, name: str, **labels: str) -> Any:
        """This actor's series of the metric ``vapo_actor_<name>``."""
        return getattr(self.metrics, name).labels(actor=str(self.actor_id), **labels)

    def report_trouble(self) -> None:
        """A request failed or came back on older weights: check the engine."""
        self.state.report_trouble()

    async def wait_changed(self, timeout_s: float) -> None:
        """Until the served version moves or a version is refused, or ``timeout_s`` passed."""
        await self.weights.wait_changed(timeout_s)

    async def use_engine(self, url: str) -> Engine:
        """Talk to the engine at ``url`` from now on (what a supervisor's (re)start does)."""
        return await self.state.use_engine(url)

    @contextlib.contextmanager
    def pushing(self) -> Iterator[None]:
        """Marks a distributed push into the engine: health probes are held off (``HealthWatch.pushing``)."""
        with self.health.pushing():
            yield

    # ------------------------------------------------------------------ what the worker runs

    async def connect(self) -> None:
        """Start (rollout_server) or reach (sglang/external) the engine with the newest verified weights;
        the gate stays closed until the caller opens it."""
        async with self.state.control:
            await self.supervisor.start()

    async def supervise(self) -> None:
        """Runs for the worker's life: restart our engine when it dies, or wait for and re-sync a remote one."""
        await self.supervisor.run()

    async def watch_health(self) -> None:
        """Runs for the worker's life: failed probes in a row declare the engine dead."""
        await self.health.run()

    async def sync_loop(self) -> None:
        """Runs for the worker's life: load each newer announced version once the engine is up."""
        await self.weights.run()

    async def sync_locked(self, idle: bool) -> bool:
        """Load the newest announced weights if they verify; caller holds ``control``. True if loaded."""
        return await self.weights.sync_locked(idle)

    def pushed(self, version: int, pause_s: float) -> None:
        """A distributed push moved the engine to ``version``; caller holds ``control``."""
        self.weights.pushed(version, pause_s)

    async def await_version(self, needed: int, wait_s: float) -> float:
        """Hold a granted prompt until the engine serves ``needed`` (``WeightFollower.await_version``)."""
        return await self.weights.await_version(needed, wait_s)

    async def close(self) -> None:
        await self.state.close()
        await self.supervisor.stop()


__all__ = ["EngineLink", "EngineLost", "LinkCounts", "LinkOwner"]
