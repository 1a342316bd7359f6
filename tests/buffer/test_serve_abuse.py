"""Hostile clients of a real buffer subprocess: the learner version, the serve loop and admission credit.

Each test is the regression test of one way a single client could hurt everyone else: poisoning the
durable learner version, blocking the serve socket with one long batch request, or hoarding credit under
made-up actor ids. Plus the operator's side: ``buffer.inspect`` shows the real map size and repairs the
learner version, and a busy metrics port is named in the start-up error.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq

from buffer.client import BatchClient
from common.config import CurveConfig
from common.protocol import BatchRequest, CreditRequest, ErrorReply, ProtocolError, decode, encode
from common.security import client_curve_keys
from tests.buffer.fixtures import REPO, BufferProc, SyncSender, make_group
from tests.polling import wait_for

ENV = dict(os.environ, PYTHONPATH=str(REPO))


def _inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "buffer.inspect", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=ENV)


def _req(ctx: zmq.Context, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.REQ)
    s.linger = 0
    s.sndtimeo = 5000
    s.connect(addr)
    return s


# ------------------------------------------------------------------------------------ learner version


def test_a_client_cannot_poison_the_learner_version_and_an_operator_can_repair_it(buffer_proc: Any) -> None:
    srv: BufferProc = buffer_proc(["learner.batch_groups=1", "buffer.max_staleness=0", "buffer.learner_version_max_step=1"])
    with SyncSender(srv.ingest_addr, 0) as s, BatchClient(srv.serve_addr, request_timeout_s=10) as c:
        s.send(make_group("v0", version=0), timeout_s=10)
        with pytest.raises(ProtocolError, match="learner_version"):
            c.get_batch(2**62, 1, 0.5)
        assert c.stats()["learner_version"] == 0  # nothing recorded
        assert [g.group_id for g in c.get_batch(0, 1, 5).groups] == ["v0"]  # the group was not made stale
        # The honest learner moves one step per served batch; a jump of two is refused, also when repeated.
        s.send(make_group("v1", version=1), timeout_s=10)
        with pytest.raises(ProtocolError, match="learner_version_max_step"):
            c.get_batch(2, 1, 0.5)
        assert [g.group_id for g in c.get_batch(1, 1, 5).groups] == ["v1"]
        with pytest.raises(TimeoutError):
            c.get_batch(2, 1, 0.2)  # one step past the last served batch: accepted (nothing to serve yet)
        with pytest.raises(ProtocolError, match="learner_version"):
            c.get_batch(3, 1, 0.2)  # recorded 2 without a batch served at 2: 3 is still refused
        assert c.stats()["learner_version"] == 2
    # The operator may not rewrite it under a running server ...
    busy = _inspect(str(srv.path), "--set-learner-version", "7")
    assert busy.returncode == 2 and "running" in busy.stderr, busy.stderr
    srv.stop()
    assert json.loads(_inspect(str(srv.path)).stdout)["learner_version"] == 2  # durable across the restart
    # ... but can once it is stopped, and the server starts from the repaired value.
    fixed = _inspect(str(srv.path), "--set-learner-version", "7")
    assert fixed.returncode == 0, fixed.stderr
    assert "learner_version 2 -> 7" in fixed.stdout
    srv.start()
    with SyncSender(srv.ingest_addr, 0) as s, BatchClient(srv.serve_addr, request_timeout_s=10) as c:
        assert c.stats()["learner_version"] == 7
        s.send(make_group("v8", version=8), timeout_s=10)
        assert [g.group_id for g in c.get_batch(8, 1, 5).groups] == ["v8"]  # 7 + 1: the learner goes on
    h = _inspect("--help")
    assert h.returncode == 0 and "--set-learner-version" in h.stdout and "stopped" in h.stdout


def test_a_client_running_ahead_of_the_learner_cannot_make_the_version_drift(buffer_proc: Any) -> None:
    # With a step of 2 a client may run 2 ahead of the learner's last served request, but never further:
    # served_version follows the version the learner's batches were requested with, not the raised one.
    srv = buffer_proc(["learner.batch_groups=1", "buffer.max_staleness=5", "buffer.learner_version_max_step=2"])
    with SyncSender(srv.ingest_addr, 0) as s, BatchClient(srv.serve_addr, request_timeout_s=10) as c:
        for step in range(4):
            s.send(make_group(f"g{step}", version=step), timeout_s=10)
            assert len(c.get_batch(step, 1, 5).groups) == 1  # the learner's own step
            with pytest.raises(TimeoutError):
                c.get_batch(step + 2, 2, 0.05)  # the client: as far ahead as allowed (nothing to serve)
            with pytest.raises(ProtocolError, match="learner_version"):
                c.get_batch(step + 3, 2, 0.05)  # one more is refused, at every step
        assert c.stats()["learner_version"] == 5  # the learner's 3 + 2


# ------------------------------------------------------------------------------------------ serve loop


def test_batch_request_bounds_name_the_field(buffer_proc: Any) -> None:
    srv = buffer_proc(["buffer.max_batch_groups=64", "buffer.max_batch_wait_s=60"])
    ctx = zmq.Context()
    req = _req(ctx, srv.serve_addr)
    try:
        for body, field, key in [
            (BatchRequest(learner_version=0, n_groups=4096, timeout_ms=2**62), "n_groups", "buffer.max_batch_groups"),
            (BatchRequest(learner_version=0, n_groups=4, timeout_ms=2**62), "timeout_ms", "buffer.max_batch_wait_s"),
        ]:
            t0 = time.monotonic()
            req.send(encode(body))
            assert req.poll(5000), "the buffer did not answer a bad batch request at once"
            reply = decode(req.recv())
            assert isinstance(reply, ErrorReply) and reply.reason == "bad_request", reply
            assert field in reply.message and key in reply.message, reply.message
            assert time.monotonic() - t0 < 5
    finally:
        req.close()
        ctx.term()


def test_other_requests_are_answered_while_a_big_batch_waits_and_a_departed_client_takes_nothing(
        buffer_proc: Any) -> None:
    srv = buffer_proc(["buffer.max_batch_groups=4096", "learner.batch_groups=2"])
    ctx = zmq.Context()
    hog = _req(ctx, srv.serve_addr)
    try:
        hog.send(encode(BatchRequest(learner_version=0, n_groups=4096, timeout_ms=300_000)))
        with BatchClient(srv.serve_addr, request_timeout_s=5) as c:
            wait_for(lambda: c.stats()["batch_waiting"] == 1, 10, "the big request to wait")
            t0 = time.monotonic()
            st = c.stats()  # answered while the 4096-group request waits
            assert time.monotonic() - t0 < 2.0
            assert st["depth_groups"] == 0
            # A second batch request (the learner's) is served while the big one still waits.
            with SyncSender(srv.ingest_addr, 0) as s:
                s.send_many([make_group(f"a{i}") for i in range(2)], timeout_s=10)
                assert [g.group_id for g in c.get_batch(0, 2, 10).groups] == ["a0", "a1"]
                # The hog leaves: its request is dropped, so it cannot swallow the next groups.
                hog.close()
                wait_for(lambda: c.stats()["batch_waiting"] == 0, 10, "the departed client's request to go")
                small = _req(ctx, srv.serve_addr)
                small.send(encode(BatchRequest(learner_version=0, n_groups=2, timeout_ms=60_000)))
                wait_for(lambda: c.stats()["batch_waiting"] == 1, 10, "a small request to wait")
                small.close()
                wait_for(lambda: c.stats()["batch_waiting"] == 0, 10, "the second departed request to go")
                s.send_many([make_group(f"b{i}") for i in range(2)], timeout_s=10)
                assert [g.group_id for g in c.get_batch(0, 2, 10).groups] == ["b0", "b1"]
    finally:
        if not hog.closed:
            hog.close()
        ctx.term()


def test_a_flood_of_waiting_batch_requests_evicts_the_oldest_with_a_timeout_not_an_error(buffer_proc: Any) -> None:
    srv = buffer_proc(["learner.batch_groups=2"])
    ctx = zmq.Context()
    ctx.max_sockets = 4096
    hogs: list[zmq.Socket] = []
    try:
        with BatchClient(srv.serve_addr, request_timeout_s=10) as c, BatchClient(srv.serve_addr) as learner:
            learner_wait = ThreadPoolExecutor(1).submit(learner.get_batch, 0, 2, 60)
            wait_for(lambda: c.stats()["batch_waiting"] == 1, 10, "the learner's request to wait")
            for _ in range(1024):  # the wait list holds 1024: this evicts the learner's (oldest) request
                h = _req(ctx, srv.serve_addr)
                h.send(encode(BatchRequest(learner_version=0, n_groups=4, timeout_ms=300_000)))
                hogs.append(h)
            # A timeout (the learner asks again), not a refusal that would stop it; long before its 60 s.
            with pytest.raises(TimeoutError, match="evicted"):
                learner_wait.result(timeout=30)
            assert c.stats()["batch_waiting"] == 1024
            # The eviction is a timeout reply: counted in the stats and in the metric alike.
            assert c.stats()["batch_timeouts"] == 1
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.info['metrics_port']}/metrics", timeout=10) as r:
                assert "vapo_buffer_batch_timeouts_total 1.0" in r.read().decode()
            for h in hogs:
                h.close()
            wait_for(lambda: c.stats()["batch_waiting"] == 0, 30, "the departed clients' requests to go")
    finally:
        for h in hogs:
            if not h.closed:
                h.close()
        ctx.term()


# ---------------------------------------------------------------------------------------------- credit


def test_made_up_actor_ids_cannot_take_all_credit_and_a_gone_connection_frees_its_credit(buffer_proc: Any) -> None:
    # Admission capacity is max_staleness * batch_groups = 8; one connection may hold at most 2.
    srv = buffer_proc(["buffer.max_staleness=1", "learner.batch_groups=8", "buffer.max_credit_per_actor=2",
                       "buffer.credit_ttl_s=600"])
    ctx = zmq.Context()
    hog = ctx.socket(zmq.DEALER)
    hog.linger = 0
    hog.connect(srv.ingest_addr)
    try:
        for actor_id in range(100, 200):
            hog.send(encode(CreditRequest(actor_id=actor_id, n=100)))
        with BatchClient(srv.serve_addr) as c:
            wait_for(lambda: c.stats()["credit_outstanding"] >= 2, 10, "the hog to be granted something")
            st = c.stats()
            assert st["credit_outstanding"] == 2, st  # the per-connection bound, not the whole capacity
            with SyncSender(srv.ingest_addr, 0, ack_timeout_s=0.5) as real:
                assert real.acquire(2, timeout_s=5).n == 2  # the real actor is not starved
                wait_for(lambda: c.stats()["credit_outstanding"] == 4, 10, "both grants to count")
                hog.close()
                # The hog's connection is gone: its credit stops counting now, not after credit_ttl_s.
                wait_for(lambda: c.stats()["credit_outstanding"] == 2, 10, "the gone connection's credit")
                st = c.stats()
                assert st["credit_waiting"] == 0 and st["admission_capacity"] == 6 and st["credit_released"] == 2
    finally:
        if not hog.closed:
            hog.close()
        ctx.term()


@pytest.mark.timeout(120)
def test_with_curve_an_actor_id_belongs_to_one_client_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    gen = subprocess.run([sys.executable, "-m", "buffer.keys", str(keys), "--actors", "2"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=ENV)
    assert gen.returncode == 0, gen.stderr
    srv = BufferProc(tmp_path, [f"buffer.curve.server_secret_key={keys / 'server.key_secret'}",
                                f"buffer.curve.authorized_clients_dir={keys / 'authorized_clients'}"])
    srv.start()
    try:
        def client(i: int) -> Any:
            return client_curve_keys(CurveConfig(server_public_key=str(keys / "server.key"),
                                                 client_secret_key=str(keys / f"actor-{i}.key_secret")))

        shared = client_curve_keys(CurveConfig(server_public_key=str(keys / "server.key"),
                                               client_secret_key=str(keys / "actor.key_secret")))
        # Id 0 is actor-0's by its key's name; id 5 has no key of its own: the first key to ask (the shared one).
        with SyncSender(srv.ingest_addr, 0, curve=client(0), ack_timeout_s=0.5) as owner, \
                SyncSender(srv.ingest_addr, 5, curve=shared, ack_timeout_s=0.5) as first:
            assert owner.acquire(1, timeout_s=10).n == 1 and first.acquire(1, timeout_s=10).n == 1
            # Refused (ErrorReply actor_key): the thief learns why at once instead of waiting forever.
            for thief_key, actor_id in ((client(1), 0), (shared, 0), (client(1), 5)):
                with SyncSender(srv.ingest_addr, actor_id, curve=thief_key, ack_timeout_s=0.5) as thief, \
                        pytest.raises(ProtocolError, match="credit refused: actor_key"):
                    thief.acquire(1, timeout_s=30)
            with BatchClient(srv.serve_addr, curve=client(0)) as c:  # any role may read the counters
                assert c.stats()["rejected_actor_key"] == 3
            assert owner.acquire(1, timeout_s=10).n == 1  # the owner keeps working
    finally:
        srv.cleanup()


# ----------------------------------------------------------------------------------------- operator


def test_inspect_shows_the_current_map_size(buffer_proc: Any) -> None:
    srv = buffer_proc(["buffer.map_size_bytes=1048576", "buffer.capacity_groups=100000", "actors.max_new_tokens=2000"])
    with SyncSender(srv.ingest_addr, 0) as s, BatchClient(srv.serve_addr) as c:
        s.send_many([make_group(f"m{i}", g=8, length=2000) for i in range(30)], timeout_s=60)  # ~2 MB: grows
        live = int(c.stats()["map_size"])
    assert live > 1 << 20
    out = _inspect(str(srv.path))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["map_size"] == live


def test_a_busy_metrics_port_is_named_in_the_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        srv = BufferProc(tmp_path)
        srv.overrides.append(f"buffer.metrics_port={port}")
        out = subprocess.run([sys.executable, "-m", "buffer", *srv.overrides], cwd=REPO, capture_output=True,
                             text=True, timeout=60, env=ENV)
    assert out.returncode == 1
    assert f"127.0.0.1:{port}" in out.stderr and "buffer.metrics_port" in out.stderr, out.stderr


def test_metrics_bind_error_names_the_port_and_key_of_every_component() -> None:
    from common.metrics import Metrics

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for component, key in [("learner", "learner.metrics_port"), ("actor", "actors.metrics_base_port"),
                               ("launcher", "metrics.launcher_port")]:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}.*{key}"):
                Metrics(component).serve(port, "127.0.0.1")
        with pytest.raises(OSError, match="my.key"):
            Metrics("buffer").serve(port, "127.0.0.1", config_key="my.key")
