"""The buffer server: actors push groups, the learner pulls batches (messages: common/protocol.py).

Launch: ``python -m buffer [config.yaml] [key=value ...]`` (sections ``buffer`` and ``learner``).
On start it prints one line ``BUFFER READY {json}`` (addresses, metrics port, pid) to stdout.

Sockets (one thread, one ``zmq.Poller``):

- ``buffer.ingest_addr`` (ROUTER) — actors' DEALERs send ``SampleGroup`` and ``CreditRequest`` frames.
  Each group is answered with an ``IngestAck`` after its commit (the ``error`` values: ``buffer.ingest``).
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

Admission control (credits, AReaL's staleness bound; ``CreditRequest`` / ``CreditGrant``): ``buffer.ingest``.

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

This module is the event loop. The pieces it drives: ``buffer.ingest`` (the ingest socket: validation,
roles, commit acks, credit requests), ``buffer.stats`` (counters and gauges), ``buffer.credits`` (the
credit ledger and the admission capacity, pure), ``buffer.waits`` (waiting batch requests),
``buffer.peers`` (which connections closed), ``buffer.writer`` (the commit thread) and ``buffer.store``
(every LMDB access).

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
from buffer.ingest import (
    client_key,
    drain_ingest,
    finish_commit,
    grant_credits,
    has_room,
    on_credit_request,
    record_group,
    refuse_group,
    send_ingest,
)
from buffer.peers import Peers
from buffer.stats import server_stats, update_gauges
from buffer.store import BufferStore, StorageError, lock_server, unlock_server
from buffer.waits import BatchWait, BatchWaits
from buffer.writer import Pending, Writer
from common.config import Config
from common.limits import limits_from_config
from common.metrics import Metrics
from common.protocol import (
    BatchRequest,
    ErrorReply,
    PositivesRequest,
    ProtocolError,
    StatsReply,
    StatsRequest,
    decode,
    encode,
    encode_batch_reply,
    encode_positives_reply,
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

    # The ingest side (validation, roles, commit acks, credits) lives in buffer.ingest, bound as methods.
    _drain_ingest = drain_ingest
    _refuse_group = refuse_group
    _client_key = client_key
    _record = record_group
    _has_room = has_room
    _finish = finish_commit
    _send_ingest = send_ingest
    _on_credit_request = on_credit_request
    _grant_credits = grant_credits

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

    def _known(self, group_id: str) -> bytes | None:
        self._wait_writer()
        return self.store.known(group_id)

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

    # StatsReply counters and Prometheus gauges: buffer.stats.
    stats = server_stats
    _update_gauges = update_gauges


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


