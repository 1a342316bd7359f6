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

Admission control (credits, AReaL's staleness bound; ``CreditRequest`` / ``CreditGrant``): ``buffer.admission``.

Roles: with CurveZMQ keys (every launched run: ``common.security``) each frame carries its client key, and
the key's role decides what it may send: ``SampleGroup`` and ``CreditRequest`` only from ``actor`` keys,
``BatchRequest`` and ``PositivesRequest`` (which take groups and move the learner version) only from the
``learner`` key, ``StatsRequest`` from any key of the run; anything else is answered ``ErrorReply(role)``.
A client without a key of the run never gets a frame through; the socket monitors count those connections
(``vapo_buffer_auth_refused{socket}``) and the log names the first, then sums up the rest in at most one line
per socket a minute (``REFUSAL_LOG_INTERVAL_S``).

Bad frames on either socket are counted in ``vapo_buffer_rejected_frames{reason}`` (``ProtocolError``
reason, ``multipart``, ``unexpected_type``), answered with ``ErrorReply``, and the server keeps serving.
Frames larger than 4 x ``buffer.max_frame_bytes`` are cut off by ZeroMQ itself (connection dropped).

Threads: the main thread owns every socket and validates frames; one writer thread (``buffer.writer``) runs
each batch's LMDB transaction (page writes and fsync release the GIL), so validation of the next batch
overlaps the commit of the previous one. The main thread touches the store only while the writer is idle.

This module is the event loop: it owns the sockets, reads the serve socket and routes every frame to the
role that answers it. The roles, each owning its state: ``buffer.ingest`` (``Ingest``: the ingest socket,
validation, roles, the commit pipeline and its acks), ``buffer.admission`` (``Admission``: credit requests
and grants, the admission capacity), ``buffer.serving`` (``BatchServing``: batch requests, the wait list,
staleness), ``buffer.positives`` (``Positives``: harvest at ingest, ``PositivesRequest``), ``buffer.stats``
(``BufferStats``: ``StatsRequest``, gauges) and ``buffer.frames`` (``FrameRejections``: refused frames).
Below them: ``buffer.credits`` (the credit ledger, pure), ``buffer.waits`` (the wait list),
``buffer.peers`` (which connections closed), ``buffer.writer`` (the commit thread), ``buffer.store`` (every
LMDB access; layout in ``buffer.layout``) and ``buffer.directory`` (the one-server lock).

Deviations: groups are deleted from LMDB when served (a learner crash loses the batches served since its
last checkpoint: it resumes from that checkpoint and trains on fresh groups instead); the DAPO uniform-reward filter runs at ingest, not at serve
time, so filtered groups never take space; positives are harvested from every new group (also stale or
filtered ones: NLL replay is off-policy by design), except responses cut at the length limit.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import zmq

from buffer.admission import Admission
from buffer.directory import lock_server, unlock_server
from buffer.frames import FrameRejections, client_key
from buffer.ingest import Ingest
from buffer.peers import Peers
from buffer.positives import Positives
from buffer.serving import BatchServing
from buffer.stats import BufferStats
from buffer.store import BufferStore
from buffer.writer import Writer
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
)
from common.security import RefusalLog, server_curve

log = logging.getLogger("vapo.buffer")
# Connections refused at the handshake: the first is logged at once, then one summary line per interval.
REFUSAL_LOG_INTERVAL_S = 60.0


class BufferServer:
    """Owns the store and both sockets; ``run()`` serves until ``stop()``."""

    def __init__(self, cfg: Config, metrics: Metrics | None = None) -> None:
        b = cfg.buffer
        self.cfg = cfg
        self.metrics = metrics or Metrics("buffer")
        self._lock_fd = lock_server(cfg.buffer_path)  # one server per directory; an offline repair waits
        try:
            self.store = BufferStore(
                cfg.buffer_path, map_size=b.map_size_bytes, max_map_size=b.max_map_size_bytes,
                positives_capacity=b.positives_capacity, on_commit=self.metrics.commit_latency_seconds.observe,
                record_served=b.record_served,
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
        ingest_sock = self._socket(zmq.ROUTER, b.ingest_addr, heartbeat_s=b.peer_timeout_s)
        self.serve_sock = self._socket(zmq.ROUTER, b.serve_addr)
        self.serve_peers = Peers(self.serve_sock)
        self.writer = Writer(self.store, self.ctx)
        self._stop = threading.Event()
        self._reading_ingest = False
        self.refusal_logs = {name: RefusalLog(log, f"{name} socket", REFUSAL_LOG_INTERVAL_S) for name in ("ingest", "serve")}
        self._build_roles(ingest_sock)
        self.stats.update_gauges(force=True)
        c = self.store.counters
        log.info("buffer at %s: %d groups waiting (versions %d..%d), %d positives, learner version %d",
                 cfg.buffer_path, c["depth_groups"], self.store.min_version(), self.store.max_version(),
                 self.store.positives_count, c["learner_version"])

    def _build_roles(self, ingest_sock: zmq.Socket) -> None:
        """One object per role; they reach each other only through the callbacks wired here."""
        cfg, store, metrics = self.cfg, self.store, self.metrics
        self.rejections = FrameRejections(metrics)
        self.positives = Positives(store, cfg.run.seed)
        self.serving = BatchServing(cfg, store, metrics=metrics, rejections=self.rejections, reply=self._reply,
                                    settle=self._settle, served=self._batch_served)
        self.admission = Admission(cfg, store, metrics=metrics, rejections=self.rejections,
                                   pending_n=self.serving.waits.pending_n, send=self._answer_actor, curve=self.curve)
        self.ingest = Ingest(cfg, ingest_sock, store, self.writer, metrics=metrics, rejections=self.rejections,
                             curve=self.curve, limits=limits_from_config(cfg),
                             consume_credit=self.admission.consume, on_committed=self.serving.note_commit)
        self.stats = BufferStats(store, metrics, ingest=self.ingest, serving=self.serving,
                                 admission=self.admission, rejections=self.rejections, serve_peers=self.serve_peers)

    def _socket(self, kind: int, addr: str, heartbeat_s: float = 0.0) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.linger = 0
        if heartbeat_s > 0:
            # A peer whose host vanished never closes its TCP connection, so its unused credit would block
            # admission until credit_ttl_s; libzmq answers the pings on its own thread, however busy the actor.
            s.setsockopt(zmq.HEARTBEAT_IVL, max(int(heartbeat_s * 1000 / 3), 1))
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_s * 1000))
        s.maxmsgsize = 4 * self.cfg.buffer.max_frame_bytes
        s.sndhwm = 10000
        s.rcvhwm = 10000
        self.curve.apply(s)
        try:
            s.bind(addr)
        except zmq.ZMQError as e:
            s.close()
            raise OSError(f"cannot bind {addr}: {e}") from None
        return s

    # ------------------------------------------------------------------ callbacks between roles

    def _settle(self) -> None:
        self.ingest.settle()

    def _answer_actor(self, ident: bytes, frame: bytes) -> None:
        self.ingest.send(ident, frame)

    def _batch_served(self) -> None:
        self.stats.update_gauges(force=True)

    # ------------------------------------------------------------------ loop

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in (self.writer.notify, self.serve_sock, self.ingest.peers.monitor, self.serve_peers.monitor):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    self._turn(poller)
                except Exception as e:
                    # A bug must not take the buffer down: log, count, answer the waiting requests, carry on.
                    log.exception("unexpected error in the buffer loop")
                    self.metrics.storage_errors.labels(reason="internal").inc()
                    self.serving.fail_all(repr(e)[:4000])
            self.ingest.settle()
        finally:
            self.close()

    def _turn(self, poller: zmq.Poller) -> None:
        # Stop reading ingest while the next batch is full (the ZeroMQ queues push back on senders).
        on = self.ingest.accepting
        if on != self._reading_ingest:
            (poller.register(self.ingest.sock, zmq.POLLIN) if on else poller.unregister(self.ingest.sock))
            self._reading_ingest = on
        timeout_ms = 100.0
        first = self.serving.waits.first_deadline()
        if first is not None:
            timeout_ms = max(0.0, min(timeout_ms, (first - time.monotonic()) * 1000))
        events = dict(poller.poll(int(timeout_ms)))  # whole ms: pyzmq truncates a float the same way
        self._drop_gone()  # before reading data: see Peers
        if self.writer.notify in events:
            self.ingest.collect()
        if self.ingest.sock in events:
            for ident, req, key in self.ingest.drain():
                self.admission.on_request(ident, req, key)
        self.ingest.submit()
        if self.serve_sock in events:
            self._drain_serve()
        self.serving.serve_waiting()
        self.admission.grant()
        self.stats.update_gauges()

    def close(self) -> None:
        self.writer.stop()
        self.ingest.peers.close()
        self.serve_peers.close()
        for s in (self.ingest.sock, self.serve_sock, self.writer.notify):
            if not s.closed:
                s.close(linger=0)
        self.curve.stop()
        self.ctx.term()
        self.store.close()
        unlock_server(self._lock_fd)

    def _drop_gone(self) -> None:
        """Forget the state of connections that closed: their credit and their waiting batch requests (and
        count the connections refused at the handshake)."""
        for ident in self.ingest.peers.gone():
            self.admission.release_connection(ident)
        for ident in self.serve_peers.gone():
            if self.serving.waits.abandon(ident):
                log.info("a client left while its batch request waited: dropped the request")
        for name, peers in (("ingest", self.ingest.peers), ("serve", self.serve_peers)):
            new = peers.new_refusals()
            if new:
                self.metrics.auth_refused.labels(socket=name).inc(new)
            self.refusal_logs[name].note(new, time.monotonic())

    # ------------------------------------------------------------------ the serve socket

    def _reply(self, ident: bytes, envelope: list[bytes], frame: bytes, copy: bool = True) -> None:
        try:
            self.serve_sock.send_multipart([ident, *envelope, frame], zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            log.warning("serve reply queue full; dropping a reply (the client times out and asks again)")

    def _drain_serve(self) -> None:
        """Answer what can be answered now; batch requests join the wait list (``BatchServing``)."""
        for _ in range(256):
            got = self.serve_peers.recv()
            if got is None:
                return
            ident, rest = got
            envelope: list[bytes] = []
            if rest and len(rest[0]) == 0:  # a REQ client's empty delimiter: echo it so REQ accepts the reply
                envelope, rest = [b""], rest[1:]
            try:
                self._route_serve(ident, envelope, rest)
            except Exception as e:  # a bug in one request must not take the buffer down
                log.exception("unexpected error answering a serve request")
                self.metrics.storage_errors.labels(reason="internal").inc()
                self.serving.waits.remove(ident)
                self._reply(ident, envelope, encode(ErrorReply(reason="internal", message=repr(e)[:4000])))

    def _route_serve(self, ident: bytes, envelope: list[bytes], body: list[zmq.Frame]) -> None:
        def reply(frame: bytes) -> None:
            self._reply(ident, envelope, frame)

        reject = self.rejections.reject
        if len(body) != 1:
            reply(reject("multipart", f"expected 1 frame, got {len(body)}"))
            return
        try:
            msg = decode(body[0].bytes, self.cfg.buffer.max_frame_bytes)
        except ProtocolError as e:
            reply(reject(e.reason, str(e)))
            return
        if ident in self.serving.waits:  # only a non-REQ client can do this; the first request keeps its place
            reply(reject("busy", "this connection already has a batch request waiting"))
            return
        if (self.curve.enabled and isinstance(msg, BatchRequest | PositivesRequest)
                and self.curve.role(client_key(self.curve, body[0])) != "learner"):
            # Taking groups and moving the durable learner version is the learner's alone; counters are for all.
            reply(reject("role", f"{msg.TYPE} is for the learner's key only"))
            return
        self.ingest.settle()
        if isinstance(msg, BatchRequest):
            self.serving.on_request(ident, envelope, msg)
        elif isinstance(msg, PositivesRequest):
            reply(self.positives.reply(msg))
        elif isinstance(msg, StatsRequest):
            reply(encode(StatsReply(stats=self.stats.reply())))
        else:
            reply(reject("unexpected_type", f"{msg.TYPE} not accepted on serve"))


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


