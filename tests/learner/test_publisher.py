"""The weight publisher reopened in one process (as a test or a restarted learner in the same interpreter does)
must answer weight queries, whatever sockets the process closed before it."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from common import protocol
from learner.publisher import WeightPublisher


def _query(ctx: zmq.Context, addr: str) -> protocol.WeightUpdate:
    req = ctx.socket(zmq.REQ)
    req.linger = 0
    try:
        req.connect(addr)
        req.send(protocol.encode(protocol.WeightQuery()))
        assert req.poll(10_000), "the publisher's REP thread did not answer"
        return protocol.decode_as(req.recv(), protocol.WeightUpdate)
    finally:
        req.close()


def test_a_publisher_answers_while_old_monitor_endpoints_are_still_bound(tmp_path: Path) -> None:
    # A socket's monitor was named after its file descriptor; a publisher reopened in the same process got the
    # descriptor of a socket closed a moment before whose monitor endpoint libzmq had not yet released, the
    # REP thread died on "Address already in use", and actors asking for the weights waited forever. One
    # socket squatting on every such name stands for all the not-yet-released ones.
    ctx = zmq.Context.instance()  # the publisher's context, where the names live
    squatter = ctx.socket(zmq.PAIR)
    for fd in range(4096):
        squatter.bind(f"inproc://monitor.s-{fd}")
    try:
        up = protocol.WeightUpdate(version=3, path=str(tmp_path), sha256="c" * 64, created_at=time.time())
        pub = WeightPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", latest=up)
        try:
            assert _query(ctx, pub.query_endpoint).version == 3
        finally:
            pub.close()
    finally:
        squatter.close(linger=0)
