"""Weight following: keep a worker's engine on the newest verified weights the learner announced.

``WeightFollower`` is the weight half of ``actors.engine_link.EngineLink`` (one per link, ``link.weights``):

- a newer ``WeightUpdate`` is verified (``actors.weight_sync``: checksum, and with ``actors.verify_tensors``
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
- a distributed push (``actors.weight_push_client``) that landed is recorded through ``pushed``;
- ``await_version`` holds a granted prompt until the engine serves the grant's learner version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from actors.engine_address import as_version
from actors.link_state import LinkState
from actors.weight_sync import verify_tensors, verify_update
from common.checksum import checkpoint_shapes
from common.protocol import WeightUpdate
from common.sglang_args import radix_cache_kept
from common.sglang_client import SGLangError, cache_flush_refused

if TYPE_CHECKING:
    from actors.engine import Engine

log = logging.getLogger("vapo.actors.engine_link")
Result = TypeVar("Result")


class WeightFollower:
    """The newest verified version, the refused ones, and the loads into the engine (module docstring)."""

    def __init__(self, link: LinkState) -> None:
        self.link = link
        self.refused: dict[int, str] = {}  # version -> reason
        self.sync_latencies: list[float] = []
        self._expected: dict[str, tuple[int, ...]] | None = None  # base model's tensor shapes, read once
        self.syncing = False  # a weight sync talks to the engine (health probes use /model_info)
        self.syncs = 0  # weight syncs started so far
        self._sync_call: asyncio.Future[Any] | None = None  # the sync's request in flight

    # ------------------------------------------------------------------ verification

    def verify(self, upd: WeightUpdate) -> tuple[str, str] | None:
        """Checksum, then (``actors.verify_tensors``) names, shapes and finiteness; blocking (a thread)."""
        bad = verify_update(upd)
        if bad is None and self.link.cfg.actors.verify_tensors:
            if self._expected is None:
                self._expected = checkpoint_shapes(self.link.cfg.model.path)
            bad = verify_tensors(upd.path, self._expected)
        return bad

    def newest_verified(self) -> tuple[int, str]:
        """(version, path) to start an engine with: the newest announced weights that verify, else current."""
        link = self.link
        upd = link.watcher.latest
        if upd is not None and upd.version > link.version and upd.version not in self.refused:
            bad = self.verify(upd)
            if bad is None:
                return upd.version, upd.path
            self.refuse(upd, *bad)
        return link.version, link.model_path

    def refuse(self, upd: WeightUpdate, reason: str, message: str) -> None:
        link = self.link
        if upd.version in self.refused:
            return
        self.refused[upd.version] = reason
        link.counts.weight_sync_failures += 1
        link.metric("weight_sync_failures", reason=reason).inc()
        log.error("actor %d: refusing weights v%d (%s): %s; still serving v%d", link.actor_id, upd.version, reason,
                  message, link.version)
        link.notify_change()  # prompts held for this version go ahead on the current weights

    # ------------------------------------------------------------------ loads

    async def run(self) -> None:
        """Runs for the worker's life: load each newer announced version once the engine is up."""
        watcher = self.link.watcher
        while True:
            await watcher.changed.wait()
            watcher.changed.clear()
            async with self.link.control:
                if self.link.gate.is_set():  # else the engine is down and its restart loads the newest weights
                    await self.sync_locked(idle=False)

    async def sync_locked(self, idle: bool) -> bool:
        """Load the newest announced weights if they verify; caller holds ``link.control``. True if loaded.

        ``idle``: the gate is closed and nothing is generating (startup, after a restart), so the update
        needs no pause whatever ``actors.weight_sync`` says.
        """
        link = self.link
        upd = link.watcher.latest
        if upd is None or upd.version <= link.version or upd.version in self.refused:
            return False
        bad = await asyncio.to_thread(self.verify, upd)
        if bad is not None:
            self.refuse(upd, *bad)
            return False
        assert link.client is not None
        client = link.client
        self.syncing = True
        self.syncs += 1
        try:
            await self._load(client, upd, pause=link.cfg.actors.weight_sync == "abort" and not idle)
        except SGLangError as e:
            if e.status is None:  # engine unreachable: the supervisor reloads the newest weights
                log.warning("actor %d: weight update v%d failed, engine unreachable: %s", link.actor_id, upd.version, e)
                link.trouble.set()
                return False
            if not await self._served_anyway(client, upd, e):
                self.refuse(upd, "load_error", e.message)
                return False
            if cache_flush_refused(e) and radix_cache_kept(link.cfg):
                await self._flush(client, upd.version)
        finally:
            self.syncing = False
        latency = max(0.0, time.time() - upd.created_at)
        link.set_version(upd.version, upd.path)
        link.counts.weight_syncs += 1
        self.sync_latencies.append(latency)
        link.metric("weight_sync_seconds").observe(latency)
        log.info("actor %d: serving weights v%d (%.3f s after publish)", link.actor_id, upd.version, latency)
        return True

    async def _load(self, client: Engine, upd: WeightUpdate, pause: bool) -> None:
        """``update_weights_from_disk``, with generation paused (``abort``) around it when ``pause``."""
        link = self.link
        # The update's deadline: the engine's own read deadline, plus one probe's worth for the rest.
        load_s = link.cfg.engine.weight_load_timeout_s + link.cfg.engine.health_timeout_s
        if not pause:
            await self._call(client.update_weights_from_disk(upd.path, weight_version=upd.version, timeout_s=load_s))
            return
        link.gate.clear()
        try:
            await self._call(client.pause_generation("abort"))
            await self._call(client.update_weights_from_disk(upd.path, weight_version=upd.version, timeout_s=load_s))
        finally:
            with contextlib.suppress(SGLangError):
                await self._call(client.continue_generation())
            link.gate.set()

    async def _flush(self, client: Engine, version: int) -> None:
        """The radix cache flush a load's answer said was refused: again, and if refused again (requests
        running) with generation paused ``retract`` around it, which a paused SGLang flushes through."""
        link = self.link
        try:
            if await self._call(client.flush_cache()):
                return
            was_open = link.gate.is_set()  # closed at startup and after a restart: leave it so
            link.gate.clear()
            try:
                await self._call(client.pause_generation("retract"))
                flushed = await self._call(client.flush_cache())
            finally:
                with contextlib.suppress(SGLangError):
                    await self._call(client.continue_generation())
                if was_open:
                    link.gate.set()
        except SGLangError as e:
            flushed, why = False, str(e)
        else:
            why = "refused while paused"
        if not flushed:
            log.warning("actor %d: the prefix cache was not flushed after v%d (%s): prompts sharing a cached "
                        "prefix may reuse KV of older weights", link.actor_id, version, why)

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

    def cancel_call(self) -> None:
        """The engine was declared dead: the request the sync waits on gives up now."""
        if self._sync_call is not None:
            self._sync_call.cancel()

    async def _served_anyway(self, client: Engine, upd: WeightUpdate, e: SGLangError) -> bool:
        """After an update answered with an error: True when the engine generates with ``upd`` anyway.
        SGLang answers 400 when the cache flush after a completed load is refused (requests still queued),
        with the new weights live: refusing that version would misstamp every sample from then on."""
        link = self.link
        try:
            served = await client.served_weight_version(timeout_s=link.generate_timeout_s)
        except SGLangError as e2:
            log.warning("actor %d: cannot ask the engine which weights it serves after a failed update: %s",
                        link.actor_id, e2)
            return False
        if as_version(served) != upd.version:
            return False
        log.warning("actor %d: engine answered %s to the update to v%d but generates with it; accepting v%d",
                    link.actor_id, e, upd.version, upd.version)
        return True

    def pushed(self, version: int, pause_s: float) -> None:
        """A distributed push moved the engine to ``version``; caller holds ``link.control``."""
        link = self.link
        link.set_version(version, link.model_path)
        link.counts.weight_syncs += 1
        link.counts.weight_pushes += 1
        link.counts.push_pause_ms += round(pause_s * 1000)

    # ------------------------------------------------------------------ the worker's wait

    async def await_version(self, needed: int, wait_s: float) -> float:
        """Hold a granted prompt until the engine serves weights ``>= needed`` (the grant's learner version);
        the seconds waited.

        Only a version that has been announced and not refused is waited for (one that was never published,
        with ``learner.weights_every > 1``, is not), and never longer than ``wait_s``
        (``actors.weight_wait_s``). A grant that overtook its ``WeightUpdate`` triggers an immediate
        ``WeightQuery`` rather than waiting for the next poll.
        """
        link = self.link
        if link.version >= needed or wait_s <= 0:
            return 0.0
        t0 = time.monotonic()
        latest = link.watcher.latest
        if latest is None or latest.version < needed:
            await link.watcher.query()  # the PUB message is on its way or was dropped: ask
            latest = link.watcher.latest
        if latest is None:
            return 0.0  # nothing announced: nothing to wait for (the query's time is not a weight wait)
        target = min(needed, latest.version)
        deadline = t0 + wait_s
        # The sync loop loads only the newest announced update: while that one is refused, nothing moves.
        while link.version < target and latest.version not in self.refused:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("actor %d: still serving v%d %.0f s after a grant for learner v%d; generating anyway "
                            "(actors.weight_wait_s)", link.actor_id, link.version, wait_s, needed)
                break
            await link.wait_changed(left)
            latest = link.watcher.latest or latest  # the newest announced now (the watcher never forgets one)
        return time.monotonic() - t0


__all__ = ["WeightFollower"]
