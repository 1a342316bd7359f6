"""Which ROUTER peers are still connected (the buffer drops the state of a connection that closed), and how
many were refused at the handshake.

Not a CLI; used by ``buffer.server`` (serve socket) and ``buffer.ingest`` (ingest socket).
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.security import HANDSHAKE_FAILED, close_monitor, open_monitor


class Peers:
    """Which ROUTER identities arrived over which connection, so the state of a closed one can be dropped.

    libzmq without its draft API never tells a ROUTER that a peer left. Its socket monitor reports the file
    descriptor of a closed connection, and every received frame carries the descriptor it came on
    (``ZMQ_SRCFD``), which links the two. libzmq queues the disconnect event before it closes the
    descriptor, so draining the monitor before reading data (``gone`` first in every loop turn) never
    mistakes a new connection that reuses the number for the old one.

    The same monitor reports connections refused at the CurveZMQ handshake (``refused`` counts them): such a
    client never gets a frame through, so this is the only place a stranger shows.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self.monitor = open_monitor(sock, zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self.refused = 0
        self.refused_reported = 0  # the part of ``refused`` already handed out by ``new_refusals``
        self._fd_of: dict[bytes, int] = {}
        self._ids_on: dict[int, set[bytes]] = {}

    def recv(self) -> tuple[bytes, list[zmq.Frame]] | None:
        """The next message waiting on the socket as (identity, body frames), its connection noted
        (``seen``); None when nothing waits."""
        try:
            parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        ident, body = parts[0].bytes, parts[1:]
        if body:
            self.seen(ident, body[-1])
        return ident, body

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
            if ev["event"] & HANDSHAKE_FAILED:
                self.refused += 1
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                for ident in self._ids_on.pop(int(ev["value"]), ()):
                    self._fd_of.pop(ident, None)
                    out.append(ident)
        return out

    def new_refusals(self) -> int:
        """Handshake refusals since the last call (for a counter metric that only goes up)."""
        new = self.refused - self.refused_reported
        self.refused_reported = self.refused
        return new

    def close(self) -> None:
        """Before the watched socket is closed."""
        close_monitor(self._sock, self.monitor)
