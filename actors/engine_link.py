"""A worker's link to its engine: start or reach it, keep it alive, keep its weights current.

``EngineLink`` is the one owner of everything between a rollout worker and its inference engine
(``engine.kind``), and holds the state its three parts share: the engine (``client``, an
``actors.engine.Engine``), the gate (open while the engine takes requests), the control lock (weight syncs
and restarts, one at a time), the served ``version`` and the ``counts``. The parts:

- ``supervisor`` (``actors.engine_supervisor``): ``LocalSupervisor`` for ``rollout_server`` (a child server
  started with the newest verified weights, restarted when it exits or is declared dead, at most
  ``engine.max_restarts`` times), ``RemoteSupervisor`` for ``sglang`` (``engine.host:engine.base_port + i``,
  started by ``ops/launch.sh`` through ``actors.sglang_launcher``) and ``external`` (``engine.urls[i]``):
  waited for, loaded with the newest weights, re-synced when it comes back on older ones. Either counts
  in ``engine_restarts``; an engine that cannot be kept ends ``supervise`` with ``EngineLost``.
- ``health`` (``engine_supervisor.HealthWatch``): ``engine.health_failures`` failed probes in a row declare
  the engine dead (``watch_health``).
- ``weights`` (``actors.weight_follower.WeightFollower``): each newer verified ``WeightUpdate`` is loaded
  from disk (``sync_loop``); a refused one is counted in ``vapo_actor_weight_sync_failures{reason}`` and the
  old weights keep serving; distributed pushes are recorded through ``pushed``.

The worker reads ``gate``, ``client``, ``version`` and ``counts``, waits with ``wait_changed``, and calls
``report_trouble`` when a request failed; the link tells it through ``LinkOwner`` when the served version
moved and asks it whether it is stopping. Every request to the engine has a deadline (``use_engine``) and
carries the engine's admin API key (``engine_api_key``).

Deviations: none from SGLang's API; the link uses only what ``actors.engine.Engine`` speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

from actors.engine import Engine, engine_class
from actors.engine_address import engine_api_key, engine_url
from actors.engine_supervisor import EngineLost, HealthWatch, LocalSupervisor, RemoteSupervisor
from actors.link_state import LinkCounts
from actors.rollout_server.process import RolloutServerProcess
from actors.weight_follower import WeightFollower
from actors.weight_sync import WeightWatcher
from common.config import Config
from common.metrics import Metrics


class LinkOwner(Protocol):
    """What the link needs from the worker that owns it."""

    def engine_changed(self) -> None:
        """The served version moved, or a version was refused (the worker records its state)."""

    def stopping(self) -> bool:
        """The worker is shutting down: an engine exit is then no failure."""


class EngineLink:
    """One worker's engine: the state its supervisor, health watch and weight follower share (see the
    module docstring).

    ``metrics``: the worker's (the link's series carry ``actor=<actor_id>`` like the worker's own).
    """

    def __init__(self, cfg: Config, actor_id: int, watcher: WeightWatcher, owner: LinkOwner, metrics: Metrics, *,
                 generate_timeout_s: float) -> None:
        self.cfg, self.actor_id, self.watcher = cfg, actor_id, watcher
        self.generate_timeout_s = generate_timeout_s
        self.counts = LinkCounts()
        self.metrics = metrics
        self._owner = owner
        self._changed = asyncio.Event()  # replaced (and the old one set) on every change of the served version
        self.version = 0
        self.model_path = cfg.model.path
        self.client: Engine | None = None
        self.gate = asyncio.Event()  # set while the engine accepts requests
        self.control = asyncio.Lock()  # weight syncs and engine restarts, one at a time
        self.trouble = asyncio.Event()  # a request failed: the engine may be gone
        # Engines this link has seen start: +1 on every (re)start of ours and every restart of a remote engine
        # it notices. A distributed-push member announces itself again whenever this moves: a restarted
        # engine is in no weight-update group, whatever client object reaches it.
        self.engine_starts = 0
        self._pushing = 0  # distributed pushes in progress (``pushing``): health probes neither run nor count
        # The engine's API key: ours is fresh per worker (passed to the child in its environment, never
        # on its command line), a remote engine's is read from engine.admin_api_key_file.
        self.api_key = engine_api_key(cfg)
        self.weights = WeightFollower(self)
        url = engine_url(cfg, actor_id)
        self.supervisor: LocalSupervisor | RemoteSupervisor = (LocalSupervisor(self) if url is None
                                                               else RemoteSupervisor(self, url))
        self.health = HealthWatch(self)

    # ------------------------------------------------------------------ what the worker reads

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
    def url(self) -> str | None:
        return self.client.base_url if self.client is not None else None

    @property
    def refused(self) -> dict[int, str]:
        """Refused versions -> reason."""
        return self.weights.refused

    @property
    def sync_latencies(self) -> list[float]:
        """Seconds from publish to served, per version loaded from disk."""
        return self.weights.sync_latencies

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

    # ------------------------------------------------------------------ what the parts share

    def stopping(self) -> bool:
        """The worker is shutting down."""
        return self._owner.stopping()

    def notify_change(self) -> None:
        """Tell the worker and every ``wait_changed`` that the served version moved or one was refused."""
        self._owner.engine_changed()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def set_version(self, version: int, path: str) -> None:
        self.version, self.model_path = version, path
        self.metric("weight_version").set(version)
        self.notify_change()

    def count_restart(self) -> int:
        self.counts.engine_restarts += 1
        self.metric("engine_restarts").inc()
        return self.counts.engine_restarts

    async def use_engine(self, url: str) -> Engine:
        """Talk to the engine at ``url`` from now on (the previous client closed)."""
        if self.client is not None:
            await self.client.close()
        e = self.cfg.engine
        # Control requests (pause, continue, model info) get a probe's deadline.
        self.client = engine_class(e.kind, e.imitate_sglang)(
            url, timeout_s=self.generate_timeout_s, control_timeout_s=e.health_timeout_s, api_key=self.api_key or None)
        return self.client

    @property
    def pushing_now(self) -> bool:
        """A distributed push is in progress (health probes neither run nor count)."""
        return self._pushing > 0

    @contextlib.contextmanager
    def pushing(self) -> Iterator[None]:
        """Marks a distributed push into the engine (``actors.weight_push_client``): SGLang's ``/health``
        runs a generation, which cannot run while the push pauses the engine, so no probe runs or counts
        meanwhile (a push that hangs fails on its own deadline, and its recovery reports trouble)."""
        self._pushing += 1
        try:
            yield
        finally:
            self._pushing -= 1

    # ------------------------------------------------------------------ what the worker runs

    async def connect(self) -> None:
        """Start (rollout_server) or reach (sglang/external) the engine with the newest verified weights;
        the gate stays closed until the caller opens it."""
        async with self.control:
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

    async def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
        await self.supervisor.stop()


__all__ = ["EngineLink", "EngineLost", "LinkCounts", "LinkOwner"]
