"""The buffer server: actors push groups, the learner pulls batches (DESIGN.md §1, §4).

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
- ``buffer.serve_addr`` (REP) — the learner sends ``BatchRequest(learner_version, n_groups, timeout_ms)``:
  groups with ``weight_version < learner_version - max_staleness`` are deleted and counted, then the
  ``n_groups`` oldest (weight version, then arrival) are removed and sent as one ``BatchReply``. If fewer
  than ``n_groups`` arrive within ``timeout_ms`` the reply is ``ErrorReply(reason="timeout")`` and nothing
  is taken (never a partial batch: a learner step always sees exactly ``n_groups``). ``n_groups`` above
  ``buffer.capacity_groups`` is refused at once (``bad_request``). Also ``PositivesRequest(n)`` (up to n
  distinct stored positives, random) and ``StatsRequest`` (counters as ``StatsReply``).

Admission control (AReaL's staleness bound): an actor asks ``CreditRequest(actor_id, n)`` — "I want n
more groups' worth of credit" (replaces any earlier waiting request of that actor; n = 0 withdraws it)
— and generates only after a ``CreditGrant``. AReaL admits while
``(max_staleness + version + 1) * batch_groups - (accepted + running) > 0``. Here ``version * batch_groups``
is counted as the groups the learner has consumed (plus the batch it is waiting for), not the version
number it reports, so ``accepted - consumed = depth``::

    capacity = max_staleness * batch_groups + (n_groups of the pending BatchRequest, else 0)
               - (groups waiting in LMDB + credits in flight)

also capped by ``buffer.capacity_groups`` / ``capacity_bytes``. Grants are deferred while capacity is
zero. Counting consumption instead of the reported version keeps the bound right when the learner takes
several batches per version (value pretraining) or resumes from an older checkpoint; with
``max_staleness = 0`` actors work only while the learner waits, which makes the system synchronous.
Every term is durable or re-derivable after a restart (AReaL bug #1388): depth, totals and the learner
version are LMDB counters; credits in flight restart at zero (groups from old grants still count when
they arrive), and a grant not used within ``buffer.credit_ttl_s`` stops counting. A grant carries the
learner version: actors that generate with weights at least that new never produce stale groups.

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

from buffer.store import FILTERED, STALE, STORED, BufferStore, GroupRecord, StorageError, positive_hash
from common.config import Config
from common.metrics import Metrics
from common.protocol import (
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
    encode,
    encode_batch_reply,
)
from common.security import server_curve

log = logging.getLogger("vapo.buffer")
_MAX_WAITING = 1 << 16  # actors with a deferred credit request


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
        self.store = BufferStore(
            cfg.buffer_path, map_size=b.map_size_bytes, max_map_size=b.max_map_size_bytes,
            positives_capacity=b.positives_capacity, on_commit=self.m.commit_latency_seconds.observe,
        )
        self.ctx = zmq.Context()
        try:
            self.curve = server_curve(self.ctx, [b.ingest_addr, b.serve_addr], b.curve)
        except Exception:
            self.store.close()
            self.ctx.term()
            raise
        self.ingest = self._socket(zmq.ROUTER, b.ingest_addr)
        self.serve = self._socket(zmq.REP, b.serve_addr)
        self.writer = _Writer(self.store, self.ctx)
        self._next: list[tuple[GroupRecord, tuple[bytes, str, int]]] = []  # validated, waiting for a commit
        self._stop = threading.Event()
        self._rng = random.Random(cfg.run.seed)
        # Admission state (in memory by design: see module docstring).
        self._in_flight: dict[int, deque[list[float]]] = {}  # actor_id -> [[expiry, count], ...]
        self._waiting: OrderedDict[int, tuple[bytes, int]] = OrderedDict()  # actor_id -> (identity, n)
        self._credit_holder: dict[int, bytes] = {}  # actor_id -> identity its in-flight credits were granted to
        self._pending: tuple[Any, float, float] | None = None  # (BatchRequest, deadline, t0)
        self._owe_reply = False  # the REP socket received a request it has not answered yet
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
        pending_n = self._pending[0].n_groups if self._pending else 0
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
        poller.register(self.writer.notify, zmq.POLLIN)
        registered = {self.ingest: False, self.serve: False}
        try:
            while not self._stop.is_set():
                try:
                    self._turn(poller, registered)
                except Exception as e:
                    # A bug in one request must not take the buffer down: log, count, answer, carry on.
                    log.exception("unexpected error in the buffer loop")
                    self.m.storage_errors.labels(reason="internal").inc()
                    if self._owe_reply:
                        self._pending = None
                        self._reply(encode(ErrorReply(reason="internal", message=repr(e)[:4000])))
            self._wait_writer()
        finally:
            self.close()

    def _turn(self, poller: zmq.Poller, registered: dict[zmq.Socket, bool]) -> None:
        # A REP socket must answer before it may receive again: stop polling it while a batch waits.
        # Stop reading ingest while the next batch is full (the ZeroMQ queues push back on senders).
        want = {self.serve: self._pending is None,
                self.ingest: len(self._next) < self.cfg.buffer.commit_batch}
        for sock, on in want.items():
            if on != registered[sock]:
                (poller.register(sock, zmq.POLLIN) if on else poller.unregister(sock))
                registered[sock] = on
        timeout_ms = 100.0
        if self._pending is not None:
            timeout_ms = max(0.0, min(timeout_ms, (self._pending[1] - time.monotonic()) * 1000))
        events = dict(poller.poll(timeout_ms))
        if self.writer.notify in events:
            self._collect_writer()
        if self.ingest in events:
            self._drain_ingest()
        if self._next and not self.writer.busy:
            self._submit()
        if self._pending is None and self.serve in events:
            self._handle_serve()
        if self._pending is not None:
            self._try_serve()
        self._expire_credits()
        self._grant_credits()
        self._update_gauges()

    def close(self) -> None:
        self.writer.stop()
        for s in (self.ingest, self.serve, self.writer.notify):
            if not s.closed:
                s.close(linger=0)
        self.curve.stop()
        self.ctx.term()
        self.store.close()

    # ------------------------------------------------------------------ ingest

    def _reject(self, reason: str, message: str) -> bytes:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        self.m.rejected_frames.labels(reason=reason).inc()
        return encode(ErrorReply(reason=reason, message=message[:4000]))

    def _drain_ingest(self) -> None:
        """Read, validate and queue groups for the next commit; answer everything else at once."""
        credit_msgs: list[tuple[bytes, Any]] = []
        lv, pos_reward = self.learner_version, self.cfg.buffer.positive_reward
        for _ in range(4 * self.cfg.buffer.commit_batch):
            if len(self._next) >= self.cfg.buffer.commit_batch:
                break
            try:
                parts = self.ingest.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            ident, body = parts[0].bytes, parts[1:]
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
                credit_msgs.append((ident, msg))
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
        for ident, req in credit_msgs:
            self._on_credit_request(ident, req)

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
        positives = [
            (positive_hash(s.prompt_ids, s.output_ids), encode(s)) for s in g.samples if s.reward >= pos_reward
        ]
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

    def _on_credit_request(self, ident: bytes, req: Any) -> None:
        self._waiting.pop(req.actor_id, None)
        holder = self._credit_holder.get(req.actor_id)
        if holder is not None and holder != ident and self._in_flight.get(req.actor_id):
            # A new connection for this actor id means the old process died or reset its socket: its
            # unused grants would otherwise block admission until credit_ttl_s (a restarted actor that
            # gets no credit is a deadlock). Groups from those grants are still accepted if they arrive.
            log.info("actor %d reconnected: releasing %d unused credits of its previous connection",
                     req.actor_id, sum(g for _, g in self._in_flight[req.actor_id]))
            self._in_flight[req.actor_id].clear()
        self._credit_holder[req.actor_id] = ident
        if req.n == 0:
            return
        if len(self._waiting) >= _MAX_WAITING:  # bound memory against a flood of made-up actor ids
            self._send_ingest(ident, self._reject("too_many_waiting", f"{_MAX_WAITING} actors already wait"))
            return
        self._waiting[req.actor_id] = (ident, req.n)
        if self.capacity() < req.n:
            self.m.admission_waits.inc()

    def _grant_credits(self) -> None:
        if not self._waiting:
            return
        cap = self.capacity()
        now = time.monotonic()
        for actor_id in list(self._waiting):
            if cap <= 0:
                break
            ident, n = self._waiting.pop(actor_id)
            g = min(n, cap)
            cap -= g
            self._send_ingest(ident, encode(CreditGrant(n=g, learner_version=self.learner_version)))
            self._in_flight.setdefault(actor_id, deque()).append([now + self.cfg.buffer.credit_ttl_s, g])
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

    def _reply(self, frame: bytes, copy: bool = True) -> None:
        self._owe_reply = False
        self.serve.send(frame, copy=copy)

    def _handle_serve(self) -> None:
        self._wait_writer()
        try:
            parts = self.serve.recv_multipart(zmq.NOBLOCK)
            self._owe_reply = True
        except zmq.Again:
            return
        if len(parts) != 1:
            self._reply(self._reject("multipart", f"expected 1 frame, got {len(parts)}"))
            return
        try:
            msg = decode(parts[0], self.max_frame)
        except ProtocolError as e:
            self._reply(self._reject(e.reason, str(e)))
            return
        if isinstance(msg, BatchRequest):
            self._on_batch_request(msg)
        elif isinstance(msg, PositivesRequest):
            frames = self.store.sample_positives(min(msg.n, 1 << 16), self._rng)
            samples = [decode(f, len(f)) for f in frames]
            self._reply(encode(PositivesReply(samples=[s for s in samples if isinstance(s, Sample)])))
        elif isinstance(msg, StatsRequest):
            self._reply(encode(StatsReply(stats=self.stats())))
        else:
            self._reply(self._reject("unexpected_type", f"{msg.TYPE} not accepted on serve"))

    def _on_batch_request(self, req: Any) -> None:
        if req.n_groups < 1 or req.n_groups > self.cfg.buffer.capacity_groups:
            self._reply(self._reject(
                "bad_request", f"n_groups={req.n_groups} outside [1, buffer.capacity_groups="
                f"{self.cfg.buffer.capacity_groups}]"))
            return
        try:
            self.store.set_learner_version(req.learner_version)
        except StorageError as e:
            self.m.storage_errors.labels(reason=e.reason).inc()
            self._reply(encode(ErrorReply(reason="storage", message=str(e)[:4000])))
            return
        self.m.learner_version.set(self.learner_version)
        now = time.monotonic()
        self._pending = (req, now + req.timeout_ms / 1000.0, now)
        self._depth_changed = True
        self._try_serve()

    def _try_serve(self) -> None:
        assert self._pending is not None
        req, deadline, t0 = self._pending
        now = time.monotonic()
        if not self._depth_changed and now < deadline:
            return
        self._depth_changed = False
        self._wait_writer()
        min_version = max(0, self.learner_version - self.k)
        try:
            frames, dropped = self.store.take_groups(req.n_groups, min_version)
        except StorageError as e:
            self.m.storage_errors.labels(reason=e.reason).inc()
            self._pending = None
            self._reply(encode(ErrorReply(reason="storage", message=str(e)[:4000])))
            return
        if dropped:
            self.m.stale_dropped_groups.inc(dropped)
            self._dropped_since_reply += dropped
        if frames:
            n = len(frames)
            reply = encode_batch_reply(frames, self._dropped_since_reply, self._filtered_since_reply)
            del frames
            self._reply(reply, copy=False)  # tens of MB: hand the buffer to ZeroMQ instead of copying
            self._dropped_since_reply = self._filtered_since_reply = 0
            self.m.served_groups.inc(n)
            self.m.batch_serve_seconds.observe(time.monotonic() - now)
            self._pending = None
            self._update_gauges(force=True)
        elif now >= deadline:
            self._timeouts += 1
            self.m.batch_timeouts.inc()
            self._pending = None
            depth = self.store.counters["depth_groups"]
            self._reply(encode(ErrorReply(
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
