"""Peers over a real TCP ROUTER: an identity seen on a connection is reported gone once that connection closes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from buffer.peers import Peers
from tests.polling import wait_for


@pytest.fixture
def router() -> Iterator[tuple[zmq.Context, zmq.Socket, str]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield ctx, sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()


def connect(ctx: zmq.Context, addr: str, identity: bytes) -> zmq.Socket:
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.identity = identity
    dealer.connect(addr)
    dealer.send(b"hello")
    return dealer


def receive(sock: zmq.Socket, peers: Peers) -> bytes:
    assert sock.poll(10_000), "no frame arrived"
    parts = sock.recv_multipart(copy=False)
    peers.seen(parts[0].bytes, parts[-1])
    return parts[0].bytes


def test_a_closed_connection_reports_its_identity_once(router: tuple[zmq.Context, zmq.Socket, str]) -> None:
    ctx, sock, addr = router
    peers = Peers(sock)
    leaving, staying = connect(ctx, addr, b"leaving"), connect(ctx, addr, b"staying")
    assert {receive(sock, peers), receive(sock, peers)} == {b"leaving", b"staying"}
    assert peers.gone() == []
    leaving.close(linger=0)
    gone: list[bytes] = []
    wait_for(lambda: gone.extend(peers.gone()) or gone, timeout_s=10, what="the disconnect event")
    assert gone == [b"leaving"]
    assert peers.gone() == []
    assert peers.refused == 0 and peers.new_refusals() == 0
    staying.close(linger=0)
    peers.close()


def test_new_refusals_reports_each_refusal_once() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    peers = Peers(sock)
    peers.refused = 3  # as the monitor would have counted three failed handshakes
    assert peers.new_refusals() == 3
    assert peers.new_refusals() == 0 and peers.refused_reported == 3
    peers.close()
    sock.close(linger=0)
    ctx.term()
