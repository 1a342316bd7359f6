"""CurveZMQ rule: non-loopback binds need keys; clients without the right key can neither push nor pull."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from buffer.client import BatchClient
from common.config import CurveConfig
from common.protocol import encode
from common.security import (
    SecurityError,
    apply_client_curve,
    client_curve_keys,
    generate_keypair,
    is_local_endpoint,
    server_curve,
)
from tests.buffer.fixtures import REPO, BufferProc, SyncSender, make_group


@pytest.mark.parametrize("addr,local", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.4.5:1", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("ipc:///tmp/x.sock", True), ("inproc://buf", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://[::]:5555", False),
    ("tcp://192.0.2.2:5555", False), ("tcp://10.0.0.1:5555", False), ("tcp://eth0:5555", False),
    ("tcp://buffer.example.com:5555", False), ("tcp://lo;192.0.2.2:5555", False), ("epgm://eth0;239.1.1.1:5555", False),
])
def test_what_counts_as_local(addr: str, local: bool) -> None:
    assert is_local_endpoint(addr) is local


def test_server_curve_refuses_remote_bind_without_keys_and_loads_keys(tmp_path: Path) -> None:
    ctx = zmq.Context()
    try:
        with pytest.raises(SecurityError, match="refusing to bind tcp://0.0.0.0:1"):
            server_curve(ctx, ["tcp://127.0.0.1:1", "tcp://0.0.0.0:1"], CurveConfig())
        assert not server_curve(ctx, ["tcp://127.0.0.1:1", "ipc:///tmp/a"], CurveConfig()).enabled
        with pytest.raises(SecurityError, match="not found"):
            server_curve(ctx, ["tcp://0.0.0.0:1"], CurveConfig(server_secret_key=str(tmp_path / "nope"),
                                                                authorized_clients_dir=str(tmp_path)))
        with pytest.raises(SecurityError, match="no client public keys"):
            _, sec = generate_keypair(tmp_path, "server")
            server_curve(ctx, ["tcp://0.0.0.0:1"], CurveConfig(server_secret_key=str(sec),
                                                                authorized_clients_dir=str(tmp_path / "empty")))
        with pytest.raises(SecurityError, match="both"):
            client_curve_keys(CurveConfig(client_secret_key=str(sec)))
    finally:
        ctx.term()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _non_loopback_host() -> tuple[str, str]:
    """(bind host, connect host): this machine's own routable address if it has one, else the wildcard."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent; picks the outgoing interface address
            ip = s.getsockname()[0]
        if not ip.startswith("127."):
            return ip, ip
    except OSError:
        pass
    return "0.0.0.0", "127.0.0.1"


def test_remote_bind_without_keys_refuses_to_start(tmp_path: Path) -> None:
    host, _ = _non_loopback_host()
    out = subprocess.run(
        [sys.executable, "-m", "buffer", f"buffer.path={tmp_path / 'b'}", f"buffer.ingest_addr=tcp://{host}:{_free_port(host)}",
         "buffer.metrics_port=0"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 2
    assert "refusing to start" in out.stderr and "CurveZMQ" in out.stderr and "python -m buffer.keys" in out.stderr


@pytest.mark.timeout(120)
def test_only_authorised_curve_clients_can_push_or_pull(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    gen = subprocess.run([sys.executable, "-m", "buffer.keys", str(keys), "--actors", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=env)
    assert gen.returncode == 0, gen.stderr
    assert sorted(p.name for p in (keys / "authorized_clients").iterdir()) == [
        "actor-0.key", "actor-1.key", "actor.key", "learner.key", "monitor.key"]
    assert (keys / "learner.key_secret").stat().st_mode & 0o777 == 0o600 and keys.stat().st_mode & 0o777 == 0o700
    again = subprocess.run([sys.executable, "-m", "buffer.keys", str(keys)], cwd=REPO, capture_output=True,
                           text=True, timeout=60, env=env)
    assert again.returncode == 2 and "exists" in again.stderr  # never silently replaces keys
    rogue_dir = tmp_path / "rogue"
    _, rogue_secret = generate_keypair(rogue_dir, "rogue")

    bind_host, connect_host = _non_loopback_host()
    ip, sp = _free_port(bind_host), _free_port(bind_host)
    srv = BufferProc(tmp_path, [
        "learner.batch_groups=1",
        f"buffer.curve.server_secret_key={keys / 'server.key_secret'}",
        f"buffer.curve.authorized_clients_dir={keys / 'authorized_clients'}",
    ])
    srv.overrides += [f"buffer.ingest_addr=tcp://{bind_host}:{ip}", f"buffer.serve_addr=tcp://{bind_host}:{sp}"]
    ingest, serve = f"tcp://{connect_host}:{ip}", f"tcp://{connect_host}:{sp}"
    srv.start()
    try:
        assert srv.info["curve"] is True
        good = client_curve_keys(CurveConfig(server_public_key=str(keys / "server.key"),
                                             client_secret_key=str(keys / "actor-1.key_secret")))
        learner = client_curve_keys(CurveConfig(keys_dir=str(keys)), "learner")
        rogue = client_curve_keys(CurveConfig(server_public_key=str(keys / "server.key"),
                                              client_secret_key=str(rogue_secret)))
        # Wrong client key (server key known): the ZAP handshake fails, nothing is pushed or pulled.
        with SyncSender(ingest, 7, curve=rogue, ack_timeout_s=0.3) as s:
            with pytest.raises(TimeoutError):
                s.send(make_group("rogue"), timeout_s=1.5)
            with pytest.raises(TimeoutError):
                s.acquire(1, timeout_s=1.0)
        with BatchClient(serve, curve=rogue, request_timeout_s=1.0) as c, pytest.raises(TimeoutError):
            c.stats()
        # No CURVE at all: a plain client gets nothing either (its send may even block: no peer ever forms).
        ctx = zmq.Context()
        assert good is not None and rogue is not None
        impostor = type(good)(public=good.public, secret=good.secret, server_public=rogue.public)
        for kind, addr, keys_, frame in [
            (zmq.DEALER, ingest, None, encode(make_group("plain"))),
            (zmq.REQ, serve, None, b"\x80"),
            # Wrong server key (a client that trusts an impostor) cannot talk either.
            (zmq.DEALER, ingest, impostor, encode(make_group("mitm"))),
        ]:
            sock = ctx.socket(kind)
            sock.linger = 0
            sock.sndtimeo = 1000
            apply_client_curve(sock, keys_)
            sock.connect(addr)
            try:
                sock.send(frame)
                assert not sock.poll(1000)
            except zmq.Again:
                pass
            sock.close()
        ctx.term()
        # The authorised client pushes and pulls.
        with SyncSender(ingest, 1, curve=good, ack_timeout_s=2) as s, BatchClient(serve, curve=learner) as c:
            assert s.send(make_group("good", actor_id=1), timeout_s=10).committed  # actor-1's key: its own id
            st = c.stats()
            assert st["accepted_groups"] == 1 and st["rejected_total"] == 0
            # The refused connections above were counted (rogue key, no CURVE, impostor server key).
            assert st["auth_refused_ingest"] >= 3 and st["auth_refused_serve"] >= 2, st
            assert [g.group_id for g in c.get_batch(0, 1, 5).groups] == ["good"]
    finally:
        srv.cleanup()
