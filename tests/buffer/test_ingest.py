"""Ingest over a real ZeroMQ ROUTER with a real LMDB store and writer thread: a group is acked only after its
commit, bad frames and unusable groups are refused, credit requests go back to the caller."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from buffer.frames import FrameRejections
from buffer.ingest import CreditMessage, Ingest
from buffer.store import BufferStore
from buffer.writer import Writer
from common.limits import limits_from_config
from common.metrics import Metrics
from common.protocol import (
    BatchRequest,
    CreditRequest,
    ErrorReply,
    IngestAck,
    Message,
    SampleGroup,
    decode,
    encode,
)
from common.security import ServerCurve
from tests.buffer.fixtures import buffer_config, make_group
from tests.polling import wait_for


class Harness:
    def __init__(self, tmp_path: Path, overrides: list[str]) -> None:
        cfg = buffer_config(tmp_path, overrides)
        self.ctx = zmq.Context()
        router = self.ctx.socket(zmq.ROUTER)
        router.linger = 0
        port = router.bind_to_random_port("tcp://127.0.0.1")
        self.actor = self.ctx.socket(zmq.DEALER)
        self.actor.linger = 0
        self.actor.connect(f"tcp://127.0.0.1:{port}")
        self.store = BufferStore(cfg.buffer_path)
        self.writer = Writer(self.store, self.ctx)
        self.metrics = Metrics("buffer")
        self.consumed: list[int] = []
        self.commits: list[tuple[int, int]] = []
        self.ingest = Ingest(cfg, router, self.store, self.writer, metrics=self.metrics,
                             rejections=FrameRejections(self.metrics), curve=ServerCurve(None, None),
                             limits=limits_from_config(cfg), consume_credit=self.consumed.append,
                             on_committed=lambda filtered, stale: self.commits.append((filtered, stale)))

    def send(self, *frames: bytes) -> None:
        self.actor.send_multipart(list(frames))

    def drain(self, n_answers: int = 0, n_queued: int = 0) -> list[CreditMessage]:
        """Read until ``n_queued`` groups wait for a commit and the actor holds ``n_answers`` replies."""
        credits: list[CreditMessage] = []

        def done() -> bool:
            credits.extend(self.ingest.drain())
            return len(self.ingest.next_batch) >= n_queued and (n_answers == 0 or self.actor.poll(0))

        wait_for(done, timeout_s=10, what="the ingest frames")
        return credits

    def answers(self, n: int) -> list[Message]:
        out = []
        for _ in range(n):
            assert self.actor.poll(10_000), "no answer"
            out.append(decode(self.actor.recv()))
        return out

    def close(self) -> None:
        self.writer.stop()
        for s in (self.actor, self.ingest.sock, self.writer.notify):
            s.close(linger=0)
        self.ingest.peers.close()
        self.ctx.term()
        self.store.close()


@pytest.fixture
def harness(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Harness]:
    overrides: Any = getattr(request, "param", [])
    h = Harness(tmp_path, overrides)
    yield h
    h.close()


def test_a_group_is_acked_only_after_its_commit(harness: Harness) -> None:
    g = make_group(actor_id=3)
    harness.send(encode(g))
    harness.drain(n_queued=1)
    assert harness.store.known(g.group_id) is None  # validated, not written yet
    harness.ingest.submit()
    harness.ingest.settle()
    assert harness.store.known(g.group_id) is not None
    (ack,) = harness.answers(1)
    assert ack == IngestAck(group_id=g.group_id, committed=True, duplicate=False, error="")
    assert harness.consumed == [3] and harness.commits == [(0, 0)] and harness.ingest.commits == 1


def test_a_resent_group_is_acked_as_a_duplicate_and_keeps_its_credit(harness: Harness) -> None:
    g = make_group(actor_id=1)
    for _ in range(2):
        harness.send(encode(g))
        harness.drain(n_queued=1)
        harness.ingest.submit()
        harness.ingest.settle()
    first, second = harness.answers(2)
    assert isinstance(second, IngestAck) and second.duplicate and second.committed
    assert harness.consumed == [1] and harness.store.counters["depth_groups"] == 1


def test_credit_requests_are_returned_and_bad_frames_answered(harness: Harness) -> None:
    harness.send(encode(CreditRequest(actor_id=2, n=4)))
    harness.send(b"\x00not msgpack")
    harness.send(b"one", b"two")
    harness.send(encode(BatchRequest(learner_version=0, n_groups=1, timeout_ms=10)))
    credits: list[CreditMessage] = []
    wait_for(lambda: credits.extend(harness.ingest.drain()) or harness.ingest.rejections.total == 3,
             timeout_s=10, what="four frames read")
    replies = harness.answers(3)
    assert [(ident != b"", req, key) for ident, req, key in credits] == [(True, CreditRequest(actor_id=2, n=4), None)]
    assert all(isinstance(r, ErrorReply) for r in replies)
    assert [r.reason for r in replies][1:] == ["multipart", "unexpected_type"]  # type: ignore[union-attr]
    assert harness.ingest.rejections.total == 3


def test_an_unusable_group_is_refused_for_good_and_frees_its_credit(harness: Harness) -> None:
    g = make_group(actor_id=5)
    g.samples[0].prompt_ids = np.zeros(0, np.int32)
    harness.send(encode(g))
    harness.drain(n_answers=1)
    (ack,) = harness.answers(1)
    assert isinstance(ack, IngestAck) and not ack.committed and ack.error.startswith("invalid:")
    assert harness.consumed == [5] and sum(harness.ingest.invalid.values()) == 1
    assert harness.ingest.next_batch == []


@pytest.mark.parametrize("harness", [["buffer.commit_batch=2"]], indirect=True)
def test_two_batches_are_validated_while_one_commits_and_each_commit_takes_one_batch(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """commit_batch 2, the commit of g0 and g1 held: the main thread reads and validates g2..g5 (two batches)
    and leaves g6 in the socket; once the commit ends, the writer gets g2 and g3 only, and g6 is read."""
    gate = threading.Event()
    committed: list[list[str]] = []
    put_groups = harness.store.put_groups

    def held(records: list[Any]) -> Any:
        gate.wait(60)
        committed.append([r.group_id for r in records])
        return put_groups(records)

    monkeypatch.setattr(harness.store, "put_groups", held)
    groups = [make_group(f"g{i}") for i in range(7)]
    harness.send(encode(groups[0]))
    harness.send(encode(groups[1]))
    harness.drain(n_queued=2)
    harness.ingest.submit()
    for g in groups[2:]:
        harness.send(encode(g))
    harness.drain(n_queued=4)
    harness.ingest.drain()
    assert [p[1][1] for p in harness.ingest.next_batch] == ["g2", "g3", "g4", "g5"]
    assert not harness.ingest.accepting
    gate.set()
    harness.ingest.settle()
    harness.ingest.submit()
    harness.drain(n_queued=3)
    assert [p[1][1] for p in harness.ingest.next_batch] == ["g4", "g5", "g6"]
    harness.ingest.settle()
    assert committed == [["g0", "g1"], ["g2", "g3"]]
    acks = [a for a in harness.answers(4) if isinstance(a, IngestAck) and a.committed]
    assert {a.group_id for a in acks} == {"g0", "g1", "g2", "g3"}


@pytest.mark.parametrize("harness", [["buffer.capacity_groups=1"]], indirect=True)
def test_a_group_past_capacity_is_not_stored_and_may_be_resent(harness: Harness) -> None:
    kept, refused = make_group(), make_group()
    harness.send(encode(kept))
    harness.drain(n_queued=1)
    harness.ingest.submit()
    harness.send(encode(refused))
    harness.drain(n_answers=1)
    acks = {a.group_id: a for a in harness.answers(2) if isinstance(a, IngestAck)}
    assert acks[kept.group_id].committed
    assert not acks[refused.group_id].committed and acks[refused.group_id].error.startswith("full: 1 groups")


@pytest.mark.parametrize("harness", [["buffer.capacity_groups=3"]], indirect=True)
def test_capacity_counts_the_batch_being_committed_and_the_one_queued(harness: Harness,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Capacity 3: a and b are being committed when c and d arrive; c fits (2 + 1), d would make 4 and is
    refused, after the buffer waited for a and b's commit (it may have freed room); then c is stored. The
    commit is held until the buffer waits for it, so a and b are in neither the store's counters nor the
    queue while c and d are judged."""
    gate = threading.Event()
    put_groups, settle = harness.store.put_groups, harness.ingest.settle
    monkeypatch.setattr(harness.store, "put_groups", lambda records: gate.wait(60) and put_groups(records))
    monkeypatch.setattr(harness.ingest, "settle", lambda: (gate.set(), settle())[1])
    a, b, c, d = (make_group(f"g{i}") for i in range(4))
    harness.send(encode(a))
    harness.send(encode(b))
    harness.drain(n_queued=2)
    harness.ingest.submit()
    harness.send(encode(c))
    harness.send(encode(d))
    harness.drain(n_answers=3, n_queued=1)
    acks = {x.group_id: x for x in harness.answers(3) if isinstance(x, IngestAck)}
    assert acks[a.group_id].committed and acks[b.group_id].committed
    assert not acks[d.group_id].committed and acks[d.group_id].error.startswith("full: 2 groups")
    harness.ingest.submit()
    harness.ingest.settle()
    (ack,) = harness.answers(1)
    assert isinstance(ack, IngestAck) and ack.group_id == c.group_id and ack.committed
    assert harness.store.counters["depth_groups"] == 3


def test_a_stale_group_is_recorded_never_stored_and_reported(harness: Harness) -> None:
    harness.store.set_learner_version(5)  # with max_staleness 1, versions below 4 are stale
    g: SampleGroup = make_group(version=0)
    harness.send(encode(g))
    harness.drain(n_queued=1)
    harness.ingest.submit()
    harness.ingest.settle()
    (ack,) = harness.answers(1)
    assert isinstance(ack, IngestAck) and ack.committed and ack.error == "stale"
    assert harness.commits == [(0, 1)] and harness.store.counters["depth_groups"] == 0


def test_a_group_claiming_weights_newer_than_the_learner_can_have_published_is_refused(harness: Harness) -> None:
    from buffer.ingest import version_limit

    harness.store.set_learner_version(5)
    # served_version 0 + learner_version_max_step 2 < 5: the limit is 5 + 1 (the version published after step 5).
    assert version_limit(harness.store.counters, 2) == 6
    newest_ok = make_group("v6", version=6)
    forged = make_group("forged", version=(1 << 63) - 1)
    spans = make_group("spans", version=5)  # the oldest token is v5, a later run of tokens claims 2^62
    s = spans.samples[0]
    s.version_spans = np.array([5, s.response_length - 1, 1 << 62, 1], np.int64)
    for g in (newest_ok, forged, spans):
        harness.send(encode(g))
    wait_for(lambda: harness.ingest.drain() is not None and sum(harness.ingest.invalid.values()) == 2
             and len(harness.ingest.next_batch) == 1, timeout_s=10, what="three groups read")
    harness.ingest.submit()
    harness.ingest.settle()
    acks = {a.group_id: a for a in harness.answers(3) if isinstance(a, IngestAck)}
    assert acks["v6"].committed and acks["v6"].error == ""
    for gid in ("forged", "spans"):
        assert not acks[gid].committed and acks[gid].error.startswith("invalid:version:"), acks[gid]
    assert harness.ingest.invalid == {"version": 2}
    assert harness.metrics.registry.get_sample_value("vapo_buffer_invalid_groups_total", {"reason": "version"}) == 2.0
    assert harness.store.counters["depth_groups"] == 1


@pytest.mark.parametrize("harness", [["buffer.filter_uniform_groups=true"]], indirect=True)
def test_the_uniform_filter_judges_the_reward_the_learner_trains_on(harness: Harness) -> None:
    """Rewards 1, 0, 0, 0 where the 1 was cut at the length limit: under ``algo.truncated=zero_reward`` (the
    default) the learner trains on 0, 0, 0, 0, no signal, so the group is filtered; the same rewards with the
    1 finished are kept."""
    cut, kept = make_group(rewards=[1.0, 0.0, 0.0, 0.0]), make_group(rewards=[1.0, 0.0, 0.0, 0.0])
    cut.samples[0].finish_reason = "length"
    for g in (cut, kept):
        harness.send(encode(g))
    harness.drain(n_queued=2)
    harness.ingest.submit()
    harness.ingest.settle()
    acks = {a.group_id: a for a in harness.answers(2) if isinstance(a, IngestAck)}
    assert acks[cut.group_id].error == "filtered:uniform_reward"
    assert acks[kept.group_id].committed and acks[kept.group_id].error == ""
