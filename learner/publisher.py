"""The learner's weight announcements: a ZeroMQ PUB socket that sends every new ``WeightUpdate`` and a REP
thread that answers ``WeightQuery`` with the latest one (actors that start or reconnect late ask it).

Not a CLI. ``learner.runner`` owns one on rank 0; ``learner.weights`` writes the versions it announces.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from common import protocol, security
from common.config import CurveConfig

log = logging.getLogger(__name__)


class WeightPublisher:
    """PUB socket for WeightUpdate + a REP thread answering WeightQuery with the latest one.

    With CurveZMQ keys only the run's clients connect (any role: what they read is the path of published
    weights); connections refused at the handshake are counted in ``refused`` per socket and reported to
    ``on_refused(socket)`` (from the REP thread)."""

    def __init__(self, publish_addr: str, query_addr: str, curve: Any = None,
                 latest: protocol.WeightUpdate | None = None,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.ctx = zmq.Context.instance()
        self._curve = None
        self._latest = latest
        self._stop = threading.Event()
        self.refused = {"publish": 0, "query": 0}
        # The first refusal is logged at once, the rest summed up once a minute (a stranger retrying every
        # 100 ms would write ten lines a second).
        self._refusal_logs = {name: security.RefusalLog(log, f"weight {name} socket") for name in self.refused}
        self._on_refused = on_refused
        # common.security refuses a non-loopback bind without CurveZMQ keys.
        self._curve = security.server_curve(self.ctx, [publish_addr, query_addr],
                                            curve if curve is not None else CurveConfig())
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 1000)
        if self._curve is not None:
            self._curve.apply(self.pub)
        self.pub.bind(publish_addr)
        self.publish_endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        # Handed to the REP thread, which alone reads it from here on.
        self._pub_monitor = security.open_monitor(self.pub, security.HANDSHAKE_FAILED)
        self._rep_ready = threading.Event()
        self._rep_error: BaseException | None = None
        self.query_endpoint = ""
        self._thread = threading.Thread(target=self._serve, args=(query_addr,), name="weight-query", daemon=True)
        self._thread.start()
        self._rep_ready.wait(10)
        if self._rep_error is not None:
            self.close()
            raise self._rep_error

    def _serve(self, addr: str) -> None:
        rep = self.ctx.socket(zmq.REP)
        rep.setsockopt(zmq.LINGER, 0)
        try:
            if self._curve is not None:
                self._curve.apply(rep)
            rep.bind(addr)
            self.query_endpoint = rep.getsockopt_string(zmq.LAST_ENDPOINT)
            rep_monitor = security.open_monitor(rep, security.HANDSHAKE_FAILED)
        except BaseException as e:  # surfaced to the constructor
            self._rep_error = e
            self._rep_ready.set()
            self._pub_monitor.close(linger=0)
            rep.close()
            return
        self._rep_ready.set()
        try:
            self._answer_queries(rep, {self._pub_monitor: "publish", rep_monitor: "query"})
        finally:
            security.close_monitor(rep, rep_monitor)
            self._pub_monitor.close(linger=0)  # the PUB socket's monitoring ends in close(), on its own thread
            rep.close()

    def _answer_queries(self, rep: zmq.Socket, monitors: dict[zmq.Socket, str]) -> None:
        poller = zmq.Poller()
        for sock in (rep, *monitors):
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            for mon, name in monitors.items():
                self._refusal_logs[name].note(self._count_refused(mon, name) if mon in events else 0,
                                              time.monotonic())
            if rep not in events:
                continue
            frame = rep.recv()
            try:
                protocol.decode_as(frame, protocol.WeightQuery)
                latest = self._latest
                out = protocol.encode(latest) if latest is not None else protocol.encode(
                    protocol.ErrorReply(reason="no_weights", message="no weight version published yet"))
            except protocol.ProtocolError as e:
                out = protocol.encode(protocol.ErrorReply(reason=e.reason, message=str(e)[:4000]))
            rep.send(out)

    def _count_refused(self, monitor: zmq.Socket, name: str) -> int:
        """Count the refused handshakes the monitor reports; returns how many."""
        n = 0
        while monitor.poll(0):
            recv_monitor_message(monitor)
            n += 1
            self.refused[name] += 1
            if self._on_refused is not None:
                self._on_refused(name)
        return n

    @property
    def latest(self) -> protocol.WeightUpdate | None:
        return self._latest

    def publish(self, update: protocol.WeightUpdate) -> None:
        self._latest = update
        self.pub.send(protocol.encode(update))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if not self.pub.closed:
            self.pub.disable_monitor()
        self.pub.close()
        if self._curve is not None:
            self._curve.stop()
