"""Clients of the buffer server: the actors' group sender and the learner's batch client.

Actors (DEALER -> the buffer's ROUTER at ``buffer.ingest_addr``; asyncio, ``zmq.asyncio``)::

    sender = AsyncGroupSender(cfg.buffer.ingest_addr, actor_id, curve=client_curve_keys(cfg.buffer.curve, "actor"))
    grant = await sender.acquire(n=1, timeout_s=None)  # CreditGrant: waits until the buffer admits work
    ...generate grant.n groups with weights >= grant.learner_version...
    ack = await sender.send(group, timeout_s=None)     # IngestAck, returned only after the LMDB commit

Many tasks may ``acquire`` and ``send`` at once (that is how several groups are in flight).

- ``acquire(n, timeout_s)`` returns as soon as at least one credit is available: ``grant.n <= n`` is how
  many groups the caller may generate, ``grant.learner_version`` the learner's version at grant time
  (generate with weights at least that new and the groups will never be dropped as stale). Credits the
  buffer grants beyond what callers took are pooled and handed out by later ``acquire`` calls. The
  buffer counts a credit as used when a group with ``group.actor_id == actor_id`` arrives, so stamp
  groups with the sender's actor_id (unused credits stop counting after ``buffer.credit_ttl_s``).
  ``TimeoutError`` after ``timeout_s`` (``None`` = wait forever); ``ProtocolError`` when the buffer
  refuses the request (``ErrorReply`` with a ``buffer.credits.REFUSAL_REASONS`` reason: ``actor_key``, the
  id belongs to another CurveZMQ client key; ``too_many_actor_ids``; ``too_many_waiting``), so a refused
  actor stops with the reason instead of asking again forever; also ``role`` when the client key is not an
  actor's (then every ``send`` fails the same way).
- ``send(group, timeout_s)`` re-sends the same encoded frame (same group_id) every ``ack_timeout_s``
  without an ack, and after two silent intervals reconnects with a fresh socket; the buffer stores a
  group_id once, so a re-send is harmless. An ack with ``committed=False`` (buffer full, storage error)
  is retried after a short back-off. Returns the first ``IngestAck`` with ``committed=True``
  (``duplicate=True`` if a previous copy had already arrived; ``error`` non-empty when the buffer recorded
  the group but will not serve it: ``"stale"``, ``"filtered:uniform_reward"``), or an ack with
  ``committed=False`` and ``error`` starting ``"invalid:<reason>:"`` when the buffer refused the group as
  unusable (``common.limits``: empty prompt, token id past the vocabulary, reward out of range, ...): final,
  never stored, not re-sent. ``TimeoutError`` after
  ``timeout_s``; ``ProtocolError`` if the buffer answers ``ErrorReply`` (a frame it could not accept).
  ``resent`` counts re-sends (for ``vapo_actor_groups_resent``).

Learner (REQ -> the buffer's ROUTER (REP envelope) at ``buffer.serve_addr``; lazy pirate: a REQ socket that timed out is
closed and recreated)::

    client = BatchClient(cfg.buffer.serve_addr, curve=client_curve_keys(cfg.buffer.curve, "learner"))
    reply = client.get_batch(learner_version, n_groups, timeout_s)  # BatchReply, groups oldest first
    samples = client.positives(n)                                   # list[Sample], random, distinct
    reply, frame = client.get_batch_frame(learner_version, n_groups, timeout_s)  # plus the exact reply bytes
    samples, frame = client.positives_frame(n)                      # (to broadcast without re-encoding)
    stats = client.stats()                                          # dict[str, float]

``get_batch`` raises ``TimeoutError`` when the buffer had fewer than ``n_groups`` groups within
``timeout_s`` (nothing is consumed) or did not answer; it never re-sends a batch request by itself (a
lost reply after the buffer served would otherwise skip a batch), so callers loop.

A request whose connection drops while it waits is lost (a REQ socket does not re-send it over the new
connection), so waiting on for the full ``timeout_s + request_timeout_s`` would only cost time: a buffer
SIGKILLed and restarted under a waiting learner cost ~35 s. The client watches its socket's monitor for a
dropped connection (a dead peer is found by ZMTP heartbeats, ``HEARTBEAT_IVL_S`` / ``HEARTBEAT_TIMEOUT_S``,
when no FIN arrives) and then raises ``BufferConnectionLost`` (a ``TimeoutError``) at once; the caller's
next request goes to the restarted buffer. A long wait on a live connection is left alone.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq
import zmq.asyncio

from buffer.credits import REFUSAL_REASONS
from common.protocol import (
    BatchReply,
    BatchRequest,
    CreditGrant,
    CreditRequest,
    ErrorReply,
    IngestAck,
    PositivesReply,
    PositivesRequest,
    ProtocolError,
    Sample,
    SampleGroup,
    StatsReply,
    StatsRequest,
    decode,
    decode_as,
    encode,
)
from common.security import ClientKeys, apply_client_curve, close_monitor, open_monitor

INVALID = "invalid:"  # IngestAck.error prefix of a group the buffer refused as unusable (final, never stored)
_REPLY_MAX_BYTES = 1 << 40  # replies come from our own buffer; a 512-group batch exceeds 64 MiB
_RETRY_BACKOFF_S = 0.2


def _deadline(timeout_s: float | None) -> float:
    return float("inf") if timeout_s is None else time.monotonic() + timeout_s


def _dealer(ctx: zmq.Context, addr: str, curve: ClientKeys | None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.immediate = True  # never queue frames for a peer that is not connected: they would go stale
    s.sndhwm = 1000
    apply_client_curve(s, curve)
    s.connect(addr)
    return s


class AsyncGroupSender:
    """Sender of SampleGroups for one actor id (see module docstring); ``acquire``/``send`` may run
    concurrently from many tasks of one event loop."""

    def __init__(
        self,
        addr: str,
        actor_id: int,
        *,
        curve: ClientKeys | None = None,
        ack_timeout_s: float = 10.0,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.addr, self.actor_id, self.curve, self.ack_timeout_s = addr, actor_id, curve, ack_timeout_s
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.sock: Any = _dealer(self.ctx, addr, curve)
        self._generation = 0
        self._acks: dict[str, asyncio.Future[IngestAck]] = {}
        self._credits = 0
        self._refused: ProtocolError | None = None  # a credit refusal not yet raised by an acquire
        self._demand = 0
        self._cond: asyncio.Condition | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self.learner_version = 0
        self.resent = 0
        self.reconnects = 0

    def _ensure_reader(self) -> None:
        if self._cond is None:
            self._cond = asyncio.Condition()
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop(self.sock))

    async def _read_loop(self, sock: Any) -> None:
        while not self._closed:
            try:
                frame = await sock.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                msg = decode(frame, _REPLY_MAX_BYTES)
            except ProtocolError:
                continue  # a garbled reply: the affected send will time out and re-send
            if isinstance(msg, IngestAck):
                fut = self._acks.get(msg.group_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, CreditGrant):
                assert self._cond is not None
                async with self._cond:
                    self._credits += msg.n
                    self.learner_version = max(self.learner_version, msg.learner_version)
                    self._cond.notify_all()
            elif isinstance(msg, ErrorReply) and (msg.reason in REFUSAL_REASONS or msg.reason == "role"):
                assert self._cond is not None
                async with self._cond:
                    self._refused = ProtocolError("remote", f"credit refused: {msg.reason}: {msg.message}")
                    self._cond.notify_all()
                if msg.reason == "role":  # this key may not ingest at all: every send fails too
                    self._fail_sends(ProtocolError("remote", f"{msg.reason}: {msg.message}"))
            elif isinstance(msg, ErrorReply):
                self._fail_sends(ProtocolError("remote", f"{msg.reason}: {msg.message}"))

    def _fail_sends(self, err: ProtocolError) -> None:
        for fut in self._acks.values():
            if not fut.done():
                fut.set_exception(err)

    async def _reconnect(self, generation: int) -> None:
        if generation != self._generation:
            return  # another task already reconnected
        self._generation += 1
        old = self.sock
        self.sock = _dealer(self.ctx, self.addr, self.curve)
        if self._reader is not None:
            self._reader.cancel()
        old.close(linger=0)
        self._reader = asyncio.get_running_loop().create_task(self._read_loop(self.sock))
        self.reconnects += 1

    async def _send_frame(self, frame: bytes, deadline: float) -> None:
        while True:
            try:
                await self.sock.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"cannot reach {self.addr}") from None
                await asyncio.sleep(0.05)  # not connected yet: poll again (no event exists for it)

    @property
    def credits(self) -> int:
        return self._credits

    async def acquire(self, n: int = 1, timeout_s: float | None = None) -> CreditGrant:
        """Wait until the buffer grants credit; returns a CreditGrant with 1 <= grant.n <= n."""
        if n < 1:
            raise ValueError("acquire needs n >= 1")
        self._ensure_reader()
        assert self._cond is not None
        deadline = _deadline(timeout_s)
        self._demand += n
        try:
            last_req = -float("inf")
            async with self._cond:
                while self._credits == 0:
                    if self._refused is not None:
                        err, self._refused = self._refused, None
                        raise err
                    now = time.monotonic()
                    if now >= deadline:
                        raise TimeoutError(f"no credit from {self.addr} within {timeout_s} s")
                    if now - last_req >= self.ack_timeout_s:
                        await self._send_frame(encode(CreditRequest(actor_id=self.actor_id, n=self._demand)), deadline)
                        last_req = now
                    try:
                        await asyncio.wait_for(self._cond.wait(), min(self.ack_timeout_s, deadline - now))
                    except TimeoutError:
                        pass
                k = min(n, self._credits)
                self._credits -= k
                return CreditGrant(n=k, learner_version=self.learner_version)
        finally:
            self._demand -= n
            if self._demand == 0 and self._credits == 0 and time.monotonic() >= deadline:
                try:
                    await self.sock.send(encode(CreditRequest(actor_id=self.actor_id, n=0)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    async def send(self, group: SampleGroup, timeout_s: float | None = None) -> IngestAck:
        """Send one group; returns its committed IngestAck (see module docstring)."""
        self._ensure_reader()
        frame = encode(group)
        deadline = _deadline(timeout_s)
        gid = group.group_id
        silent = 0
        try:
            while True:
                fut: asyncio.Future[IngestAck] = asyncio.get_running_loop().create_future()
                self._acks[gid] = fut
                generation = self._generation
                await self._send_frame(frame, deadline)
                wait = min(self.ack_timeout_s, deadline - time.monotonic())
                try:
                    ack = await asyncio.wait_for(fut, max(wait, 0.0))
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"group {gid} unacknowledged by {self.addr} after {timeout_s} s") from None
                    silent += 1
                    self.resent += 1
                    if silent >= 2:
                        await self._reconnect(generation)
                        silent = 0
                    continue
                if ack.committed or ack.error.startswith(INVALID):
                    return ack  # stored, or refused for good: re-sending the same group cannot help
                await asyncio.sleep(_RETRY_BACKOFF_S)  # full / storage error: back off, then re-send
                self.resent += 1
        finally:
            self._acks.pop(gid, None)

    async def close(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()

    async def __aenter__(self) -> AsyncGroupSender:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


HEARTBEAT_IVL_S = 1.0  # ZMTP PING interval on the learner's connection
HEARTBEAT_TIMEOUT_S = 4.0  # no traffic for this long: the connection is dropped (a buffer host gone silent)


class BufferConnectionLost(TimeoutError):
    """The connection dropped while a request waited: its reply can never come; ask again."""


class BufferStorageFailed(TimeoutError):
    """The buffer could not commit the take (a full disk, a file size limit): nothing was served, ask again.

    A ``TimeoutError`` so that a learner waiting for a batch keeps asking until its own deadline, as for a
    batch not ready yet, instead of stopping the run on a disk that is full for a while.
    """


class BatchClient:
    """The learner's REQ client of the buffer's serve socket (lazy pirate)."""

    def __init__(
        self,
        addr: str,
        *,
        curve: ClientKeys | None = None,
        request_timeout_s: float = 30.0,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.addr, self.curve, self.request_timeout_s = addr, curve, request_timeout_s
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self.connections_lost = 0  # requests given up because their connection dropped

    def _socket(self) -> zmq.Socket:
        if self.sock is None:
            s = self.ctx.socket(zmq.REQ)
            s.linger = 0
            s.heartbeat_ivl = int(HEARTBEAT_IVL_S * 1000)
            s.heartbeat_timeout = int(HEARTBEAT_TIMEOUT_S * 1000)
            apply_client_curve(s, self.curve)
            self._monitor = open_monitor(s, zmq.EVENT_DISCONNECTED)
            s.connect(self.addr)
            self.sock = s
        return self.sock

    def _drop(self) -> None:
        if self.sock is not None:
            if self._monitor is not None:
                close_monitor(self.sock, self._monitor)
                self._monitor = None
            self.sock.close(linger=0)
            self.sock = None

    def _dropped(self) -> bool:
        """Whether the connection dropped since the last call (drains the monitor)."""
        lost = False
        while self._monitor is not None and self._monitor.poll(0):
            self._monitor.recv_multipart()  # only EVENT_DISCONNECTED is subscribed
            lost = True
        return lost

    def _wait_reply(self, s: zmq.Socket, timeout_s: float) -> bytes | None:
        """The reply, or None after ``timeout_s``; ``BufferConnectionLost`` as soon as the connection drops."""
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        assert self._monitor is not None
        poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(left * 1000) + 1))
            if s in events:
                return s.recv()
            if self._monitor in events and self._dropped():
                self.connections_lost += 1
                raise BufferConnectionLost(f"connection to the buffer at {self.addr} dropped while a request "
                                           "waited (buffer restarted?); ask again")
        return None

    def _request(self, frame: bytes, timeout_s: float, retries: int) -> bytes:
        for attempt in range(retries + 1):
            s = self._socket()
            s.sndtimeo = int(timeout_s * 1000)  # no peer (e.g. a refused CURVE handshake) makes send block
            self._dropped()  # a drop before this request (a restart between requests) costs it nothing
            try:
                s.send(frame)
                reply = self._wait_reply(s, timeout_s)
                if reply is not None:
                    return reply
            except zmq.Again:
                pass
            except BufferConnectionLost:
                self._drop()
                if attempt == retries:
                    raise
                continue
            self._drop()  # a REQ socket that missed its reply is stuck: recreate it
        raise TimeoutError(f"buffer at {self.addr} did not answer within {timeout_s} s")

    def get_batch_frame(self, learner_version: int, n_groups: int, timeout_s: float) -> tuple[BatchReply, bytes]:
        """``get_batch`` plus the exact reply frame (a multi-rank learner broadcasts it instead of re-encoding)."""
        req = BatchRequest(learner_version=learner_version, n_groups=n_groups, timeout_ms=int(timeout_s * 1000))
        raw = self._request(encode(req), timeout_s + self.request_timeout_s, retries=0)
        msg = decode(raw, _REPLY_MAX_BYTES)
        if isinstance(msg, ErrorReply):
            if msg.reason == "timeout":
                raise TimeoutError(f"buffer: {msg.message}")
            if msg.reason == "storage":  # the take's transaction aborted: no group left the buffer
                raise BufferStorageFailed(f"buffer: {msg.message}")
            raise ProtocolError("remote", f"{msg.reason}: {msg.message}")
        if not isinstance(msg, BatchReply):
            raise ProtocolError("unexpected_type", f"expected BatchReply, got {msg.TYPE}")
        return msg, raw

    def get_batch(self, learner_version: int, n_groups: int, timeout_s: float) -> BatchReply:
        """``n_groups`` groups with weight_version >= learner_version - max_staleness, oldest first."""
        return self.get_batch_frame(learner_version, n_groups, timeout_s)[0]

    def positives_frame(self, n: int) -> tuple[list[Sample], bytes]:
        """``positives`` plus the exact ``PositivesReply`` frame they were decoded from."""
        raw = self._request(encode(PositivesRequest(n=n)), self.request_timeout_s, retries=2)
        return decode_as(raw, PositivesReply, _REPLY_MAX_BYTES).samples, raw

    def positives(self, n: int) -> list[Sample]:
        """Up to ``n`` distinct stored positives, chosen at random by the buffer."""
        return self.positives_frame(n)[0]

    def stats(self, retries: int = 2) -> dict[str, float]:
        """The buffer's counters; ``retries`` more tries after a timeout (0: one try, as a health probe wants)."""
        raw = self._request(encode(StatsRequest()), self.request_timeout_s, retries=retries)
        return decode_as(raw, StatsReply, _REPLY_MAX_BYTES).stats

    def close(self) -> None:
        self._drop()
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["AsyncGroupSender", "BatchClient", "BufferConnectionLost"]
