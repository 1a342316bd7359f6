"""An engine's side of a distributed weight push, through SGLang's own API (``common.sglang_client``).

- ``join_group(client, body)``: ``/init_weights_update_group`` with the body the learner's
  ``WeightPusher.open_group`` made for this engine (it blocks until every member has joined).
- ``receive_push(client, buckets, version, pause, ready=...)``: one version.

  1. ``/pause_generation`` (unless ``pause`` is ``none``), then ``/begin_weight_update``: SGLang 0.5.23
     refuses ``/update_weights_from_distributed`` outside a weight-update session, without posting its
     receive, so the learner's broadcast would hang. A session found open already (a push of ours cut
     short) is ended and begun again, once.
  2. ``ready()`` (``PushMember``: ``PushReady`` to the learner, then its ``PushGo``): false means the
     learner broadcasts nothing for this version; the session is ended, generation continues and
     ``PushCancelled`` is raised.
  3. One ``/update_weights_from_distributed`` per bucket, posted while the learner broadcasts it
     (``load_format="flattened_bucket"``; ``weight_version`` only with the last bucket, so the engine's
     version moves when the whole version is in; ``flush_cache`` only there too). A last bucket answered
     400 because only its cache flush was refused (``cache_flush_refused``) is loaded: SGLang installed the
     weights and the version before it tried the flush.
  4. ``/end_weight_update``, then ``/continue_generation``.

  ``pause``: ``in_place`` (running requests keep their KV cache and continue on the new weights; SGLang
  refuses to flush the cache while they exist, so no flush is asked for) or ``retract`` (they are re-queued
  and recomputed; the cache is flushed) around the buckets; ``abort`` aborts them first; ``none`` pauses
  nothing (SGLang then waits for the running requests at the begin, the end and each bucket: the drain
  this path exists to avoid).

Failures: a pause or begin that fails raises ``NotReady`` with generation continued (nothing was received,
the weights are untouched). A bucket that fails (the engine or the group died, a bucket refused) raises
``SGLangError`` with the session ended (best effort: a later begin must not be refused) and the engine
left paused: its weights may be a mix of two versions (as SGLang warns), so the caller loads the version
from disk (``/update_weights_from_disk``, which needs no session, applies at once while paused) before it
continues generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from actors.engine import Engine
from common import protocol
from common.protocol import PushDone, PushGroup, PushVersion
from common.security import ClientKeys, apply_client_curve
from common.sglang_client import SGLangClient, SGLangError, cache_flush_refused, session_already_open

if TYPE_CHECKING:
    from actors.engine_link import EngineLink

log = logging.getLogger("vapo.actors.weight_push")

PAUSE_MODES = ("in_place", "retract", "abort", "none")
REJOIN_BACKOFF_S = 10.0
MAX_REJOIN_BACKOFF_S = 600.0
# A ready member waits for the learner's PushGo at most its learner.push_timeout_s (the learner's own wait
# for every PushReady) plus this, for the messages' way back.
GO_SLACK_S = 5.0


class NotReady(SGLangError):
    """The engine could not be paused or its weight-update session opened: nothing was received, its
    weights are untouched and generation was continued."""


class PushCancelled(Exception):
    """The learner broadcasts nothing for this version (a member was not ready): the session was ended
    and generation continued; the version comes from disk."""


@dataclass
class PushReport:
    """What one engine's side of a push took."""

    pause_s: float = 0.0  # generation paused: from /pause_generation sent to /continue_generation answered
    receive_s: float = 0.0  # the bucket posts, first sent to last answered


async def join_group(client: Engine | SGLangClient, body: dict[str, Any], timeout_s: float | None = None) -> str:
    return await client.init_weights_update_group(
        body["master_address"], body["master_port"], body["rank_offset"], body["world_size"],
        group_name=body.get("group_name", "weight_update_group"), backend=body.get("backend", "nccl"),
        timeout_s=timeout_s)


async def open_session(client: Engine | SGLangClient, timeout_s: float | None = None) -> None:
    """``/begin_weight_update``; a session found open is ended and begun again once. Only vapo's own push
    opens sessions on its engines, so an open one was left by a push of ours that was cut short (a crash,
    a lost connection) and nothing else is using it."""
    try:
        await client.begin_weight_update(timeout_s)
    except SGLangError as e:
        if not session_already_open(e):
            raise
        log.warning("%s: a weight-update session was left open; ending it and opening a new one", client.base_url)
        await client.end_weight_update(timeout_s)
        await client.begin_weight_update(timeout_s)


async def _prepare(client: Engine | SGLangClient, pause: str, timeout_s: float | None) -> None:
    """Pause (unless ``none``) and open the session; NotReady with generation continued on failure."""
    try:
        if pause != "none":
            await client.pause_generation(pause)
        await open_session(client, timeout_s)
    except SGLangError as e:
        if pause != "none":
            with contextlib.suppress(SGLangError):
                await client.continue_generation()
        raise NotReady(e.endpoint, e.status, e.message, e.body) from e


async def _abandon(client: Engine | SGLangClient, pause: str, timeout_s: float | None) -> None:
    """Nothing will be received: end the session and let generation go on (both best effort)."""
    with contextlib.suppress(SGLangError):
        await client.end_weight_update(timeout_s)
    if pause != "none":
        with contextlib.suppress(SGLangError):
            await client.continue_generation()


async def _post_buckets(client: Engine | SGLangClient, buckets: list[dict[str, Any]], version: int | str, flush: bool,
                        group_name: str, timeout_s: float | None) -> None:
    for i, b in enumerate(buckets):
        last = i == len(buckets) - 1
        try:
            await client.update_weights_from_distributed(
                b["names"], b["dtypes"], b["shapes"], weight_version=version if last else None,
                flush_cache=flush and last, load_format="flattened_bucket", group_name=group_name,
                timeout_s=timeout_s)
        except SGLangError as e:
            if not (last and flush and cache_flush_refused(e)):
                raise
            # SGLang installed the weights and the version, then could not flush (requests still queued).
            log.info("%s: v%s loaded; its cache flush was refused (%s)", client.base_url, version, e.message[:200])


async def receive_push(client: Engine | SGLangClient, buckets: list[dict[str, Any]], version: int | str,
                       pause: str = "in_place", group_name: str = "weight_update_group",
                       timeout_s: float | None = None,
                       ready: Callable[[], Awaitable[bool]] | None = None) -> PushReport:
    """Receive and load one pushed version (see the module docstring). ``ready``: awaited once the engine
    is paused with its session open; False cancels (PushCancelled). NotReady, SGLangError on failure."""
    if pause not in PAUSE_MODES:
        raise ValueError(f"pause {pause!r}: one of {PAUSE_MODES}")
    rep = PushReport()
    t0 = time.perf_counter()
    await _prepare(client, pause, timeout_s)
    try:
        go = True if ready is None else await ready()
    except BaseException:
        await _abandon(client, pause, timeout_s)
        raise
    if not go:
        await _abandon(client, pause, timeout_s)
        raise PushCancelled(f"v{version}: the learner broadcasts nothing for this version")
    t1 = time.perf_counter()
    try:
        await _post_buckets(client, buckets, version, pause != "in_place", group_name, timeout_s)
    except SGLangError:
        with contextlib.suppress(SGLangError):
            await client.end_weight_update(timeout_s)
        raise
    rep.receive_s = time.perf_counter() - t1
    await client.end_weight_update(timeout_s)
    if pause != "none":
        await client.continue_generation()
        rep.pause_s = time.perf_counter() - t0
    return rep


class PushMember:
    """One worker's membership in the learner's weight push (``learner.weight_transport: distributed``).

    A DEALER to ``learner.push_addr`` (the buffer's CurveZMQ client keys when configured). Whenever the
    link's ``engine_starts`` differs from the one it last announced (start, every restart the link sees,
    a remote SGLang engine included, whose client object survives its restart), sends ``PushJoin``; on
    ``PushGroup`` posts ``/init_weights_update_group`` (destroying the engine's previous group) and answers
    ``PushDone(version=-1)``. On ``PushVersion`` it takes the link's control lock (no disk sync or restart
    meanwhile) and, with the link's health probes held off (``link.pushing()``), pauses the engine
    (``actors.push_pause``), opens its session and answers ``PushReady``; on ``PushGo(go)`` posts the
    buckets, ends the session, continues, moves the link to the version and answers ``PushDone``. A
    ``PushGo`` without go (or none within ``learner.push_timeout_s`` + ``GO_SLACK_S``) ends the session,
    continues and announces again at once: the learner rebuilds the group, and may have left this member
    out. A push that fails after the buckets began leaves the engine's weights a mix: the link is told the
    engine is in trouble and stays on the old version number, so the version's durable copy is loaded from
    disk once announced (``EngineLink.sync_loop``), or the engine is restarted with it.
    """

    def __init__(self, link: EngineLink, push_addr: str, pause: str, curve: ClientKeys | None = None,
                 ctx: zmq.asyncio.Context | None = None, recover_timeout_s: float = 600.0) -> None:
        self.recover_timeout_s = recover_timeout_s
        self.link, self.push_addr, self.pause, self.curve = link, push_addr, pause, curve
        self.go_timeout_s = link.cfg.learner.push_timeout_s + GO_SLACK_S
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.group: PushGroup | None = None  # the group this engine is in and can be pushed on
        self._joined: tuple[str, int] | None = None  # (group name, engine start) of the engine's last group
        self._announced: int | None = None  # link.engine_starts when the last PushJoin was sent
        self.starts = 0  # PushJoins sent: each one's engine_start, so the learner tells a new one from a repeat
        # After a failed join, a refusal or a failed push the learner drops this member; it joins again after
        # a back-off that doubles while joins fail or its engine refuses, until a push lands (each failed
        # join costs the learner its push_timeout_s, each refusal a rebuilt group).
        self._rejoin_at = 0.0
        self._backoff_s = REJOIN_BACKOFF_S
        self._failed_start: int | None = None  # the engine start that failed; a restarted engine joins at once
        self._go: dict[tuple[int, int], asyncio.Future[bool]] = {}  # (epoch, version) -> the learner's PushGo
        self._serial = asyncio.Lock()  # joins and pushes run one at a time, in the order they arrived
        self._tasks: set[asyncio.Task[None]] = set()

    def _due(self) -> bool:
        """A PushJoin is due: the engine is up and started since the last one (or a back-off has passed)."""
        link = self.link
        starts = link.engine_starts
        return (link.client is not None and starts != self._announced and link.gate.is_set()
                and (time.monotonic() >= self._rejoin_at or starts != self._failed_start))

    async def run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        apply_client_curve(sock, self.curve)
        sock.connect(self.push_addr)
        try:
            while True:
                if self._due():
                    self._announced, self.group = self.link.engine_starts, None
                    self.starts += 1
                    await sock.send(protocol.encode(protocol.PushJoin(actor_id=self.link.actor_id,
                                                                      engine_start=self.starts)))
                if not await sock.poll(200):
                    continue
                try:
                    msg = protocol.decode(await sock.recv())
                except protocol.ProtocolError:
                    continue
                if isinstance(msg, protocol.PushGroup):
                    self._spawn(self._join(sock, msg))
                elif isinstance(msg, protocol.PushVersion):
                    for key in [k for k in self._go if k[1] < msg.version]:  # answers nobody waits for any more
                        self._go.pop(key)
                    self._go_future(msg.epoch, msg.version)
                    self._spawn(self._push(sock, msg))
                elif isinstance(msg, protocol.PushGo):
                    fut = self._go_future(msg.epoch, msg.version)
                    if not fut.done():
                        fut.set_result(msg.go)
        finally:
            for t in self._tasks:
                t.cancel()
            sock.close(linger=0)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _go_future(self, epoch: int, version: int) -> asyncio.Future[bool]:
        key = (epoch, version)
        if key not in self._go:
            self._go[key] = asyncio.get_running_loop().create_future()
        return self._go[key]

    async def _join(self, sock: zmq.asyncio.Socket, msg: PushGroup) -> None:
        async with self._serial:
            link = self.link
            client, starts = link.client, link.engine_starts
            self.group = None
            ok, text = False, "engine down"
            if client is not None and self._joined is not None and self._joined[1] == starts:
                # A rebuilt group has a new name: free the old one's connections on the engine.
                with contextlib.suppress(SGLangError):
                    await client.destroy_weights_update_group(self._joined[0])
            self._joined = None
            try:
                if client is not None:
                    await join_group(client, msg.to_wire(), timeout_s=None)
                    self.group, self._joined = msg, (msg.group_name, starts)
                    ok, text = True, ""
            except SGLangError as e:
                text = e.message[:2000]
            if not ok:
                self._dropped(double=True)
            await sock.send(protocol.encode(protocol.PushDone(actor_id=link.actor_id, epoch=msg.epoch, version=-1,
                                                              ok=ok, pause_s=0.0, message=text)))

    async def _push(self, sock: zmq.asyncio.Socket, msg: PushVersion) -> None:
        async with self._serial:
            try:
                done = await self._receive(sock, msg)
            finally:
                self._go.pop((msg.epoch, msg.version), None)
            if done is not None:
                await sock.send(protocol.encode(done))

    async def _ready(self, sock: zmq.asyncio.Socket, msg: PushVersion, ok: bool, text: str = "") -> None:
        await sock.send(protocol.encode(protocol.PushReady(actor_id=self.link.actor_id, epoch=msg.epoch,
                                                           version=msg.version, ok=ok, message=text[:2000])))

    async def _ready_and_wait(self, sock: zmq.asyncio.Socket, msg: PushVersion) -> bool:
        """Paused with the session open: say so, and wait for the learner's go (False: none in time)."""
        await self._ready(sock, msg, True)
        try:
            return await asyncio.wait_for(asyncio.shield(self._go_future(msg.epoch, msg.version)), self.go_timeout_s)
        except TimeoutError:
            log.warning("actor %d: no PushGo for v%d within %.0f s; not receiving it", self.link.actor_id,
                        msg.version, self.go_timeout_s)
            return False

    def _unusable(self, msg: PushVersion) -> str:
        """Why this engine cannot take ``msg``'s version on its group ("" when it can)."""
        if self.group is None or self.group.epoch != msg.epoch:
            return f"not in group {msg.epoch}"
        if self.link.client is None or self._joined is None or self._joined[1] != self.link.engine_starts:
            # Restarted since it joined: the new engine is in no group (it announces itself again, at once).
            self.group = None
            return "engine restarted since it joined"
        return ""

    async def _receive(self, sock: zmq.asyncio.Socket, msg: PushVersion) -> PushDone | None:
        """One version (``PushVersion``): PushReady, then on go the buckets. The PushDone to send, or None
        when nothing was received (not ready, or no go)."""
        link = self.link
        ok, text, rep = False, "", PushReport()
        async with link.control:  # restarts happen under it: the client is the engine's from here on
            if why := self._unusable(msg):
                await self._ready(sock, msg, False, why)
                return None
            told = self._go.get((msg.epoch, msg.version))
            if told is not None and told.done() and not told.result():
                self._announced = None  # called off before it began (another member refused): join again
                return None
            assert self.group is not None and link.client is not None
            with link.pushing():
                try:
                    rep = await receive_push(link.client, self.group.buckets, msg.version, pause=self.pause,
                                             group_name=self.group.group_name,
                                             ready=lambda: self._ready_and_wait(sock, msg))
                    ok = True
                except NotReady as e:
                    log.warning("actor %d: not ready for v%d: %s", link.actor_id, msg.version, e)
                    self.group = None
                    self._dropped(double=True)  # an engine that keeps refusing costs every version a rebuild
                    await self._ready(sock, msg, False, e.message)
                    return None
                except PushCancelled:
                    self._announced = None  # the learner rebuilds the group: join it again at once
                    return None
                except SGLangError as e:
                    text = e.message[:2000]
                    self.group = None
                    self._dropped(double=False)
                    link.gate.clear()  # paused on a possible mix of versions: nothing new goes to it
                    self._spawn(self._recover(msg.version))
            if ok:
                self._backoff_s = REJOIN_BACKOFF_S  # a push landed: the next failure backs off from the start
            if ok and msg.version > link.version:
                link.pushed(msg.version, rep.pause_s)
            for phase, s in (("pause", rep.pause_s), ("load", rep.receive_s)):
                link.metric("weight_sync_phase_seconds", phase=phase, transport="distributed").observe(s)
        return protocol.PushDone(actor_id=link.actor_id, epoch=msg.epoch, version=msg.version, ok=ok,
                                 pause_s=rep.pause_s, message=text)

    def _dropped(self, double: bool) -> None:
        """The learner leaves this member out after a failure: announce again (same engine) after a back-off."""
        self._announced, self._failed_start = None, self.link.engine_starts
        self._rejoin_at = time.monotonic() + self._backoff_s
        if double:
            self._backoff_s = min(self._backoff_s * 2, MAX_REJOIN_BACKOFF_S)

    async def _recover(self, version: int) -> None:
        """After a failed push: load ``version`` (or newer) from disk once its durable copy is announced,
        then continue generation. An engine that is gone is the supervisor's (it restarts it with the
        newest verified weights)."""
        link = self.link
        deadline = time.monotonic() + self.recover_timeout_s
        while (link.watcher.latest is None or link.watcher.latest.version < version) and time.monotonic() < deadline:
            await link.watcher.query()
            await asyncio.sleep(0.5)
        async with link.control:
            client = link.client
            with contextlib.suppress(SGLangError):
                await link.sync_locked(idle=True)
                if client is not None:
                    await client.continue_generation()
            if link.version < version:
                link.report_trouble()  # still not on it: let the health path decide (restart reloads)
            link.gate.set()


__all__ = ["GO_SLACK_S", "PAUSE_MODES", "NotReady", "PushCancelled", "PushMember", "PushReport", "join_group",
           "open_session", "receive_push"]
