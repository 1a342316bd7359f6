"""The buffer server as a real subprocess: crash safety, hostile input, staleness, storage (positives through the
server: test_positives.py)."""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from buffer.client import BatchClient
from buffer.store import BufferStore
from common.protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    IngestAck,
    SampleGroup,
    decode,
    encode,
)
from tests.buffer.fixtures import REPO, BufferProc, SyncSender, make_group
from tests.polling import wait_for


def stored_group_ids(path: Path) -> list[str]:
    st = BufferStore(path)
    try:
        out = []
        for f in st.iter_group_frames():
            g = decode(f)
            assert isinstance(g, SampleGroup)
            out.append(g.group_id)
        return out
    finally:
        st.close()


# --------------------------------------------------------------------------------------------- crash


def test_sigkill_mid_stream_loses_no_acked_group_and_stores_retries_once(buffer_proc: Any) -> None:
    n_senders, per_sender = 4, 120
    srv: BufferProc = buffer_proc(["buffer.commit_batch=8", "buffer.capacity_groups=100000"])
    acked_before_kill: set[str] = set()
    acked: list[set[str]] = [set() for _ in range(n_senders)]
    resent = [0] * n_senders
    killed = threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def sender(a: int) -> None:
        try:
            with SyncSender(srv.ingest_addr, a, ack_timeout_s=0.5) as s:
                for i in range(0, per_sender, 4):
                    groups = [make_group(f"a{a}-{j}", version=0, length=64, actor_id=a) for j in range(i, i + 4)]
                    for ack in s.send_many(groups, timeout_s=60):
                        assert ack.committed
                        with lock:
                            acked[a].add(ack.group_id)
                            if not killed.is_set():
                                acked_before_kill.add(ack.group_id)
                resent[a] = s.resent
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=sender, args=(a,)) for a in range(n_senders)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(len(x) for x in acked) >= 150, 60, "150 acks before the kill")
    with lock:
        killed.set()
        n_before = len(acked_before_kill)
    assert srv.kill() == -9
    # Every group acknowledged before the kill is on disk, exactly once, before anything is re-sent.
    on_disk = stored_group_ids(srv.path)
    assert len(on_disk) == len(set(on_disk))
    assert acked_before_kill <= set(on_disk), "an acknowledged group was lost"
    srv.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert n_before < n_senders * per_sender  # the kill really was mid-stream
    srv.stop()
    ids = stored_group_ids(srv.path)
    expected = {f"a{a}-{j}" for a in range(n_senders) for j in range(per_sender)}
    assert len(ids) == len(set(ids)), "a group was stored twice"
    assert set(ids) == expected
    assert set().union(*acked) == expected
    assert sum(resent) > 0  # groups in flight at the kill were re-sent with their group_id


# ------------------------------------------------------------------------------------------ bad input


def _hostile_frames(rng: random.Random, valid: bytes, max_frame: int) -> list[tuple[str, list[bytes]]]:
    body = msgpack.unpackb(valid, raw=False)
    out: list[tuple[str, list[bytes]]] = []
    wrong_version = dict(body, v=PROTOCOL_VERSION + 1)
    neg = json.loads(json.dumps({k: v for k, v in body.items() if k != "samples"}))
    neg_samples = [dict(s) for s in body["samples"]]
    neg_samples[0] = dict(neg_samples[0], output_ids={"dtype": "<i4", "n": -5, "data": b""})
    kinds = [
        ("garbage", lambda: [rng.randbytes(rng.randint(1, 300))]),
        ("version", lambda: [msgpack.packb(wrong_version, use_bin_type=True)]),
        ("oversized", lambda: [valid + b"\x00" * (max_frame + 1 - len(valid))]),
        ("truncated", lambda: [valid[: rng.randint(1, len(valid) - 1)]]),
        ("negative", lambda: [msgpack.packb(dict(neg, samples=neg_samples, v=PROTOCOL_VERSION, type="SampleGroup"),
                                            use_bin_type=True)]),
        ("bitflip", lambda: [_flip(valid, rng)]),
        ("multipart", lambda: [valid, valid]),
        ("wrong_type", lambda: [encode(IngestAck(group_id="x", committed=True, duplicate=False, error=""))]),
        ("not_a_map", lambda: [msgpack.packb([1, 2, 3])]),
        ("empty", lambda: [b""]),
    ]
    for i in range(10_000):
        name, make = kinds[i % len(kinds)]
        out.append((name, make()))
    return out


def _flip(frame: bytes, rng: random.Random) -> bytes:
    b = bytearray(frame)
    # Flip bytes in the header region, where msgpack type markers and lengths live; a flip inside raw
    # token data could still be a valid group, which must be accepted, not counted.
    for _ in range(3):
        b[rng.randint(0, 40)] ^= 0xFF
    return bytes(b)


def test_ten_thousand_hostile_frames_are_counted_and_valid_traffic_still_flows(buffer_proc: Any) -> None:
    max_frame = 32 * 1024
    srv = buffer_proc([f"buffer.max_frame_bytes={max_frame}", "learner.batch_groups=2"])
    rng = random.Random(0)
    valid = encode(make_group("template", length=16))
    frames = _hostile_frames(rng, valid, max_frame)
    # Bit flips that still decode are not hostile: replace them with garbage so the count is exact.
    for i, (name, parts) in enumerate(frames):
        if name == "bitflip":
            try:
                decode(parts[0], max_frame)
                frames[i] = ("garbage", [b"\xc1" + parts[0]])
            except Exception:
                pass
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.sndtimeo = 10_000  # a dead server fails the test instead of hanging it
    dealer.connect(srv.ingest_addr)
    req = ctx.socket(zmq.REQ)
    req.linger = 0
    req.sndtimeo = 10_000
    req.connect(srv.serve_addr)
    n_ingest = 9000
    replies = 0
    sender = SyncSender(srv.ingest_addr, 1, ack_timeout_s=2.0)
    client = BatchClient(srv.serve_addr, request_timeout_s=10)
    try:
        for start in range(0, n_ingest, 500):
            for _, parts in frames[start:start + 500]:
                dealer.send_multipart(parts)
            for _ in range(500):
                assert dealer.poll(10_000), "server stopped answering hostile frames"
                reply = decode(dealer.recv())
                assert isinstance(reply, ErrorReply)
                replies += 1
            # Valid traffic interleaved with the attack still gets through.
            ack = sender.send(make_group(f"ok{start}", length=16), timeout_s=10)
            assert ack.committed and not ack.duplicate
        for _, parts in frames[n_ingest:]:
            req.send_multipart(parts)
            assert req.poll(10_000)
            assert isinstance(decode(req.recv()), ErrorReply)
        stats = client.stats()
        assert stats["rejected_total"] == 10_000
        assert stats["accepted_groups"] == n_ingest // 500
        reasons = {k: v for k, v in stats.items() if k.startswith("rejected_") and k != "rejected_total"}
        assert {"rejected_malformed", "rejected_version", "rejected_oversized", "rejected_multipart",
                "rejected_unexpected_type", "rejected_bad_length"} <= set(reasons)
        reply = client.get_batch(0, 2, timeout_s=5)
        assert [g.group_id for g in reply.groups] == ["ok0", "ok500"]
        metrics = _scrape(srv.info["metrics_port"])
        counted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("vapo_buffer_rejected_frames_total{"))
        assert counted == 10_000
    finally:
        sender.close()
        client.close()
        dealer.close()
        req.close()
        ctx.term()


def _scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


# ------------------------------------------------------------------------------------------ staleness


def _run_pipeline(srv: BufferProc, k: int, batch: int, steps: int, n_actors: int, respect_credit: bool,
                  train_s: float = 0.03) -> tuple[list[tuple[int, list[int]]], dict[str, float], int]:
    """Fast actors, slow learner. Actors stamp groups with the newest version the learner published."""
    published = [0]
    stop = threading.Event()
    errors: list[BaseException] = []
    max_depth = [0]

    def actor(a: int) -> None:
        try:
            with SyncSender(srv.ingest_addr, a, ack_timeout_s=1.0) as s:
                i = 0
                while not stop.is_set():
                    if respect_credit:
                        try:
                            grant = s.acquire(1, timeout_s=0.2)
                        except TimeoutError:
                            continue
                        assert grant.learner_version <= published[0]
                    # "weight sync": the actor's engine serves the newest published version
                    s.send(make_group(f"a{a}-{i}", version=published[0], actor_id=a, g=2), timeout_s=10)
                    i += 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=actor, args=(a,), daemon=True) for a in range(n_actors)]
    for t in threads:
        t.start()
    served: list[tuple[int, list[int]]] = []
    with BatchClient(srv.serve_addr) as client:
        for v in range(steps):
            reply = client.get_batch(v, batch, timeout_s=30)
            served.append((v, [g.weight_version for g in reply.groups]))
            max_depth[0] = max(max_depth[0], int(client.stats()["depth_groups"]))
            time.sleep(train_s)  # the learner's training step (simulated work, not synchronisation)
            published[0] = v + 1
        stop.set()
        for t in threads:
            t.join(timeout=20)
        stats = client.stats()
    assert not errors, errors
    return served, stats, max_depth[0]


@pytest.mark.parametrize("k", [0, 2])
def test_admission_bounds_staleness_and_keeps_stale_drops_near_zero(buffer_proc: Any, k: int) -> None:
    batch, steps = 4, 12
    srv = buffer_proc([f"buffer.max_staleness={k}", f"learner.batch_groups={batch}"])
    served, stats, max_depth = _run_pipeline(srv, k, batch, steps, n_actors=3, respect_credit=True)
    for v, versions in served:
        assert len(versions) == batch
        assert min(versions) >= v - k, (v, versions)
        if k == 0:
            assert versions == [v] * batch  # synchronous: every sample from the current policy
    assert stats["stale_dropped"] <= 1, stats["stale_dropped"]  # near zero: actors generated only what was needed
    assert max_depth <= (k + 1) * batch
    waits = [line for line in _scrape(srv.info["metrics_port"]).splitlines()
             if line.startswith("vapo_buffer_admission_waits_total ")]
    assert float(waits[0].split()[1]) > 0  # actors really were held back


def test_without_admission_stale_groups_are_dropped_not_served(buffer_proc: Any) -> None:
    k, batch = 1, 4
    srv = buffer_proc([f"buffer.max_staleness={k}", f"learner.batch_groups={batch}",
                       "buffer.capacity_groups=100000"])
    served, stats, _ = _run_pipeline(srv, k, batch, steps=6, n_actors=2, respect_credit=False, train_s=0.1)
    for v, versions in served:
        assert min(versions) >= v - k, (v, versions)
    assert stats["stale_dropped"] > 0  # flooding actors outpace the learner: the bound is enforced


# -------------------------------------------------------------------------------- filters and capacity


def test_uniform_groups_filtered_and_counted(buffer_proc: Any) -> None:
    srv = buffer_proc(["buffer.filter_uniform_groups=true", "learner.batch_groups=2"])
    with SyncSender(srv.ingest_addr, 0) as s, BatchClient(srv.serve_addr) as c:
        acks = s.send_many([make_group("u0", rewards=[0, 0, 0, 0]), make_group("u1", rewards=[1, 1, 1, 1]),
                            make_group("m0"), make_group("m1")], timeout_s=10)
        assert [a.error for a in acks] == ["filtered:uniform_reward"] * 2 + ["", ""]
        assert all(a.committed for a in acks)
        reply = c.get_batch(0, 2, 5)
        # send_many sends concurrently: until the socket connects each send retries on its own, so the
        # arrival (and serving) order of m0 and m1 is not fixed; which groups are served is.
        assert sorted(g.group_id for g in reply.groups) == ["m0", "m1"] and reply.filtered == 2
        assert c.stats()["filtered"] == 2
        assert 'vapo_buffer_filtered_groups_total{reason="uniform_reward"} 2.0' in _scrape(srv.info["metrics_port"])


def test_capacity_in_groups_refuses_then_accepts_after_serving(buffer_proc: Any) -> None:
    srv = buffer_proc(["buffer.capacity_groups=3", "learner.batch_groups=2"])
    with SyncSender(srv.ingest_addr, 0, ack_timeout_s=0.3) as s, BatchClient(srv.serve_addr) as c:
        s.send_many([make_group(f"c{i}") for i in range(3)], timeout_s=10)
        with pytest.raises(TimeoutError):
            s.send(make_group("c3"), timeout_s=1.0)  # refused as full, retried, still full
        assert c.stats()["depth_groups"] == 3
        c.get_batch(0, 2, 5)
        assert s.send(make_group("c3"), timeout_s=10).committed
        with pytest.raises(Exception, match="bad_request"):
            c.get_batch(0, 4, 1)  # more than capacity_groups could ever hold


def test_batch_timeout_takes_nothing(buffer_proc: Any) -> None:
    srv = buffer_proc(["learner.batch_groups=4"])
    with SyncSender(srv.ingest_addr, 0) as s, BatchClient(srv.serve_addr) as c:
        s.send(make_group("only"), timeout_s=10)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="1 of 4"):
            c.get_batch(0, 4, 0.3)
        assert 0.25 < time.monotonic() - t0 < 5
        assert c.stats()["depth_groups"] == 1


def test_batch_request_waits_for_groups_arriving_later(buffer_proc: Any) -> None:
    srv = buffer_proc(["learner.batch_groups=2"])
    result: list[Any] = []

    def learner() -> None:
        with BatchClient(srv.serve_addr) as c:
            result.append(c.get_batch(0, 2, 20))

    t = threading.Thread(target=learner)
    t.start()
    with SyncSender(srv.ingest_addr, 0) as s:
        s.send(make_group("late0"), timeout_s=10)
        s.send(make_group("late1"), timeout_s=10)
    t.join(timeout=30)
    assert [g.group_id for g in result[0].groups] == ["late0", "late1"]


# ------------------------------------------------------------------------------------------- storage


def test_disk_full_is_an_error_ack_and_a_metric_not_a_crash(tmp_path: Path) -> None:
    limit = 3 << 20

    def small_disk() -> None:  # RLIMIT_FSIZE: writes past 3 MiB fail with EFBIG, like a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    srv = BufferProc(tmp_path, ["buffer.map_size_bytes=1048576", "learner.batch_groups=2", "actors.max_new_tokens=2000",
                                "buffer.capacity_groups=100000"])
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    orig_popen = subprocess.Popen

    def popen(*a: Any, **kw: Any) -> Any:
        return orig_popen(*a, **dict(kw, preexec_fn=small_disk, env=env))

    subprocess.Popen = popen  # type: ignore[misc]
    try:
        srv.start()
    finally:
        subprocess.Popen = orig_popen  # type: ignore[misc]
    try:
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)  # one frame at a time, to see the first refused ack
        dealer.linger = 0
        dealer.sndtimeo = 20_000
        dealer.connect(srv.ingest_addr)
        with BatchClient(srv.serve_addr) as c:
            acked = 0
            failure: IngestAck | None = None
            for i in range(200):  # 200 x ~64 KB: far past the limit
                dealer.send(encode(make_group(f"d{i}", g=8, length=2000)))
                assert dealer.poll(20_000), "server stopped answering"
                ack = decode(dealer.recv())
                assert isinstance(ack, IngestAck)
                if not ack.committed:
                    failure = ack
                    break
                acked += 1
            assert failure is not None and failure.error.startswith("storage: file_too_large"), failure
            assert acked > 0
            st = c.stats()
            assert st["storage_errors"] >= 1 and st["depth_groups"] == acked
            assert "vapo_buffer_storage_errors_total" in _scrape(srv.info["metrics_port"])
            # Still serving what was committed.
            reply = c.get_batch(0, 2, 5)
            assert [g.group_id for g in reply.groups] == ["d0", "d1"]
        dealer.close()
        ctx.term()
        srv.kill()
        st2 = BufferStore(srv.path)  # the files are intact and hold exactly the acknowledged groups
        assert st2.counters["depth_groups"] == acked - 2 == len(st2.iter_group_frames())
        st2.close()
    finally:
        srv.cleanup()


# ----------------------------------------------------------------------------------------------- CLIs


def test_inspect_cli_while_server_runs(buffer_proc: Any) -> None:
    srv = buffer_proc()
    with SyncSender(srv.ingest_addr, 0) as s:
        # A fresh buffer (learner version 0) takes weight versions up to 3 (buffer.ingest.version_limit).
        s.send_many([make_group(version=v, rewards=[1, 0, 0, 0]) for v in (2, 1, 3)], timeout_s=10)
    out = subprocess.run([sys.executable, "-m", "buffer.inspect", str(srv.path)], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["groups"] == 3 and info["samples"] == 12 and info["positives"] == 3
    assert (info["min_weight_version"], info["max_weight_version"]) == (1, 3)
    assert info["bytes_on_disk"] > 0
    bad = subprocess.run([sys.executable, "-m", "buffer.inspect", str(srv.path / "missing")], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert bad.returncode == 2 and "not an LMDB buffer" in bad.stderr


def test_cli_help_and_bad_config() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    h = subprocess.run([sys.executable, "-m", "buffer", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env=env)
    assert h.returncode == 0 and "usage: python -m buffer" in h.stdout
    bad = subprocess.run([sys.executable, "-m", "buffer", "buffer.max_staleness=-1"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "buffer.max_staleness" in bad.stderr


def test_groups_numpy_roundtrip_through_server(buffer_proc: Any) -> None:
    srv = buffer_proc(["learner.batch_groups=1"])
    g = make_group("rt", length=33, rewards=[0.0, 1.0, 0.5, 1.0])
    with SyncSender(srv.ingest_addr, 0) as s, BatchClient(srv.serve_addr) as c:
        s.send(g, timeout_s=10)
        got = c.get_batch(0, 1, 5).groups[0]
    assert got == g
    assert np.array_equal(got.samples[1].output_logprobs, g.samples[1].output_logprobs)
