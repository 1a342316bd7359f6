"""The buffer server: actors push groups, the learner pulls batches (messages: common/protocol.py).

Launch: ``python -m buffer [config.yaml] [key=value ...]`` (sections ``buffer`` and ``learner``).
On start it prints one line ``BUFFER READY {json}`` (addresses, metrics port, pid) to stdout.

Sockets (one thread, one ``zmq.Poller``):

- ``buffer.ingest_addr`` (ROUTER) — actors' DEALERs send ``SampleGroup`` and ``CreditRequest`` frames.
  Groups arriving together (up to ``buffer.commit_batch``) are written in one LMDB transaction and each is
  answered ``IngestAck(committed=True)`` only after that commit. A re-sent group_id is acknowledged again
  (``duplicate=True``) and stored once. ``IngestAck.error`` is ``""`` when the group was stored,
  ``"stale"`` / ``"filtered:uniform_reward"`` when it was recorded but will never be served (still
  ``committed=True``: do not re-send), ``"full: ..."`` / ``"storage: ..."`` with ``committed=False``
  when it was not stored (re-send later), and ``"invalid:<reason>: ..."`` with ``committed=False`` when the
  group breaks the ingest bounds of ``common.limits`` (empty prompt or response, token id past the
  vocabulary, reward outside the task's range, logprob > 0, too long): never stored, counted in
  ``vapo_buffer_invalid_groups{reason}``, final (re-sending cannot help).
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

Roles: with CurveZMQ keys (every launched run: ``common.security``) each frame carries its client key, and
the key's role decides what it may send: ``SampleGroup`` and ``CreditRequest`` only from ``actor`` keys,
``BatchRequest`` and ``PositivesRequest`` (which take groups and move the learner version) only from the
``learner`` key, ``StatsRequest`` from any key of the run; anything else is answered ``ErrorReply(role)``.
A client without a key of the run never gets a frame through; the socket monitors count those connections
(``vapo_buffer_auth_refused{socket}``).

Bad frames on either socket are counted in ``vapo_buffer_rejected_frames{reason}`` (``ProtocolError``
reason, ``multipart``, ``unexpected_type``), answered with ``ErrorReply``, and the server keeps serving.
Frames larger than 4 x ``buffer.max_frame_bytes`` are cut off by ZeroMQ itself (connection dropped).

Threads: the main thread owns every socket and validates frames; one writer thread (``buffer.writer``) runs
each batch's LMDB transaction (page writes and fsync release the GIL), so validation of the next batch
overlaps the commit of the previous one. The main thread touches the store only while the writer is idle.

This module is the event loop. The pieces it drives: ``buffer.credits`` (the credit ledger and the
admission capacity, pure), ``buffer.waits`` (waiting batch requests), ``buffer.peers`` (which connections
closed), ``buffer.writer`` (the commit thread) and ``buffer.store`` (every LMDB access).

Deviations: groups are deleted from LMDB when served (a learner crash loses the batches served since its
last checkpoint: it resumes from that checkpoint and trains on fresh groups instead); the DAPO uniform-reward filter runs at ingest, not at serve
time, so filtered groups never take space; positives are harvested from every new group (also stale or
filtered ones: NLL replay is off-policy by design), except responses cut at the length limit.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import zmq

from buffer.credits import CreditLedger, admission_capacity, free_capacity
from buffer.peers import Peers
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
from buffer.waits import BatchWait, BatchWaits
from buffer.writer import Pending, Writer
from common.config import Config
from common.limits import group_problem, is_positive, limits_from_config
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


class BufferServer:
    """Owns the store and both sockets; ``run()`` serves until ``stop()``."""

    def __init__(self, cfg: Config, metrics: Metrics | None = None) -> None:
        b = cfg.buffer
        self.cfg = cfg
        self.k = b.max_staleness
        self.batch_groups = cfg.learner.batch_groups
        self.max_frame = b.max_frame_bytes
        self.m = metrics or Metrics("buffer")
        per_actor = b.max_credit_per_actor or 2 * cfg.actors.prompts_in_flight
        self.credits = CreditLedger(per_actor, b.max_credit_per_connection or per_actor, b.credit_ttl_s)
        self.max_batch_groups = min(b.max_batch_groups, b.capacity_groups)
        self.limits = limits_from_config(cfg)
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
        self.ingest_peers = Peers(self.ingest)
        self.serve_peers = Peers(self.serve)
        self.writer = Writer(self.store, self.ctx)
        self._next: list[Pending] = []  # validated, waiting for a commit
        self._stop = threading.Event()
        self._rng = random.Random(cfg.run.seed)
        self._waits = BatchWaits()
        self._dropped_since_reply = 0
        self._filtered_since_reply = 0
        self._rejected: dict[str, int] = {}
        self._invalid: dict[str, int] = {}
        self._auth_refused = {"ingest": 0, "serve": 0}
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

    def capacity(self) -> int:
        c = self.store.counters
        pending_n = self._waits.pending_n()
        in_flight = self.credits.in_flight
        adm = admission_capacity(self.k, self.batch_groups, pending_n, c["depth_groups"], in_flight)
        return free_capacity(adm, c["depth_groups"], c["depth_bytes"], in_flight,
                             self.cfg.buffer.capacity_groups, self.cfg.buffer.capacity_bytes)

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
                    for w in self._waits.clear():
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
        first = self._waits.first_deadline()
        if first is not None:
            timeout_ms = max(0.0, min(timeout_ms, (first - time.monotonic()) * 1000))
        events = dict(poller.poll(timeout_ms))
        self._drop_gone()  # before reading data: see Peers
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
        self.credits.expire(time.monotonic())
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
        """Forget the state of connections that closed: their credit and their waiting batch requests (and
        count the connections refused at the handshake)."""
        for ident in self.ingest_peers.gone():
            released = self.credits.release_connection(ident)
            if released:
                log.info("an ingest connection closed: released its %d unused credits", released)
        for ident in self.serve_peers.gone():
            if self._waits.abandon(ident):
                log.info("a client left while its batch request waited: dropped the request")
        for name, peers in (("ingest", self.ingest_peers), ("serve", self.serve_peers)):
            new = peers.refused - self._auth_refused[name]
            if new:
                self._auth_refused[name] = peers.refused
                self.m.auth_refused.labels(socket=name).inc(new)
                log.warning("%s socket: refused %d connection(s) at the CurveZMQ handshake", name, new)

    # ------------------------------------------------------------------ ingest

    def _reject(self, reason: str, message: str) -> bytes:
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        self.m.rejected_frames.labels(reason=reason).inc()
        return encode(ErrorReply(reason=reason, message=message[:4000]))

    def _drain_ingest(self) -> None:
        """Read, validate and queue groups for the next commit; answer everything else at once."""
        credit_msgs: list[tuple[bytes, CreditRequest, str | None]] = []
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
            if not isinstance(msg, CreditRequest | SampleGroup):
                self._send_ingest(ident, self._reject("unexpected_type", f"{msg.TYPE} not accepted on ingest"))
                continue
            key = self._client_key(body[0])
            if self.curve.enabled and self.curve.role(key) != "actor":
                self._send_ingest(ident, self._reject("role", f"{msg.TYPE} is for actor keys only"))
                continue
            if isinstance(msg, CreditRequest):
                credit_msgs.append((ident, msg, key))
                continue
            bad = group_problem(msg, self.limits)
            if bad is not None:
                self._refuse_group(ident, msg, *bad)
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

    def _refuse_group(self, ident: bytes, g: SampleGroup, reason: str, message: str) -> None:
        """A protocol-valid group the learner could not use: never stored, answered with a final error."""
        self._invalid[reason] = self._invalid.get(reason, 0) + 1
        self.m.invalid_groups.labels(reason=reason).inc()
        self.credits.consume(g.actor_id)  # generated on a credit: it must not hold that credit until the ttl
        log.warning("refused group %s of actor %d: %s: %s", g.group_id[:64], g.actor_id, reason, message)
        self._send_ingest(ident, encode(IngestAck(group_id=g.group_id, committed=False, duplicate=False,
                                                  error=f"invalid:{reason}: {message}"[:4000])))

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
        # A response cut at the length limit is never a positive, whatever its reward: imitating it would
        # teach the policy not to stop.
        keep = [is_positive(s, pos_reward) for s in g.samples]
        if any(keep):
            # Stored as the exact bytes they arrived in: cut out of the frame, not encoded again.
            frames = sample_frames(frame)
            positives = [(positive_hash(s.prompt_ids, s.output_ids), f)
                         for s, f, k in zip(g.samples, frames, keep, strict=True) if k]
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
        return self.store.known(group_id)

    def _finish(self, batch: list[Pending], before: dict[str, int],
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
                self.credits.consume(actor_id)
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

    def _on_credit_request(self, ident: bytes, req: CreditRequest, key: str | None = None) -> None:
        refused = self.credits.request(ident, req.actor_id, req.n, key)
        if refused is not None:
            self._send_ingest(ident, self._reject(refused.reason, refused.message))
        elif req.n > 0 and self.capacity() < req.n:
            self.m.admission_waits.inc()

    def _grant_credits(self) -> None:
        if not self.credits.waiting:
            return
        for g in self.credits.grant(self.capacity(), time.monotonic()):
            self._send_ingest(g.ident, encode(CreditGrant(n=g.n, learner_version=self.learner_version)))
            self.m.credit_granted.inc(g.n)

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
                self._waits.remove(ident)
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
        if (self.curve.enabled and isinstance(msg, BatchRequest | PositivesRequest)
                and self.curve.role(self._client_key(body[0])) != "learner"):
            # Taking groups and moving the durable learner version is the learner's alone; counters are for all.
            reply(self._reject("role", f"{msg.TYPE} is for the learner's key only"))
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

    def _check_batch_request(self, req: BatchRequest) -> tuple[str, str] | None:
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

    def _on_batch_request(self, ident: bytes, envelope: list[bytes], req: BatchRequest) -> None:
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
        old = self._waits.add(BatchWait(ident, envelope, req, time.monotonic() + req.timeout_ms / 1000.0))
        if old is not None:  # the wait list was full: the oldest request gets a timeout reply
            self._timeouts += 1
            self.m.batch_timeouts.inc()
            self._reply(old.ident, old.envelope, encode(ErrorReply(
                reason="timeout", message=f"evicted: {self._waits.limit} batch requests waiting; ask again")))
        self._depth_changed = True

    def _try_serve(self) -> None:
        """Serve every waiting request that can be served (oldest first), time out the expired ones."""
        now = time.monotonic()
        check_all = self._depth_changed
        self._depth_changed = False
        for w in self._waits:
            if check_all or now >= w.deadline:
                self._serve_one(w, now)

    def _serve_one(self, w: BatchWait, now: float) -> None:
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
            self._waits.remove(w.ident)
            self._reply(w.ident, w.envelope, encode(ErrorReply(reason="storage", message=str(e)[:4000])))
            return
        if dropped:
            self.m.stale_dropped_groups.inc(dropped)
            self._dropped_since_reply += dropped
        if frames:
            n = len(frames)
            reply = encode_batch_reply(frames, self._dropped_since_reply, self._filtered_since_reply)
            del frames
            self._waits.remove(w.ident)
            self._reply(w.ident, w.envelope, reply, copy=False)  # tens of MB: hand the buffer to ZeroMQ
            self._dropped_since_reply = self._filtered_since_reply = 0
            self.m.served_groups.inc(n)
            self.m.batch_serve_seconds.observe(time.monotonic() - now)
            self._update_gauges(force=True)
        elif now >= w.deadline:
            self._timeouts += 1
            self.m.batch_timeouts.inc()
            self._waits.remove(w.ident)
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
            "credit_outstanding": float(self.credits.in_flight),
            "credit_waiting": float(self.credits.waiting),
            "credit_released": float(self.credits.released),
            "batch_waiting": float(len(self._waits)),
            "batch_waits_abandoned": float(self._waits.abandoned),
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
        for reason, n in self._invalid.items():
            out[f"invalid_{reason}"] = float(n)
        out["invalid_total"] = float(sum(self._invalid.values()))
        out["auth_refused_ingest"] = float(self._auth_refused["ingest"])
        out["auth_refused_serve"] = float(self._auth_refused["serve"])
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
        self.m.credit_outstanding.set(self.credits.in_flight)
        self.m.credit_waiting.set(self.credits.waiting)
        self.m.admission_capacity.set(self.capacity())
        self.m.learner_version.set(c["learner_version"])
        self.m.lmdb_bytes.set(self.store.data_bytes())


def serve_forever(cfg: Config, ready: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Run a server until SIGTERM/SIGINT; prints ``BUFFER READY {json}`` once bound."""
    # The writer thread releases the GIL for every LMDB put and commit; with the default 5 ms switch interval
    # it would wait up to 5 ms per put behind the validating main thread (a GIL convoy).
    sys.setswitchinterval(2e-4)
    metrics = Metrics("buffer")
    server = BufferServer(cfg, metrics)
    if cfg.metrics.prometheus:
        metrics.serve(cfg.buffer.metrics_port, cfg.metrics.host)

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
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


