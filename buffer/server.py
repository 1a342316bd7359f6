"""The buffer server: actors push groups, the learner pulls batches (messages: common/protocol.py).

Launch: ``python -m buffer [config.yaml] [key=value ...]`` (sections ``buffer`` and ``learner``).
On start it prints one line ``BUFFER READY {json}`` (addresses, metrics port, pid) to stdout.

Sockets (one thread, one ``zmq.Poller``):

- ``buffer.ingest_addr`` (ROUTER) — actors' DEALERs send ``SampleGroup`` and ``CreditRequest`` frames.
  Groups arriving together (up to ``buffer.commit_batch``) are written in one LMDB transaction and each is
  answered ``IngestAck(committed=True)`` only after that commit. A re-sent group_id is acknowledged again
  (``duplicate=True``) and stored once. ``IngestAck.error`` is ``""`` when the group was stored,
  ``"stale"`` / ``"filtered:uniform_reward"`` when it was recorded but will never be served (still
  ``committed=True``: do not re-send), and ``"full: ..."`` / ``"storage: ..."`` with ``committed=False``
  when it was not stored (re-send later).
- ``buffer.serve_addr`` (ROUTER; clients are REQ sockets, so the wire is what a REP socket spoke) — the
  learner sends ``BatchRequest(learner_version, n_groups, timeout_ms)``: groups with
  ``weight_version < learner_version - max_staleness`` are deleted and counted, then the ``n_groups``
  oldest (weight version, then arrival) are removed and sent as one ``BatchReply``. If fewer than
  ``n_groups`` arrive within ``timeout_ms`` the reply is ``ErrorReply(reason="timeout")`` and nothing is
  taken (never a partial batch: a learner step always sees exactly ``n_groups``). A waiting batch request
  sits in a wait list served by the event loop, so every other request (stats, positives, another batch)
  is answered meanwhile, and a waiting request whose connection closes is dropped (it can no longer
  swallow groups). ``n_groups`` above ``buffer.max_batch_groups`` or ``buffer.capacity_groups`` and
  ``timeout_ms`` above ``buffer.max_batch_wait_s`` are refused at once (``bad_request``, naming the field
  and the key). Also ``PositivesRequest(n)`` (up to n distinct stored positives, random) and
  ``StatsRequest`` (counters as ``StatsReply``).

The learner version is durable and only the learner should move it: every group older than it minus
``max_staleness`` is dropped for good. A ``BatchRequest`` may raise it at most
``buffer.learner_version_max_step`` past ``served_version``, the learner version that the last full
learner batch served (``n_groups >= learner.batch_groups``) was requested with. The honest learner asks
for version v+1 only after its batch at v was served, so another client can run at most that step ahead
of it. Anything higher is refused (``ErrorReply(reason="learner_version")``) and nothing is recorded. A
version below the stored one is served under the stored one (a learner resumed from an older checkpoint).
``python -m buffer.inspect PATH --set-learner-version N`` repairs it while the server is stopped.

Admission control (AReaL's staleness bound): an actor asks ``CreditRequest(actor_id, n)`` — "I want n
more groups' worth of credit" (replaces any earlier waiting request of that actor; n = 0 withdraws it)
— and generates only after a ``CreditGrant``. AReaL admits while
``(max_staleness + version + 1) * batch_groups - (accepted + running) > 0``. Here ``version * batch_groups``
is counted as the groups the learner has consumed (plus the batch it is waiting for), not the version
number it reports, so ``accepted - consumed = depth``::

    capacity = max_staleness * batch_groups + (largest n_groups of the waiting BatchRequests, else 0)
               - (groups waiting in LMDB + credits in flight)

also capped by ``buffer.capacity_groups`` / ``capacity_bytes``. Grants are deferred while capacity is
zero. Counting consumption instead of the reported version keeps the bound right when the learner takes
several batches per version (value pretraining) or resumes from an older checkpoint; with
``max_staleness = 0`` actors work only while the learner waits, which makes the system synchronous.
Every term is durable or re-derivable after a restart (AReaL bug #1388): depth, totals and the learner
version are LMDB counters; credits in flight restart at zero (groups from old grants still count when
they arrive), and a grant not used within ``buffer.credit_ttl_s`` stops counting. A grant carries the
learner version: actors that generate with weights at least that new never produce stale groups.

No actor id holds more than ``buffer.max_credit_per_actor`` unused credits and no ingest connection more
than ``buffer.max_credit_per_connection`` across its actor ids, so a client inventing actor ids cannot
take all capacity. A connection that closes gives back its unused credit at once (the socket monitor
reports the closed descriptor, and every frame carries the descriptor it came on). With CurveZMQ an actor
id belongs to the first client key that asks credit for it (until the buffer restarts); another key
asking for it is refused (``actor_key``).

Bad frames on either socket are counted in ``vapo_buffer_rejected_frames{reason}`` (``ProtocolError``
reason, ``multipart``, ``unexpected_type``), answered with ``ErrorReply``, and the server keeps serving.
Frames larger than 4 x ``buffer.max_frame_bytes`` are cut off by ZeroMQ itself (connection dropped).

Threads: the main thread owns every socket and validates frames; one writer thread runs each batch's LMDB
transaction (page writes and fsync release the GIL), so validation of the next batch overlaps the commit
of the previous one. The main thread touches LMDB only while the writer is idle.

Deviations: groups are deleted from LMDB when served (a learner crash loses at most its in-flight batch;
the learner checkpoints its own progress); the DAPO uniform-reward filter runs at ingest, not at serve
time, so filtered groups never take space; positives are harvested from every new group (also stale or
filtered ones: NLL replay is off-policy by design).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import signal
import sys
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from buffer.store import (
    FILTERED,
    STALE,
    STORED,
    BufferStore,
    GroupRecord,
    StorageError,
    lock_server,
    positive_hash,
    unlock_server,
)
from common.config import Config
from common.metrics import Metrics
from common.protocol import (
    BatchRequest,
    CreditGrant,
    CreditRequest,
    ErrorReply,
    IngestAck,
    PositivesRequest,
    ProtocolError,
    SampleGroup,
    StatsReply,
    StatsRequest,
    decode,
    encode,
    encode_batch_reply,
    encode_positives_reply,
    sample_frames,
)
from common.security import server_curve

log = logging.getLogger("vapo.buffer")
_MAX_WAITING = 1 << 16  # actors with a deferred credit request
_MAX_BATCH_WAITS = 1024  # batch requests waiting at once (one per serve connection); the oldest is evicted


class _Peers:
    """Which ROUTER identities arrived over which connection, so the state of a closed one can be dropped.

    libzmq without its draft API never tells a ROUTER that a peer left. Its socket monitor reports the file
    descriptor of a closed connection, and every received frame carries the descriptor it came on
    (``ZMQ_SRCFD``), which links the two. libzmq queues the disconnect event before it closes the
    descriptor, so draining the monitor before reading data (``gone`` first in every loop turn) never
    mistakes a new connection that reuses the number for the old one.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._fd_of: dict[bytes, int] = {}
        self._ids_on: dict[int, set[bytes]] = {}

    def seen(self, ident: bytes, frame: zmq.Frame) -> None:
        try:
            fd = int(frame.get(zmq.SRCFD))
        except zmq.ZMQError:
            return
        if fd < 0:
            return  # inproc: no descriptor, and no peer that can vanish without its context
        old = self._fd_of.get(ident)
        if old == fd:
            return
        if old is not None:
            self._ids_on.get(old, set()).discard(ident)
        self._fd_of[ident] = fd
        self._ids_on.setdefault(fd, set()).add(ident)

    def gone(self) -> list[bytes]:
        out: list[bytes] = []
        while self.monitor.poll(0):
            ev = recv_monitor_message(self.monitor)
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                for ident in self._ids_on.pop(int(ev["value"]), ()):
                    self._fd_of.pop(ident, None)
                    out.append(ident)
        return out

    def close(self) -> None:
        self.monitor.close(linger=0)


class _BatchWait:
    """One BatchRequest waiting for groups: who asked (ROUTER identity + REQ envelope) and until when."""

    __slots__ = ("ident", "envelope", "req", "deadline")

    def __init__(self, ident: bytes, envelope: list[bytes], req: Any, deadline: float) -> None:
        self.ident, self.envelope, self.req, self.deadline = ident, envelope, req, deadline


def admission_capacity(max_staleness: int, batch_groups: int, pending_n: int, depth: int, in_flight: int) -> int:
    """Groups that may still be admitted (see module docstring); may be negative."""
    return max_staleness * batch_groups + pending_n - depth - in_flight


class _Writer:
    """One thread that runs ``store.put_groups`` for a batch while the main thread validates the next.

    LMDB commits (page writes + fsync) release the GIL, so decoding overlaps the disk. The main thread
    touches LMDB only while the writer is idle (``BufferServer._wait_writer``); sockets stay on the main
    thread, which is woken through an inproc PAIR socket.
    """

    def __init__(self, store: BufferStore, ctx: zmq.Context) -> None:
        self.store = store
        self.ctx = ctx
        self.addr = f"inproc://buffer-writer-{id(self)}"
        self.notify = ctx.socket(zmq.PAIR)
        self.notify.bind(self.addr)
        self.batch: list[tuple[GroupRecord, tuple[bytes, str, int]]] = []
        self.busy = False
        self._jobs: queue.Queue[tuple[list[Any], dict[str, int]] | None] = queue.Queue(maxsize=1)
        self._done: deque[tuple[list[Any], dict[str, int], Any, Any]] = deque()
        self._thread = threading.Thread(target=self._run, name="buffer-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        out = self.ctx.socket(zmq.PAIR)
        out.connect(self.addr)
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                batch, before = job
                try:
                    results, err = self.store.put_groups([r for r, _ in batch]), None
                except StorageError as e:
                    results, err = None, e
                except Exception as e:  # never let the writer die silently: report it as a storage error
                    log.exception("writer failed")
                    results, err = None, StorageError("internal", repr(e))
                self._done.append((batch, before, results, err))
                out.send(b"")
        finally:
            out.close(linger=0)

    def submit(self, batch: list[Any], before: dict[str, int]) -> None:
        assert not self.busy
        self.busy = True
        self.batch = batch
        self._jobs.put((batch, before))

    def wait(self) -> None:
        self.notify.poll()  # blocks until the commit in progress is done

    def collect(self) -> list[tuple[list[Any], dict[str, int], Any, Any]]:
        out = []
        while self.notify.poll(0):
            self.notify.recv()
            out.append(self._done.popleft())
            self.busy = False
            self.batch = []
        return out

    def stop(self) -> None:
        if self._thread.is_alive():
            if self.busy:
                self.wait()
                self.collect()
            self._jobs.put(None)
            self._thread.join(timeout=30)


class BufferServer:
    """Owns the store and both sockets; ``run()`` serves until ``stop()``."""

    def __init__(self, cfg: Config, metrics: Metrics | None = None) -> None:
        b = cfg.buffer
        self.cfg = cfg
        self.k = b.max_staleness
        self.batch_groups = cfg.learner.batch_groups
        self.max_frame = b.max_frame_bytes
        self.m = metrics or Metrics("buffer")
        self.credit_per_actor = b.max_credit_per_actor or 2 * cfg.actors.prompts_in_flight
        self.credit_per_conn = b.max_credit_per_connection or self.credit_per_actor
        self.max_batch_groups = min(b.max_batch_groups, b.capacity_groups)
        self._lock_fd = lock_server(cfg.buffer_path)  # one server per directory; an offline repair waits
        try:
            self.store = BufferStore(
                cfg.buffer_path, map_size=b.map_size_bytes, max_map_size=b.max_map_size_bytes,
                positives_capacity=b.positives_capacity, on_commit=self.m.commit_latency_seconds.observe,
            )
        except BaseException:
            unlock_server(self._lock_fd)
            raise
        self.ctx = zmq.Context()
        try:
            self.curve = server_curve(self.ctx, [b.ingest_addr, b.serve_addr], b.curve)
        except Exception:
            self.store.close()
            self.ctx.term()
            unlock_server(self._lock_fd)
            raise
        self.ingest = self._socket(zmq.ROUTER, b.ingest_addr)
        self.serve = self._socket(zmq.ROUTER, b.serve_addr)
        self.ingest_peers = _Peers(self.ingest)
        self.serve_peers = _Peers(self.serve)
        self.writer = _Writer(self.store, self.ctx)
        self._next: list[tuple[GroupRecord, tuple[bytes, str, int]]] = []  # validated, waiting for a commit
        self._stop = threading.Event()
        self._rng = random.Random(cfg.run.seed)
        # Admission state (in memory by design: see module docstring).
        self._in_flight: dict[int, deque[list[float]]] = {}  # actor_id -> [[expiry, count], ...]
        self._waiting: OrderedDict[int, tuple[bytes, int]] = OrderedDict()  # actor_id -> (identity, n)
        self._credit_holder: dict[int, bytes] = {}  # actor_id -> identity its in-flight credits were granted to
        self._actors_of: dict[bytes, set[int]] = {}  # ingest identity -> actor ids it holds or waits credit for
        self._actor_key: dict[int, str] = {}  # actor_id -> CURVE client key that owns it (CurveZMQ only)
        self._credit_released = 0  # credits given back because their connection closed
        self._waits: dict[bytes, _BatchWait] = {}  # serve identity -> its waiting BatchRequest, oldest first
        self._waits_abandoned = 0
        self._dropped_since_reply = 0
        self._filtered_since_reply = 0
        self._rejected: dict[str, int] = {}
        self._timeouts = 0
        self._storage_errors = 0
        self._ingest_commits = 0
        self._last_gauges = 0.0
        self._depth_changed = True
        self._update_gauges(force=True)
        c = self.store.counters
        log.info("buffer at %s: %d groups waiting (versions %d..%d), %d positives, learner version %d",
                 cfg.buffer_path, c["depth_groups"], self.store.min_version(), self.store.max_version(),
                 self.store.positives_count, c["learner_version"])

    def _socket(self, kind: int, addr: str) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.linger = 0
        s.maxmsgsize = 4 * self.max_frame
        s.sndhwm = 10000
        s.rcvhwm = 10000
        self.curve.apply(s)
        try:
            s.bind(addr)
        except zmq.ZMQError as e:
            s.close()
            raise OSError(f"cannot bind {addr}: {e}") from None
        return s

    # ------------------------------------------------------------------ properties

    @property
    def learner_version(self) -> int:
        return self.store.counters["learner_version"]

    @property
    def in_flight(self) -> int:
        return int(sum(c for q in self._in_flight.values() for _, c in q))

    def capacity(self) -> int:
        c = self.store.counters
        pending_n = max((w.req.n_groups for w in self._waits.values()), default=0)
        adm = admission_capacity(self.k, self.batch_groups, pending_n, c["depth_groups"], self.in_flight)
        room = self.cfg.buffer.capacity_groups - c["depth_groups"] - self.in_flight
        if c["depth_bytes"] >= self.cfg.buffer.capacity_bytes:
            room = 0
        return max(0, min(adm, room))

    # ------------------------------------------------------------------ loop

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.writer.notify, self.serve, self.ingest_peers.monitor, self.serve_peers.monitor):
            poller.register(sock, zmq.POLLIN)
        registered = {self.ingest: False}
        try:
            while not self._stop.is_set():
                try:
                    self._turn(poller, registered)
                except Exception as e:
                    # A bug must not take the buffer down: log, count, answer the waiting requests, carry on.
                    log.exception("unexpected error in the buffer loop")
                    self.m.storage_errors.labels(reason="internal").inc()
                    waits, self._waits = list(self._waits.values()), {}
                    for w in waits:
                        self._reply(w.ident, w.envelope, encode(ErrorReply(reason="internal", message=repr(e)[:4000])))
            self._wait_writer()
        finally:
            self.close()

    def _turn(self, poller: zmq.Poller, registered: dict[zmq.Socket, bool]) -> None:
        # Stop reading ingest while the next batch is full (the ZeroMQ queues push back on senders).
        on = len(self._next) < self.cfg.buffer.commit_batch
        if on != registered[self.ingest]:
            (poller.register(self.ingest, zmq.POLLIN) if on else poller.unregister(self.ingest))
            registered[self.ingest] = on
        timeout_ms = 100.0
        if self._waits:
            first = min(w.deadline for w in self._waits.values())
            timeout_ms = max(0.0, min(timeout_ms, (first - time.monotonic()) * 1000))
        events = dict(poller.poll(timeout_ms))
        self._drop_gone()  # before reading data: see _Peers
        if self.writer.notify in events:
            self._collect_writer()
        if self.ingest in events:
            self._drain_ingest()
        if self._next and not self.writer.busy:
            self._submit()
        if self.serve in events:
            self._drain_serve()
        if self._waits:
            self._try_serve()
        self._expire_credits()
        self._grant_credits()
        self._update_gauges()

    def close(self) -> None:
        self.writer.stop()
        self.ingest_peers.close()
        self.serve_peers.close()
        for s in (self.ingest, self.serve, self.writer.notify):
            if not s.closed:
                s.close(linger=0)
        self.curve.stop()
        self.ctx.term()
        self.store.close()
        unlock_server(self._lock_fd)

    def _drop_gone(self) -> None:
        """Forget the state of connections that closed: their credit and their waiting batch requests."""
        for ident in self.ingest_peers.gone():
            self._release_connection(ident)
        for ident in self.serve_peers.gone():
            if self._waits.pop(ident, None) is not None:
                self._waits_abandoned += 1
                log.info("a client left while its batch request waited: dropped the request")

    # ------------------------------------------------------------------ ingest

    def _reject(self, reason: str, message: str) -> bytes:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        self.m.rejected_frames.labels(reason=reason).inc()
        return encode(ErrorReply(reason=reason, message=message[:4000]))

    def _drain_ingest(self) -> None:
        """Read, validate and queue groups for the next commit; answer everything else at once."""
        credit_msgs: list[tuple[bytes, Any, str | None]] = []
        lv, pos_reward = self.learner_version, self.cfg.buffer.positive_reward
        for _ in range(4 * self.cfg.buffer.commit_batch):
            if len(self._next) >= self.cfg.buffer.commit_batch:
                break
            try:
                parts = self.ingest.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            ident, body = parts[0].bytes, parts[1:]
            if body:
                self.ingest_peers.seen(ident, body[-1])
            if len(body) != 1:
                self._send_ingest(ident, self._reject("multipart", f"expected 1 frame, got {len(body)}"))
                continue
            frame = body[0].buffer  # zero-copy view; LMDB copies it once, into the page
            try:
                msg = decode(frame, self.max_frame)
            except ProtocolError as e:
                self._send_ingest(ident, self._reject(e.reason, str(e)))
                continue
            if isinstance(msg, CreditRequest):
                credit_msgs.append((ident, msg, self._client_key(body[0])))
                continue
            if not isinstance(msg, SampleGroup):
                self._send_ingest(ident, self._reject("unexpected_type", f"{msg.TYPE} not accepted on ingest"))
                continue
            rec = self._record(msg, frame, lv, pos_reward)
            if rec.fate == STORED and not self._has_room(len(frame)):
                self._wait_writer()
                if not self._has_room(len(frame)) and self._known(msg.group_id) is None:
                    self._send_ingest(ident, encode(IngestAck(
                        group_id=msg.group_id, committed=False, duplicate=False,
                        error=f"full: {self.store.counters['depth_groups']} groups waiting")))
                    continue
            self._next.append((rec, (ident, msg.group_id, msg.actor_id)))
        for ident, req, key in credit_msgs:
            self._on_credit_request(ident, req, key)

    def _client_key(self, frame: zmq.Frame) -> str | None:
        """The sender's CURVE public key (ZAP User-Id, z85) when CurveZMQ is on, else None."""
        if not self.curve.enabled:
            return None
        try:
            return frame.get("User-Id") or None
        except zmq.ZMQError:
            return None

    def _submit(self) -> None:
        batch, self._next = self._next, []
        self.m.ingested_groups.inc(len(batch))
        self.writer.submit(batch, dict(self.store.counters))

    def _wait_writer(self) -> None:
        """Finish the commit in progress; every main-thread LMDB access goes through here first.

        Nothing is submitted again until the main loop's next turn, so the caller has LMDB to itself.
        """
        while self.writer.busy:
            self.writer.wait()
            self._collect_writer()

    def _collect_writer(self) -> None:
        for batch, before, results, err in self.writer.collect():
            self._finish(batch, before, results, err)

    def _record(self, g: SampleGroup, frame: bytes, lv: int, pos_reward: float) -> GroupRecord:
        positives: list[tuple[bytes, bytes]] = []
        if any(s.reward >= pos_reward for s in g.samples):
            # Stored as the exact bytes they arrived in: cut out of the frame, not encoded again.
            frames = sample_frames(frame)
            positives = [(positive_hash(s.prompt_ids, s.output_ids), f)
                         for s, f in zip(g.samples, frames, strict=True) if s.reward >= pos_reward]
        fate = STORED
        if g.weight_version < lv - self.k:
            fate = STALE
        elif self.cfg.buffer.filter_uniform_groups and len({s.reward for s in g.samples}) == 1:
            fate = FILTERED
        return GroupRecord(g.group_id, frame, g.weight_version, len(g.samples), positives, fate)

    def _has_room(self, nbytes: int) -> bool:
        c = self.store.counters
        new = [r for r, _ in self._next + self.writer.batch if r.fate == STORED]
        groups = c["depth_groups"] + len(new)
        size = c["depth_bytes"] + sum(len(r.frame) for r in new) + nbytes
        return groups < self.cfg.buffer.capacity_groups and size <= self.cfg.buffer.capacity_bytes

    def _known(self, group_id: str) -> bytes | None:
        self._wait_writer()
        with self.store.env.begin() as txn:
            return txn.get(group_id.encode(), db=self.store.gindex)

    def _finish(self, batch: list[tuple[GroupRecord, tuple[bytes, str, int]]], before: dict[str, int],
                results: list[tuple[str, bool]] | None, err: StorageError | None) -> None:
        """Acknowledge a batch whose transaction has committed (or report its storage error)."""
        if err is not None or results is None:
            self._storage_errors += 1
            reason = err.reason if err is not None else "unknown"
            self.m.storage_errors.labels(reason=reason).inc()
            log.error("storage error, %d groups not stored (senders will retry): %s", len(batch), err)
            for _, (ident, gid, _) in batch:
                self._send_ingest(ident, encode(IngestAck(
                    group_id=gid, committed=False, duplicate=False, error=f"storage: {err}"[:4000])))
            return
        self._ingest_commits += 1
        after = self.store.counters
        for (_, (ident, gid, actor_id)), (outcome, dup) in zip(batch, results, strict=True):
            if not dup:
                self._consume_credit(actor_id)
            note = "" if outcome == "stored" else ("filtered:uniform_reward" if outcome == "filtered" else outcome)
            self._send_ingest(ident, encode(IngestAck(group_id=gid, committed=True, duplicate=dup, error=note)))
        self.m.acked_groups.inc(len(batch))
        self.m.duplicate_groups.inc(after["duplicates"] - before["duplicates"])
        n_filtered = after["filtered"] - before["filtered"]
        if n_filtered:
            self.m.filtered_groups.labels(reason="uniform_reward").inc(n_filtered)
            self._filtered_since_reply += n_filtered
        n_stale = after["stale_dropped"] - before["stale_dropped"]
        if n_stale:
            self.m.stale_dropped_groups.inc(n_stale)
            self._dropped_since_reply += n_stale
        self.m.positives_duplicates.inc(after["positives_duplicates"] - before["positives_duplicates"])
        self.m.positives_evicted.inc(after["positives_evicted"] - before["positives_evicted"])
        self._depth_changed = True

    def _send_ingest(self, ident: bytes, frame: bytes) -> None:
        try:
            self.ingest.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("ingest reply queue full; dropping a reply (the sender will re-send)")

    # ------------------------------------------------------------------ credits

    def _on_credit_request(self, ident: bytes, req: Any, key: str | None = None) -> None:
        if key is not None:
            owner = self._actor_key.setdefault(req.actor_id, key)
            if owner != key:
                # The actor id's credits (and the groups that use them) belong to another client: refuse.
                self._send_ingest(ident, self._reject(
                    "actor_key", f"actor_id {req.actor_id} is bound to another client key (CurveZMQ)"))
                return
        waiting = self._waiting.get(req.actor_id)
        if waiting is not None and waiting[0] == ident:
            del self._waiting[req.actor_id]
        elif waiting is not None and req.n == 0:
            return  # a withdrawal from another connection does not cancel this one's request
        holder = self._credit_holder.get(req.actor_id)
        if holder is not None and holder != ident and self._in_flight.get(req.actor_id):
            # A new connection for this actor id means the old process died or reset its socket: its
            # unused grants would otherwise block admission until credit_ttl_s (a restarted actor that
            # gets no credit is a deadlock). Groups from those grants are still accepted if they arrive.
            log.info("actor %d reconnected: releasing %d unused credits of its previous connection",
                     req.actor_id, sum(g for _, g in self._in_flight[req.actor_id]))
            self._in_flight[req.actor_id].clear()
        if req.n == 0:
            return
        mine = self._live_actors(ident)
        if req.actor_id not in mine and len(mine) >= self.credit_per_conn:
            # Each waiting actor id needs at least one credit: more ids than the connection may hold
            # credits for can only be a client inventing ids.
            self._send_ingest(ident, self._reject(
                "too_many_actor_ids", f"this connection already asks credit for {len(mine)} actor ids "
                f"(buffer.max_credit_per_connection={self.credit_per_conn})"))
            return
        if len(self._waiting) >= _MAX_WAITING:  # bound memory against a flood of made-up actor ids
            self._send_ingest(ident, self._reject("too_many_waiting", f"{_MAX_WAITING} actors already wait"))
            return
        if waiting is not None and waiting[0] != ident:
            del self._waiting[req.actor_id]  # the actor id moved to this connection
        self._credit_holder[req.actor_id] = ident
        mine.add(req.actor_id)
        self._waiting[req.actor_id] = (ident, req.n)
        if self.capacity() < req.n:
            self.m.admission_waits.inc()

    def _live_actors(self, ident: bytes) -> set[int]:
        """The actor ids of a connection that still wait for or hold credit there (pruned in place)."""
        ids = self._actors_of.setdefault(ident, set())
        for a in list(ids):
            w = self._waiting.get(a)
            if not ((w is not None and w[0] == ident) or (self._credit_holder.get(a) == ident and self._in_flight.get(a))):
                ids.discard(a)
        return ids

    def _actor_credit(self, actor_id: int) -> int:
        return int(sum(c for _, c in self._in_flight.get(actor_id, ())))

    def _conn_credit(self, ident: bytes) -> int:
        return sum(self._actor_credit(a) for a in self._actors_of.get(ident, ())
                   if self._credit_holder.get(a) == ident)

    def _release_connection(self, ident: bytes) -> None:
        """A closed ingest connection: its unused credit and waiting requests stop counting now."""
        released = 0
        for a in self._actors_of.pop(ident, set()):
            w = self._waiting.get(a)
            if w is not None and w[0] == ident:
                del self._waiting[a]
            if self._credit_holder.get(a) == ident:
                released += self._actor_credit(a)
                self._in_flight.pop(a, None)
                del self._credit_holder[a]
        if released:
            self._credit_released += released
            log.info("an ingest connection closed: released its %d unused credits", released)

    def _grant_credits(self) -> None:
        if not self._waiting:
            return
        cap = self.capacity()
        now = time.monotonic()
        for actor_id in list(self._waiting):
            if cap <= 0:
                break
            ident, n = self._waiting[actor_id]
            room = min(self.credit_per_actor - self._actor_credit(actor_id),
                       self.credit_per_conn - self._conn_credit(ident))
            g = min(n, cap, room)
            if g <= 0:
                continue  # at its bound: waits (in place) until its groups arrive or its credit expires
            del self._waiting[actor_id]
            cap -= g
            self._send_ingest(ident, encode(CreditGrant(n=g, learner_version=self.learner_version)))
            self._in_flight.setdefault(actor_id, deque()).append([now + self.cfg.buffer.credit_ttl_s, g])
            self._credit_holder[actor_id] = ident
            self.m.credit_granted.inc(g)
            if g < n:
                self._waiting[actor_id] = (ident, n - g)  # to the back of the queue: fair between actors

    def _consume_credit(self, actor_id: int) -> None:
        q = self._in_flight.get(actor_id)
        if not q:
            return
        q[0][1] -= 1
        if q[0][1] <= 0:
            q.popleft()

    def _expire_credits(self) -> None:
        now = time.monotonic()
        for q in self._in_flight.values():
            while q and q[0][0] < now:
                q.popleft()

    # ------------------------------------------------------------------ learner requests

    def _reply(self, ident: bytes, envelope: list[bytes], frame: bytes, copy: bool = True) -> None:
        try:
            self.serve.send_multipart([ident, *envelope, frame], zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            log.warning("serve reply queue full; dropping a reply (the client times out and asks again)")

    def _drain_serve(self) -> None:
        """Answer what can be answered now; batch requests join the wait list (served by ``_try_serve``)."""
        for _ in range(256):
            try:
                parts = self.serve.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident, rest = parts[0].bytes, parts[1:]
            if rest:
                self.serve_peers.seen(ident, rest[-1])
            envelope: list[bytes] = []
            if rest and len(rest[0]) == 0:  # a REQ client's empty delimiter: echo it so REQ accepts the reply
                envelope, rest = [b""], rest[1:]
            try:
                self._handle_serve(ident, envelope, rest)
            except Exception as e:  # a bug in one request must not take the buffer down
                log.exception("unexpected error answering a serve request")
                self.m.storage_errors.labels(reason="internal").inc()
                self._waits.pop(ident, None)
                self._reply(ident, envelope, encode(ErrorReply(reason="internal", message=repr(e)[:4000])))

    def _handle_serve(self, ident: bytes, envelope: list[bytes], body: list[zmq.Frame]) -> None:
        def reply(frame: bytes) -> None:
            self._reply(ident, envelope, frame)

        if len(body) != 1:
            reply(self._reject("multipart", f"expected 1 frame, got {len(body)}"))
            return
        try:
            msg = decode(body[0].bytes, self.max_frame)
        except ProtocolError as e:
            reply(self._reject(e.reason, str(e)))
            return
        if ident in self._waits:  # only a non-REQ client can do this; the first request keeps its place
            reply(self._reject("busy", "this connection already has a batch request waiting"))
            return
        self._wait_writer()
        if isinstance(msg, BatchRequest):
            self._on_batch_request(ident, envelope, msg)
        elif isinstance(msg, PositivesRequest):
            # Stored frames were validated at ingest: spliced into the reply, not decoded again.
            reply(encode_positives_reply(self.store.sample_positives(min(msg.n, 1 << 16), self._rng)))
        elif isinstance(msg, StatsRequest):
            reply(encode(StatsReply(stats=self.stats())))
        else:
            reply(self._reject("unexpected_type", f"{msg.TYPE} not accepted on serve"))

    def _check_batch_request(self, req: Any) -> tuple[str, str] | None:
        """(reason, message) when the request is refused, else None."""
        b = self.cfg.buffer
        if not 1 <= req.n_groups <= self.max_batch_groups:
            return "bad_request", (f"n_groups={req.n_groups} outside [1, {self.max_batch_groups}] "
                                   f"(buffer.max_batch_groups={b.max_batch_groups}, "
                                   f"buffer.capacity_groups={b.capacity_groups})")
        if req.timeout_ms > b.max_batch_wait_s * 1000:
            return "bad_request", (f"timeout_ms={req.timeout_ms} exceeds buffer.max_batch_wait_s={b.max_batch_wait_s:g} s; "
                                   "ask again after a timeout reply instead")
        c = self.store.counters
        limit = max(c["learner_version"], c["served_version"] + b.learner_version_max_step)
        if req.learner_version > limit:
            return "learner_version", (
                f"learner_version={req.learner_version} is more than buffer.learner_version_max_step="
                f"{b.learner_version_max_step} past {c['served_version']}, the learner version of the last full "
                f"batch served (stored learner version {c['learner_version']}): only the learner moves it, one "
                "step per batch. If this is the learner (e.g. resumed against a new buffer directory), stop the "
                f"buffer and run: python -m buffer.inspect {self.cfg.buffer_path} --set-learner-version "
                f"{max(0, req.learner_version - 1)}")
        return None

    def _on_batch_request(self, ident: bytes, envelope: list[bytes], req: Any) -> None:
        refused = self._check_batch_request(req)
        if refused is not None:
            self._reply(ident, envelope, self._reject(*refused))
            return
        try:
            self.store.set_learner_version(req.learner_version)
        except StorageError as e:
            self.m.storage_errors.labels(reason=e.reason).inc()
            self._reply(ident, envelope, encode(ErrorReply(reason="storage", message=str(e)[:4000])))
            return
        self.m.learner_version.set(self.learner_version)
        if len(self._waits) >= _MAX_BATCH_WAITS:
            # Bounded memory against a flood of waiting requests. Evicting the oldest with a timeout reply
            # (clients ask again after a timeout) keeps the learner going; refusing new requests would
            # turn the flood into an error for the learner.
            old = self._waits.pop(next(iter(self._waits)))
            self._timeouts += 1
            self.m.batch_timeouts.inc()
            self._reply(old.ident, old.envelope, encode(ErrorReply(
                reason="timeout", message=f"evicted: {_MAX_BATCH_WAITS} batch requests waiting; ask again")))
        now = time.monotonic()
        self._waits[ident] = _BatchWait(ident, envelope, req, now + req.timeout_ms / 1000.0)
        self._depth_changed = True

    def _try_serve(self) -> None:
        """Serve every waiting request that can be served (oldest first), time out the expired ones."""
        now = time.monotonic()
        check_all = self._depth_changed
        self._depth_changed = False
        for w in list(self._waits.values()):
            if check_all or now >= w.deadline:
                self._serve_one(w, now)

    def _serve_one(self, w: _BatchWait, now: float) -> None:
        self._wait_writer()
        req = w.req
        min_version = max(0, self.learner_version - self.k)
        # Only a full learner batch moves served_version, to the version the request carried (not the stored
        # one, which another client may have raised a step: recording that would let it drift a step per batch).
        full = req.n_groups >= min(self.batch_groups, self.max_batch_groups)
        try:
            frames, dropped = self.store.take_groups(
                req.n_groups, min_version, served_version=req.learner_version if full else None)
        except StorageError as e:
            self.m.storage_errors.labels(reason=e.reason).inc()
            del self._waits[w.ident]
            self._reply(w.ident, w.envelope, encode(ErrorReply(reason="storage", message=str(e)[:4000])))
            return
        if dropped:
            self.m.stale_dropped_groups.inc(dropped)
            self._dropped_since_reply += dropped
        if frames:
            n = len(frames)
            reply = encode_batch_reply(frames, self._dropped_since_reply, self._filtered_since_reply)
            del frames
            del self._waits[w.ident]
            self._reply(w.ident, w.envelope, reply, copy=False)  # tens of MB: hand the buffer to ZeroMQ
            self._dropped_since_reply = self._filtered_since_reply = 0
            self.m.served_groups.inc(n)
            self.m.batch_serve_seconds.observe(time.monotonic() - now)
            self._update_gauges(force=True)
        elif now >= w.deadline:
            self._timeouts += 1
            self.m.batch_timeouts.inc()
            del self._waits[w.ident]
            depth = self.store.counters["depth_groups"]
            self._reply(w.ident, w.envelope, encode(ErrorReply(
                reason="timeout", message=f"{depth} of {req.n_groups} groups after {req.timeout_ms} ms")))

    # ------------------------------------------------------------------ observability

    def stats(self) -> dict[str, float]:
        c = self.store.counters
        out: dict[str, float] = {k: float(v) for k, v in c.items()}
        out.update({
            "positives": float(self.store.positives_count),
            "min_version": float(self.store.min_version()),
            "max_version": float(self.store.max_version()),
            "credit_outstanding": float(self.in_flight),
            "credit_waiting": float(len(self._waiting)),
            "credit_released": float(self._credit_released),
            "batch_waiting": float(len(self._waits)),
            "batch_waits_abandoned": float(self._waits_abandoned),
            "admission_capacity": float(self.capacity()),
            "rejected_total": float(sum(self._rejected.values())),
            "batch_timeouts": float(self._timeouts),
            "storage_errors": float(self._storage_errors),
            "ingest_commits": float(self._ingest_commits),
            "lmdb_bytes": float(self.store.data_bytes()),
            "map_size": float(self.store.map_size),
            "metrics_port": float(self.m.port or 0),
            "pid": float(os.getpid()),
        })
        for reason, n in self._rejected.items():
            out[f"rejected_{reason}"] = float(n)
        return out

    def _update_gauges(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_gauges < 0.5:
            return
        self._last_gauges = now
        c = self.store.counters
        self.m.depth_groups.set(c["depth_groups"])
        self.m.depth_samples.set(c["depth_samples"])
        self.m.depth_bytes.set(c["depth_bytes"])
        self.m.positives_stored.set(self.store.positives_count)
        self.m.credit_outstanding.set(self.in_flight)
        self.m.credit_waiting.set(len(self._waiting))
        self.m.admission_capacity.set(self.capacity())
        self.m.learner_version.set(c["learner_version"])
        self.m.lmdb_bytes.set(self.store.data_bytes())


def serve_forever(cfg: Config, ready: Any = None) -> int:
    """Run a server until SIGTERM/SIGINT; prints ``BUFFER READY {json}`` once bound."""
    # The writer thread releases the GIL for every LMDB put and commit; with the default 5 ms switch interval
    # it would wait up to 5 ms per put behind the validating main thread (a GIL convoy).
    sys.setswitchinterval(2e-4)
    metrics = Metrics("buffer")
    server = BufferServer(cfg, metrics)
    if cfg.metrics.prometheus:
        metrics.serve(cfg.buffer.metrics_port, cfg.metrics.host)

    def _on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        server.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    info = {
        "ingest_addr": cfg.buffer.ingest_addr, "serve_addr": cfg.buffer.serve_addr,
        "metrics_port": metrics.port, "path": str(cfg.buffer_path), "pid": os.getpid(),
        "curve": server.curve.enabled,
    }
    print("BUFFER READY " + json.dumps(info), flush=True)
    if ready is not None:
        ready(info)
    server.run()
    log.info("buffer stopped")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from buffer.__main__ import main

    sys.exit(main())
