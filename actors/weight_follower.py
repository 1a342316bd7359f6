"""Weight following: keep a worker's engine on the newest verified weights the learner announced.

``WeightFollower`` owns the served version: the weight version (and path) the engine serves, the refused
versions and the sync in flight are written here and nowhere else. It is the weight part of
``actors.engine_link.EngineLink`` (``link.weights``); the supervisors tell it what a (re)started or reached
engine serves (``started``, ``reached``) and cancel a sync's request when they declare the engine dead
(``cancel_call``); the health watch reads whether a sync is in flight (``syncing``, ``syncs``); a distributed
push that landed is recorded through ``pushed``.

- a newer ``WeightUpdate`` is verified (``actors.weight_watcher``: checksum, and with ``actors.verify_tensors``
  every tensor of ``model.path`` with its shape, all finite), then loaded with the engine's
  ``update_weights_from_disk``; ``actors.weight_sync = wait`` lets requests in flight finish on the old
  weights, ``abort`` pauses generation (``mode=abort``) around the update;
- a refused version (failed verification, or a load the engine refused) is counted in
  ``vapo_actor_weight_sync_failures{reason}`` and never tried again; the old weights keep serving;
- an update answered with an error whose version the engine generates with anyway (SGLang: 400 after a
  completed load whose cache flush was refused) is accepted, and where SGLang keeps its radix cache the
  flush is done again (paused ``retract`` if it is refused once more): SGLang counts a request that has
  just finished as running until its scheduler's next step, so even a drained engine can refuse, and an
  unflushed cache serves old weights' KV to every prompt sharing a cached prefix;
- ``await_version`` holds a granted prompt until the engine serves the grant's learner version;
  ``wait_changed`` wakes on every move of the served version and every refusal.

Not a CLI; used by ``actors.engine_link``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from actors.engine_address import as_version
from actors.link_state import LinkState
from actors.weight_watcher import WeightWatcher, verify_tensors, verify_update
from common.checksum import checkpoint_shapes
from common.config import Config
from common.protocol import WeightUpdate
from common.sglang_args import radix_cache_kept
from common.sglang_client import SGLangError, cache_flush_refused

if TYPE_CHECKING:
    from actors.engine import Engine

log = logging.getLogger("vapo.actors.engine_link")
Result = TypeVar("Result")


class WeightFollower:
    """The served version, the refused ones, and the loads into the engine: their one owner (module
    docstring).

    ``metric(name, **labels)``: this actor's series of ``vapo_actor_<name>``; ``on_change()``: told on every
    move of the served version and every refusal (the worker records its state).
    """

    def __init__(self, cfg: Config, actor_id: int, state: LinkState, watcher: WeightWatcher,
                 metric: Callable[..., Any], on_change: Callable[[], None]) -> None:
        self.cfg, self.actor_id, self.state, self.watcher = cfg, actor_id, state, watcher
        self._metric, self._on_change = metric, on_change
        self._changed = asyncio.Event()  # replaced (and the old one set) on every change
        self._version = 0
        self._model_path = cfg.model.path
        self._refused: dict[int, str] = {}  # version -> reason
        self._latencies: list[float] = []
        self._expected: dict[str, tuple[int, ...]] | None = None  # base model's tensor shapes, read once
        self._syncing = False  # a weight sync talks to the engine (health probes use /model_info)
        self._syncs = 0  # weight syncs started so far
        self._sync_call: asyncio.Future[Any] | None = None  # the sync's request in flight
        self.loads = 0  # versions loaded from disk
        self.failures = 0  # versions refused
        self.pushes = 0  # versions received by distributed push
        self.push_pause_ms = 0

    # ------------------------------------------------------------------ what the others read

    @property
    def version(self) -> int:
        """The weight version the engine serves."""
        return self._version

    @property
    def model_path(self) -> str:
        """The directory of the weights the engine serves (``model.path`` for the base or an unknown one)."""
        return self._model_path

    @property
    def refused(self) -> dict[int, str]:
        """Refused versions -> reason (a copy)."""
        return dict(self._refused)

    @property
    def sync_latencies(self) -> list[float]:
        """Seconds from publish to served, per version loaded from disk (a copy)."""
        return list(self._latencies)

    @property
    def syncing(self) -> bool:
        """A weight sync talks to the engine now (its health probes then use ``/model_info``)."""
        return self._syncing

    @property
    def syncs(self) -> int:
        """Weight syncs started so far (a probe that overlapped one says nothing about the engine now)."""
        return self._syncs

    async def wait_changed(self, timeout_s: float) -> None:
        """Until the served version moves or a version is refused, or ``timeout_s`` passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    # ------------------------------------------------------------------ what the supervisors tell it

    def started(self, version: int, path: str) -> None:
        """An engine of ours was (re)started with these weights (``newest_verified``)."""
        self._serve(version, path)

    def reached(self, served: int) -> bool:
        """A remote engine was reached (or checked) and reports ``served``: that is the served version now
        (its path known only when it is the one we had). True when it differs from the one we had."""
        moved = served != self._version
        self._serve(served, self.cfg.model.path if moved else self._model_path)
        return moved

    def _serve(self, version: int, path: str) -> None:
        self._version, self._model_path = version, path
        self._metric("weight_version").set(version)
        self._notify()

    def _notify(self) -> None:
        """Tell the worker and every ``wait_changed`` that the served version moved or one was refused."""
        self._on_change()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # ------------------------------------------------------------------ verification

    def verify(self, upd: WeightUpdate) -> tuple[str, str] | None:
        """Checksum, then (``actors.verify_tensors``) names, shapes and finiteness; blocking (a thread)."""
        bad = verify_update(upd)
        if bad is None and self.cfg.actors.verify_tensors:
            if self._expected is None:
                self._expected = checkpoint_shapes(self.cfg.model.path)
            bad = verify_tensors(upd.path, self._expected)
        return bad

    def newest_verified(self) -> tuple[int, str]:
        """(version, path) to start an engine with: the newest announced weights that verify, else current."""
        upd = self.watcher.latest
        if upd is not None and upd.version > self._version and upd.version not in self._refused:
            bad = self.verify(upd)
            if bad is None:
                return upd.version, upd.path
            self._refuse(upd, *bad)
        return self._version, self._model_path

    def _refuse(self, upd: WeightUpdate, reason: str, message: str) -> None:
        if upd.version in self._refused:
            return
        self._refused[upd.version] = reason
        self.failures += 1
        self._metric("weight_sync_failures", reason=reason).inc()
        log.error("actor %d: refusing weights v%d (%s): %s; still serving v%d", self.actor_id, upd.version, reason,
                  message, self._version)
        self._notify()  # prompts held for this version go ahead on the current weights

    # ------------------------------------------------------------------ loads

    async def run(self) -> None:
        """Runs for the worker's life: load each newer announced version once the engine is up."""
        watcher, state = self.watcher, self.state
        while True:
            await watcher.next_change()
            async with state.control:
                if state.gate.is_set():  # else the engine is down and its restart loads the newest weights
                    await self.sync_locked(idle=False)

    async def sync_locked(self, idle: bool) -> bool:
        """Load the newest announced weights if they verify; caller holds ``state.control``. True if loaded.

        ``idle``: the gate is closed and nothing is generating (startup, after a restart), so the update
        needs no pause whatever ``actors.weight_sync`` says.
        """
        upd = self.watcher.latest
        if upd is None or upd.version <= self._version or upd.version in self._refused:
            return False
        bad = await asyncio.to_thread(self.verify, upd)
        if bad is not None:
            self._refuse(upd, *bad)
            return False
        client = self.state.client
        assert client is not None
        self._syncing = True
        self._syncs += 1
        try:
            await self._load(client, upd, pause=self.cfg.actors.weight_sync == "abort" and not idle)
        except SGLangError as e:
            if e.status is None:  # engine unreachable: the supervisor reloads the newest weights
                log.warning("actor %d: weight update v%d failed, engine unreachable: %s", self.actor_id, upd.version, e)
                self.state.report_trouble()
                return False
            if not await self._served_anyway(client, upd, e):
                self._refuse(upd, "load_error", e.message)
                return False
            if cache_flush_refused(e) and radix_cache_kept(self.cfg):
                await self._flush(client, upd.version)
        finally:
            self._syncing = False
        latency = max(0.0, time.time() - upd.created_at)
        self._serve(upd.version, upd.path)
        self.loads += 1
        self._latencies.append(latency)
        self._metric("weight_sync_seconds").observe(latency)
        log.info("actor %d: serving weights v%d (%.3f s after publish)", self.actor_id, upd.version, latency)
        return True

    async def _load(self, client: Engine, upd: WeightUpdate, pause: bool) -> None:
        """``update_weights_from_disk``, with generation paused (``abort``) around it when ``pause``."""
        gate = self.state.gate
        # The update's deadline: the engine's own read deadline, plus one probe's worth for the rest.
        load_s = self.cfg.engine.weight_load_timeout_s + self.cfg.engine.health_timeout_s
        if not pause:
            await self._call(client.update_weights_from_disk(upd.path, weight_version=upd.version, timeout_s=load_s))
            return
        gate.clear()
        try:
            await self._call(client.pause_generation("abort"))
            await self._call(client.update_weights_from_disk(upd.path, weight_version=upd.version, timeout_s=load_s))
        finally:
            with contextlib.suppress(SGLangError):
                await self._call(client.continue_generation())
            gate.set()

    async def _flush(self, client: Engine, version: int) -> None:
        """The radix cache flush a load's answer said was refused: again, and if refused again (requests
        running) with generation paused ``retract`` around it, which a paused SGLang flushes through."""
        gate = self.state.gate
        try:
            if await self._call(client.flush_cache()):
                return
            was_open = gate.is_set()  # closed at startup and after a restart: leave it so
            gate.clear()
            try:
                await self._call(client.pause_generation("retract"))
                flushed = await self._call(client.flush_cache())
            finally:
                with contextlib.suppress(SGLangError):
                    await self._call(client.continue_generation())
                if was_open:
                    gate.set()
        except SGLangError as e:
            flushed, why = False, str(e)
        else:
            why = "refused while paused"
        if not flushed:
            log.warning("actor %d: the prefix cache was not flushed after v%d (%s): prompts sharing a cached "
                        "prefix may reuse KV of older weights", self.actor_id, version, why)

    async def _call(self, coro: Coroutine[Any, Any, Result]) -> Result:
        """Await one of the sync's requests as a task the health watcher can cancel when it finds the
        engine dead (a cancelled request reads as an unreachable engine)."""
        task = asyncio.ensure_future(coro)
        self._sync_call = task
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # The ignore: current_task() is None only outside a task, and this coroutine always runs in one.
            if task.cancelled() and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise SGLangError("engine", None, "declared dead by its health probes") from None
            task.cancel()
            raise
        finally:
            self._sync_call = None

    def cancel_call(self) -> None:
        """The engine was declared dead: the request the sync waits on gives up now."""
        if self._sync_call is not None:
            self._sync_call.cancel()

    async def _served_anyway(self, client: Engine, upd: WeightUpdate, e: SGLangError) -> bool:
        """After an update answered with an error: True when the engine generates with ``upd`` anyway.
        SGLang answers 400 when the cache flush after a completed load is refused (requests still queued),
        with the new weights live: refusing that version would misstamp every sample from then on."""
        try:
            served = await client.served_weight_version(timeout_s=self.state.generate_timeout_s)
        except SGLangError as e2:
            log.warning("actor %d: cannot ask the engine which weights it serves after a failed update: %s",
                        self.actor_id, e2)
            return False
        if as_version(served) != upd.version:
            return False
        log.warning("actor %d: engine answered %s to the update to v%d but generates with it; accepting v%d",
                    self.actor_id, e, upd.version, upd.version)
        return True

    def pushed(self, version: int, pause_s: float) -> None:
        """A distributed push moved the engine to ``version``; caller holds ``state.control``."""
        self._serve(version, self._model_path)
        self.pushes += 1
        self.push_pause_ms += round(pause_s * 1000)

    # ------------------------------------------------------------------ the worker's wait

    async def await_version(self, needed: int, wait_s: float) -> float:
        """Hold a granted prompt until the engine serves weights ``>= needed`` (the grant's learner version);
        the seconds waited.

        Only a version that has been announced and not refused is waited for (one that was never published,
        with ``learner.weights_every > 1``, is not), and never longer than ``wait_s``
        (``actors.weight_wait_s``). A grant that overtook its ``WeightUpdate`` triggers an immediate
        ``WeightQuery`` rather than waiting for the next poll.
        """
        watcher = self.watcher
        if self._version >= needed or wait_s <= 0:
            return 0.0
        t0 = time.monotonic()
        latest = watcher.latest
        if latest is None or latest.version < needed:
            await watcher.query()  # the PUB message is on its way or was dropped: ask
            latest = watcher.latest
        if latest is None:
            return 0.0  # nothing announced: nothing to wait for (the query's time is not a weight wait)
        target = min(needed, latest.version)
        deadline = t0 + wait_s
        # The sync loop loads only the newest announced update: while that one is refused, nothing moves.
        while self._version < target and latest.version not in self._refused:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("actor %d: still serving v%d %.0f s after a grant for learner v%d; generating anyway "
                            "(actors.weight_wait_s)", self.actor_id, self._version, wait_s, needed)
                break
            await self.wait_changed(left)
            latest = watcher.latest or latest  # the newest announced now (the watcher never forgets one)
        return time.monotonic() - t0


__all__ = ["WeightFollower"]
