"""Clients against a real server: asyncio sender under concurrency, re-send across a restart, lazy pirate."""

from __future__ import annotations

import asyncio
import resource
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from buffer.client import AsyncGroupSender, BatchClient, BufferStorageFailed
from common.protocol import PositivesReply, decode
from tests.buffer.fixtures import SyncSender, make_group
from tests.polling import wait_for


def test_async_sender_concurrent_tasks_credit_and_acks(buffer_proc: Any) -> None:
    srv = buffer_proc(["buffer.max_staleness=1", "learner.batch_groups=4"])

    async def main() -> list[Any]:
        async with AsyncGroupSender(srv.ingest_addr, 3, ack_timeout_s=1.0) as s:
            async def one(i: int) -> Any:
                grant = await s.acquire(1, timeout_s=10)
                assert grant.n == 1
                return await s.send(make_group(f"t{i}", actor_id=3), timeout_s=10)

            acks = await asyncio.gather(*(one(i) for i in range(4)))  # k*B = 4 credits, all at once
            with pytest.raises(TimeoutError):
                await s.acquire(1, timeout_s=0.5)  # no more capacity until the learner asks
            dup = await s.send(make_group("t0", actor_id=3), timeout_s=10)
            assert dup.duplicate and dup.committed
            return acks

    acks = asyncio.run(main())
    assert sorted(a.group_id for a in acks) == [f"t{i}" for i in range(4)]
    assert all(a.committed and not a.duplicate for a in acks)
    with BatchClient(srv.serve_addr) as c:
        st = c.stats()
        assert st["accepted_groups"] == 4 and st["credit_outstanding"] == 0


def test_async_sender_waits_for_credit_then_gets_it_when_learner_asks(buffer_proc: Any) -> None:
    # The learner version starts at 5 on a fresh buffer: allow the jump (the default refuses it).
    srv = buffer_proc(["buffer.max_staleness=0", "learner.batch_groups=2", "buffer.learner_version_max_step=5"])
    got: list[Any] = []

    async def actor() -> None:
        async with AsyncGroupSender(srv.ingest_addr, 0, ack_timeout_s=0.5) as s:
            grants = await asyncio.gather(s.acquire(1, timeout_s=20), s.acquire(1, timeout_s=20))
            got.extend(grants)
            for i in range(2):
                await s.send(make_group(f"s{i}", version=grants[0].learner_version), timeout_s=10)

    t = threading.Thread(target=lambda: asyncio.run(actor()))
    t.start()
    with BatchClient(srv.serve_addr) as c:
        wait_for(lambda: c.stats()["credit_waiting"] == 1, 10, "the actor to wait for credit")
        assert not got  # synchronous mode: no work before the learner asks
        reply = c.get_batch(5, 2, timeout_s=20)
    t.join(timeout=30)
    assert [g.n for g in got] == [1, 1] and {g.learner_version for g in got} == {5}
    assert [g.weight_version for g in reply.groups] == [5, 5]


async def until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """``tests.polling.wait_for`` for coroutines: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)  # the poll interval, not synchronisation: cond() decides


def test_async_sender_resends_across_server_restart(buffer_proc: Any) -> None:
    srv = buffer_proc()

    async def main() -> Any:
        async with AsyncGroupSender(srv.ingest_addr, 0, ack_timeout_s=0.3) as s:
            assert (await s.send(make_group("warm"), timeout_s=10)).committed  # connected
            srv.proc.send_signal(signal.SIGSTOP)  # connected but silent: the frame is sent, no ack comes
            task = asyncio.create_task(s.send(make_group("across"), timeout_s=30))
            # Silent for two ack timeouts: the sender has re-sent and reconnected (still no ack).
            await until(lambda: s.reconnects >= 1, 10, "the sender to re-send and reconnect")
            assert not task.done() and s.resent >= 2
            srv.kill()  # the frames it received were never committed
            await asyncio.get_running_loop().run_in_executor(None, srv.start)
            ack = await task
            return ack, s.resent

    ack, resent = asyncio.run(main())
    assert ack.committed and resent >= 1
    with BatchClient(srv.serve_addr) as c:
        assert c.stats()["accepted_groups"] == 2


def test_batch_client_recovers_after_server_restart(buffer_proc: Any) -> None:
    srv = buffer_proc(["learner.batch_groups=1"])
    c = BatchClient(srv.serve_addr, request_timeout_s=0.5)
    try:
        assert c.stats()["depth_groups"] == 0
        srv.kill()
        with pytest.raises(TimeoutError):
            c.stats()
        srv.start()
        with SyncSender(srv.ingest_addr, 0) as s:
            s.send(make_group("r"), timeout_s=10)
        assert c.stats()["depth_groups"] == 1  # a fresh REQ socket after the lost reply
        assert c.get_batch(0, 1, 5).groups[0].group_id == "r"
    finally:
        c.close()


def test_batch_and_positives_frames_are_the_exact_decoded_replies(buffer_proc: Any) -> None:
    srv = buffer_proc(["learner.batch_groups=2"])
    groups = [make_group(f"f{i}", rewards=[0.0, 1.0, 1.0, 0.0], seed=40 + i) for i in range(2)]

    async def send() -> None:
        async with AsyncGroupSender(srv.ingest_addr, 0) as s:
            for g in groups:
                assert (await s.send(g, timeout_s=10)).committed

    asyncio.run(send())
    with BatchClient(srv.serve_addr) as c:
        samples, pos_frame = c.positives_frame(10)
        assert len(samples) == 4  # two groups x two samples with reward 1
        assert decode(pos_frame) == PositivesReply(samples=samples)
        reply, frame = c.get_batch_frame(0, 2, 10)
        assert [g.group_id for g in reply.groups] == ["f0", "f1"]
        assert decode(frame, 1 << 40) == reply
        assert reply.groups[0] == groups[0]


def _learner_fetch(client: BatchClient, n: int, timeout_s: float) -> list[str]:
    """learner.data.BufferSource's loop (without importing torch): turns of <= 5 s (MAX_REQUEST_WAIT_S) until
    ``n`` groups arrived, a TimeoutError being one more turn."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return [g.group_id for g in client.get_batch(0, n, min(5.0, deadline - time.monotonic())).groups]
        except TimeoutError:
            continue
    raise TimeoutError(f"no batch of {n} in {timeout_s} s")


@pytest.mark.timeout(90)
def test_a_learner_waiting_on_a_sigkilled_buffer_asks_the_restarted_one_within_seconds(buffer_proc: Any,
                                                                                        tmp_path: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from common.config import CurveConfig
    from common.security import client_curve_keys, generate_run_keys

    keys = generate_run_keys(tmp_path / "keys")
    srv = buffer_proc([f"buffer.curve.keys_dir={keys}", "learner.batch_groups=2"])
    curve = CurveConfig(keys_dir=str(keys))
    learner = BatchClient(srv.serve_addr, curve=client_curve_keys(curve, "learner"))  # default 30 s request timeout
    try:
        with BatchClient(srv.serve_addr, curve=client_curve_keys(curve, "monitor"), request_timeout_s=2) as probe:
            with ThreadPoolExecutor(1) as pool:
                fut = pool.submit(_learner_fetch, learner, 2, 60.0)
                wait_for(lambda: probe.stats(retries=0)["batch_waiting"] == 1, 20, "the learner's request to wait")
                srv.kill()
                killed = time.monotonic()
                srv.start()
                with SyncSender(srv.ingest_addr, 0, curve=client_curve_keys(curve, "actor"), ack_timeout_s=1) as actor:
                    actor.send_many([make_group(f"after-{i}", seed=i) for i in range(2)], timeout_s=20)
                got = fut.result(timeout=60)
                elapsed = time.monotonic() - killed
        # Before, the lost request waited out its turn: 5 s + the 30 s request timeout.
        assert sorted(got) == ["after-0", "after-1"]
        print(f"batch {elapsed:.2f} s after the SIGKILL")
        assert elapsed < 8.0, f"the restarted buffer served the waiting learner only after {elapsed:.1f} s"
        assert learner.connections_lost >= 1
    finally:
        learner.close()


def test_a_take_that_cannot_commit_is_a_retryable_wait_not_a_protocol_error(buffer_proc: Any) -> None:
    """A full disk under the buffer (its file size limit at 8 KiB, the two meta pages: LMDB's writes fail with EFBIG) makes the
    take fail before anything leaves the buffer; the client says so as a wait, and the group is served once
    the disk has room again."""
    srv = buffer_proc(["learner.batch_groups=1"])
    c = BatchClient(srv.serve_addr, request_timeout_s=2.0)
    try:
        with SyncSender(srv.ingest_addr, 0) as s:
            s.send(make_group("full"), timeout_s=10)
        assert srv.proc is not None
        pid, (soft, hard) = srv.proc.pid, resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (8 << 10, hard))
        try:
            with pytest.raises(BufferStorageFailed, match="file_too_large"):
                c.get_batch(1, 1, 5)
        finally:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
        assert c.get_batch(1, 1, 5).groups[0].group_id == "full"
    finally:
        c.close()
