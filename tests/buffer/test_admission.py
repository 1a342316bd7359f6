"""Admission on a real LMDB store: the capacity formula, refusals answered on the ingest side, grants carrying
the learner version, credit given back when a connection closes; in a real buffer process, counters re-seeded
after a restart and the credit of actors that died, hung or vanished."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq

from buffer.admission import Admission
from buffer.client import BatchClient
from buffer.frames import FrameRejections
from buffer.store import BufferStore, GroupRecord
from common.config import CurveConfig
from common.metrics import Metrics
from common.protocol import CreditGrant, CreditRequest, ErrorReply, ProtocolError, decode, encode
from common.security import ClientKeys, apply_client_curve, client_curve_keys, generate_run_keys
from tests.buffer.fixtures import REPO, BufferProc, SyncSender, buffer_config, make_group
from tests.polling import wait_for


class Harness:
    def __init__(self, tmp_path: Path, pending_n: int = 0) -> None:
        cfg = buffer_config(tmp_path, ["buffer.max_staleness=1", "learner.batch_groups=4",
                                       "buffer.max_credit_per_actor=3", "buffer.max_credit_per_connection=5"])
        self.store = BufferStore(cfg.buffer_path)
        self.metrics = Metrics("buffer")
        self.sent: list[tuple[bytes, object]] = []
        self.pending = pending_n
        self.admission = Admission(cfg, self.store, metrics=self.metrics, rejections=FrameRejections(self.metrics),
                                   pending_n=lambda: self.pending,
                                   send=lambda ident, frame: self.sent.append((ident, decode(frame))))

    def store_groups(self, n: int) -> None:
        groups = [make_group() for _ in range(n)]
        self.store.put_groups([GroupRecord(g.group_id, encode(g), 0, len(g.samples), []) for g in groups])


def test_capacity_is_staleness_times_batch_plus_the_waiting_request_minus_depth(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    assert h.admission.capacity() == 1 * 4
    h.pending = 4  # a learner waits for a batch of 4
    assert h.admission.capacity() == 8
    h.store_groups(3)
    assert h.admission.capacity() == 5


def test_a_grant_carries_the_learner_version_and_counts_in_flight(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.store.set_learner_version(6)
    h.admission.on_request(b"conn", CreditRequest(actor_id=1, n=3))
    h.admission.grant()
    assert h.sent == [(b"conn", CreditGrant(n=3, learner_version=6))]
    assert h.admission.ledger.in_flight == 3 and h.admission.capacity() == 1
    h.admission.consume(1)  # a group of actor 1 arrived
    assert h.admission.ledger.in_flight == 2
    h.admission.release_connection(b"conn")
    assert h.admission.ledger.in_flight == 0 and h.admission.ledger.released == 2
    assert h.metrics.registry.get_sample_value("vapo_buffer_credit_granted_total") == 3.0


def test_a_request_beyond_capacity_waits_and_is_counted(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.store_groups(4)  # depth 4: no capacity left
    h.admission.on_request(b"conn", CreditRequest(actor_id=1, n=2))
    h.admission.grant()
    assert h.sent == [] and h.admission.ledger.waiting == 1
    assert h.metrics.registry.get_sample_value("vapo_buffer_admission_waits_total") == 1.0


def test_a_refused_request_is_answered_with_its_reason(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.admission.on_request(b"conn", CreditRequest(actor_id=1, n=1), key="key-a")
    h.admission.on_request(b"other", CreditRequest(actor_id=1, n=1), key="key-b")  # actor 1 belongs to key-a
    ((ident, reply),) = h.sent
    assert ident == b"other" and isinstance(reply, ErrorReply) and reply.reason == "actor_key"
    assert h.admission.rejections.by_reason == {"actor_key": 1}


# ---------------------------------------------------------------- identity and fair share, real server and ZeroMQ


def _key_file(keys: Path, name: str) -> ClientKeys:
    """The client keys of ``keys/<name>.key_secret`` (named explicitly: works on any version of the loader)."""
    k = client_curve_keys(CurveConfig(client_secret_key=str(keys / f"{name}.key_secret"),
                                      server_public_key=str(keys / "server.key")))
    assert k is not None
    return k


def _greedy(ctx: zmq.Context, addr: str, keys: ClientKeys, actor_id: int, n: int) -> zmq.Socket:
    """A connection with the shared actor key asking ``n`` credits for a made-up actor id, never using them."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    apply_client_curve(sock, keys)
    sock.connect(addr)
    sock.send(encode(CreditRequest(actor_id=actor_id, n=n)))
    return sock


def _granted(sock: zmq.Socket, total: int, timeout_s: float = 10.0) -> int:
    """Read grants on ``sock`` until ``total`` credits arrived (or fail)."""
    got = [0]

    def more() -> bool:
        while sock.poll(0):
            msg = decode(sock.recv())
            assert isinstance(msg, CreditGrant), msg
            got[0] += msg.n
        return got[0] >= total

    wait_for(more, timeout_s, f"{total} credits granted to the greedy connection")
    return got[0]


def _take(sender: SyncSender, n: int, timeout_s: float) -> int:
    """Acquire until ``n`` credits were granted (acquire returns as soon as one is)."""
    deadline = time.monotonic() + timeout_s
    got = 0
    while got < n:
        got += sender.acquire(n - got, timeout_s=max(0.1, deadline - time.monotonic())).n
    return got


def _served_despite_greedy(tmp_path: Path, overrides: list[str], greedy: list[tuple[int, int]], batch: int) -> None:
    """Greedy connections with the shared key take all credit first; a learner waits for a batch; the real
    actor 0 (its own key) must still get ``batch`` credits and the learner its batch."""
    keys = generate_run_keys(tmp_path / "keys", actors=1)
    srv = BufferProc(tmp_path, [f"buffer.curve.keys_dir={keys}", *overrides]).start()
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    try:
        shared = _key_file(keys, "actor")
        for actor_id, n in greedy[:1]:  # right after "buffer up": alone, it takes the whole bound
            socks.append(_greedy(ctx, srv.ingest_addr, shared, actor_id, n))
        first = _granted(socks[0], 1)
        with ThreadPoolExecutor(1) as pool:
            learner = pool.submit(_one_batch, srv.serve_addr, _key_file(keys, "learner"), batch)
            for actor_id, n in greedy[1:]:
                socks.append(_greedy(ctx, srv.ingest_addr, shared, actor_id, n))
            # The learner's waiting request raises the bound; the greedy party, alone, takes that too.
            with BatchClient(srv.serve_addr, curve=_key_file(keys, "monitor")) as probe:
                wait_for(lambda: probe.stats()["admission_capacity"] == 0 and probe.stats()["credit_outstanding"]
                         >= first + batch, 20, "the greedy connections to hold all the credit")
            with SyncSender(srv.ingest_addr, 0, curve=_key_file(keys, "actor-0"), ack_timeout_s=1) as actor:
                assert _take(actor, batch, timeout_s=10) == batch
                acks = actor.send_many([make_group(f"real-{i}", seed=i) for i in range(batch)], timeout_s=20)
                assert all(a.committed and not a.error for a in acks), acks
            got = learner.result(timeout=30)
        assert sorted(got) == sorted(f"real-{i}" for i in range(batch))
    finally:
        for s in socks:
            s.close()
        ctx.term()
        srv.cleanup()


def _one_batch(addr: str, keys: ClientKeys, n: int) -> list[str]:
    with BatchClient(addr, curve=keys) as c:
        return [g.group_id for g in c.get_batch(0, n, 25).groups]


@pytest.mark.timeout(90)
def test_one_greedy_connection_of_the_shared_key_cannot_starve_the_real_actor(tmp_path: Path) -> None:
    # ops/configs/smoke.yaml's shape: batch 4, k = 1, 8 prompts in flight (so 16 credits per actor id).
    _served_despite_greedy(tmp_path, ["learner.batch_groups=4", "buffer.max_staleness=1",
                                      "actors.prompts_in_flight=8"], [(7, 16)], batch=4)


@pytest.mark.timeout(90)
def test_two_greedy_connections_cannot_starve_the_real_actor_with_the_default_bounds(tmp_path: Path) -> None:
    # The default config's bounds: batch 32, k = 1, 16 prompts in flight (32 credits per actor id and connection).
    _served_despite_greedy(tmp_path, ["learner.batch_groups=32", "buffer.max_staleness=1",
                                      "actors.prompts_in_flight=16"], [(5, 32), (6, 32)], batch=32)


@pytest.mark.timeout(60)
def test_an_actor_key_acts_for_its_own_actor_id_only(tmp_path: Path) -> None:
    keys = generate_run_keys(tmp_path / "keys", actors=2)
    srv = BufferProc(tmp_path, [f"buffer.curve.keys_dir={keys}", "learner.batch_groups=4"]).start()
    try:
        # actor-1's key asking credit for id 0, the shared key asking for id 1 (which has a key of its own).
        for name, actor_id in (("actor-1", 0), ("actor", 1)):
            with SyncSender(srv.ingest_addr, actor_id, curve=_key_file(keys, name), ack_timeout_s=1) as s:
                with pytest.raises(ProtocolError, match="actor_key"):
                    s.acquire(1, timeout_s=10)
        # A group stamped with another actor's id is refused for good, and counted.
        with SyncSender(srv.ingest_addr, 1, curve=_key_file(keys, "actor-1"), ack_timeout_s=1) as s:
            ack = s.send(make_group("not-mine", actor_id=0), timeout_s=10)
            assert not ack.committed and ack.error.startswith("invalid:actor_key"), ack
            assert s.send(make_group("mine", actor_id=1), timeout_s=10).committed
        with BatchClient(srv.serve_addr, curve=_key_file(keys, "monitor")) as probe:
            st = probe.stats()
        assert st["depth_groups"] == 1 and st["rejected_actor_key"] == 2, st
    finally:
        srv.cleanup()


def test_admission_counters_reseeded_after_restart(buffer_proc: Any) -> None:
    k, batch = 1, 4
    # The learner version starts at 3 on a fresh buffer: allow the jump (the default refuses it).
    srv = buffer_proc([f"buffer.max_staleness={k}", f"learner.batch_groups={batch}", "buffer.learner_version_max_step=3"])
    with BatchClient(srv.serve_addr) as c, SyncSender(srv.ingest_addr, 0, ack_timeout_s=1.0) as s:
        for _ in range(3):
            with pytest.raises(TimeoutError):
                c.get_batch(3, batch, 0.05)  # learner at version 3; nothing waiting yet
        g = s.acquire(8, timeout_s=5)
        assert g.n == k * batch and g.learner_version == 3  # capacity = k*B with no pending request
        s.send_many([make_group(version=3, actor_id=0) for _ in range(g.n)], timeout_s=10)
        assert c.stats()["admission_capacity"] == 0
    srv.kill()
    srv.start()
    with BatchClient(srv.serve_addr) as c, SyncSender(srv.ingest_addr, 0, ack_timeout_s=0.3) as s:
        st = c.stats()
        assert st["learner_version"] == 3 and st["depth_groups"] == k * batch
        assert st["admission_capacity"] == 0  # re-seeded from LMDB, not reset to a fresh start
        with pytest.raises(TimeoutError):
            s.acquire(1, timeout_s=0.5)
        # A stale group (older than 3 - k) is recorded, acknowledged, and never stored.
        ack = s.send(make_group("old", version=1), timeout_s=5)
        assert ack.committed and ack.error == "stale"
        assert c.get_batch(3, batch, 5).groups[0].weight_version == 3
        assert s.acquire(1, timeout_s=5).n == 1  # consumption re-opened admission


# Credit in flight held by actors that died, hung or vanished (real buffer subprocess).


def test_unused_credit_expires_and_withdrawn_requests_are_not_granted(buffer_proc: Any) -> None:
    srv = buffer_proc(["buffer.max_staleness=1", "learner.batch_groups=2", "buffer.credit_ttl_s=0.5"])
    with SyncSender(srv.ingest_addr, 0, ack_timeout_s=0.2) as s, BatchClient(srv.serve_addr) as c:
        assert s.acquire(2, timeout_s=5).n == 2  # the whole k*B, then the actor dies without sending
        assert c.stats()["admission_capacity"] == 0
        wait_for(lambda: c.stats()["admission_capacity"] == 2, 10, "the unused grant to expire")
        with SyncSender(srv.ingest_addr, 1, ack_timeout_s=0.2) as other:
            assert other.acquire(2, timeout_s=5).n == 2
            with pytest.raises(TimeoutError):
                other.acquire(1, timeout_s=0.3)
            # The timed-out request was withdrawn: nothing is granted to it later.
            wait_for(lambda: c.stats()["credit_waiting"] == 0, 10, "the withdrawal")
            other.send_many([make_group(f"e{i}", actor_id=1) for i in range(2)], timeout_s=10)
            c.get_batch(0, 2, 5)
            assert c.stats()["admission_capacity"] == 2
            assert other.credits == 0


def test_restarted_actor_gets_credit_its_dead_predecessor_held(buffer_proc: Any) -> None:
    # An actor hung after a grant (its connection still open, so nothing tells the buffer it is gone) must
    # not block its replacement (same actor id) until credit_ttl_s. A closed connection frees its credit
    # at once (tests/buffer/test_serve_abuse.py).
    srv = buffer_proc(["buffer.max_staleness=1", "learner.batch_groups=2", "buffer.credit_ttl_s=600"])
    with BatchClient(srv.serve_addr) as c, SyncSender(srv.ingest_addr, 0, ack_timeout_s=0.2) as hung:
        assert hung.acquire(2, timeout_s=5).n == 2
        assert c.stats()["admission_capacity"] == 0
        with SyncSender(srv.ingest_addr, 0, ack_timeout_s=0.2) as replacement:
            assert replacement.acquire(2, timeout_s=5).n == 2
            replacement.send_many([make_group(f"r{i}", actor_id=0) for i in range(2)], timeout_s=10)
            assert len(c.get_batch(0, 2, 5).groups) == 2


_HOLD_CREDIT = """
import sys, time
from tests.buffer.fixtures import SyncSender
s = SyncSender({addr!r}, {actor})
print('granted', s.acquire(2, timeout_s=10).n, flush=True)
if {busy}:
    while True:  # Python busy, holding the GIL: libzmq's own thread still answers the heartbeats
        pass
time.sleep(600)
"""


def _credit_holder(addr: str, actor: int, busy: bool) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLD_CREDIT.format(addr=addr, actor=actor, busy=busy)],
                         cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "granted 2"
    return p


def test_a_vanished_actor_loses_its_credit_within_peer_timeout_a_busy_one_keeps_it(buffer_proc: Any) -> None:
    # A host that vanishes closes no connection: stopped (SIGSTOP), the actor's process answers nothing, as
    # a dead host's would. Its unused credit comes back within buffer.peer_timeout_s, not credit_ttl_s.
    srv = buffer_proc(["buffer.max_staleness=2", "learner.batch_groups=2", "buffer.credit_ttl_s=600",
                       "buffer.peer_timeout_s=1"])
    gone, busy = _credit_holder(srv.ingest_addr, 0, busy=False), _credit_holder(srv.ingest_addr, 1, busy=True)
    try:
        with BatchClient(srv.serve_addr) as c:
            assert c.stats()["credit_outstanding"] == 4
            gone.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            wait_for(lambda: c.stats()["credit_released"] == 2, 10, "the vanished actor's credit to come back")
            assert time.monotonic() - t0 < 5
            # The busy one (same timeout, past it by now) still holds its grant.
            t1 = time.monotonic()
            wait_for(lambda: time.monotonic() - t1 > 2 or c.stats()["credit_outstanding"] != 2, 10, "3 timeouts")
            assert c.stats()["credit_outstanding"] == 2 and busy.poll() is None
    finally:
        for p in (gone, busy):
            p.kill()
            p.wait()
