"""BatchServing on a real LMDB store: refusals, the wait list, whole batches only, stale groups dropped and
reported in the next reply, timeouts."""

from __future__ import annotations

import time
from pathlib import Path

from buffer.frames import FrameRejections
from buffer.serving import BatchServing
from buffer.store import BufferStore, GroupRecord
from common.metrics import Metrics
from common.protocol import BatchReply, BatchRequest, ErrorReply, Message, decode, encode
from tests.buffer.fixtures import buffer_config, make_group


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        cfg = buffer_config(tmp_path, ["buffer.max_staleness=1", "learner.batch_groups=2",
                                       "buffer.max_batch_groups=8", "buffer.max_batch_wait_s=5"])
        self.store = BufferStore(cfg.buffer_path)
        self.metrics = Metrics("buffer")
        self.replies: list[tuple[bytes, Message]] = []
        self.batches_served = 0
        self.serving = BatchServing(cfg, self.store, metrics=self.metrics, rejections=FrameRejections(self.metrics),
                                    reply=self._reply, settle=lambda: None, served=self._served)

    def _reply(self, ident: bytes, envelope: list[bytes], frame: bytes, copy: bool) -> None:
        assert envelope == [b""]
        self.replies.append((ident, decode(frame)))

    def _served(self) -> None:
        self.batches_served += 1

    def store_groups(self, *versions: int) -> list[str]:
        groups = [make_group(version=v) for v in versions]
        self.store.put_groups([GroupRecord(g.group_id, encode(g), g.samples[0].weight_version, len(g.samples), [])
                               for g in groups])
        self.serving.note_commit(0, 0)
        return [g.group_id for g in groups]

    def ask(self, ident: bytes, learner_version: int, n: int, timeout_ms: int = 1000) -> None:
        self.serving.on_request(ident, [b""], BatchRequest(learner_version=learner_version, n_groups=n,
                                                            timeout_ms=timeout_ms))


def test_bad_requests_are_refused_at_once_naming_the_limit(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.ask(b"a", 0, 9)
    h.ask(b"b", 0, 1, timeout_ms=6000)
    h.ask(b"c", 3, 1)  # more than learner_version_max_step=2 past served_version 0
    reasons = [(ident, r.reason) for ident, r in h.replies if isinstance(r, ErrorReply)]
    assert reasons == [(b"a", "bad_request"), (b"b", "bad_request"), (b"c", "learner_version")]
    assert "buffer.max_batch_groups=8" in h.replies[0][1].message  # type: ignore[union-attr]
    assert len(h.serving.waits) == 0 and h.store.counters["learner_version"] == 0


def test_a_request_waits_until_a_whole_batch_is_there(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.ask(b"learner", 1, 2)
    assert h.store.counters["learner_version"] == 1 and len(h.serving.waits) == 1
    h.store_groups(1)
    h.serving.serve_waiting()
    assert h.replies == []  # one of two groups: nothing is taken
    ids = h.store_groups(1)
    h.serving.serve_waiting()
    ((ident, reply),) = h.replies
    assert ident == b"learner" and isinstance(reply, BatchReply) and len(reply.groups) == 2
    assert ids[0] in {g.group_id for g in reply.groups}
    assert h.batches_served == 1 and len(h.serving.waits) == 0
    assert h.store.counters["served_version"] == 1  # a full learner batch moves it


def test_stale_groups_are_dropped_and_reported_with_the_next_batch(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.store_groups(0, 0, 2)
    h.serving.note_commit(filtered=1, stale=0)  # ingest filtered one meanwhile
    h.ask(b"learner", 2, 1)  # keeps weight versions >= 1: both version-0 groups are stale
    h.serving.serve_waiting()
    ((_, reply),) = h.replies
    assert isinstance(reply, BatchReply) and reply.stale_dropped == 2 and reply.filtered == 1
    assert [g.samples[0].weight_version for g in reply.groups] == [2]
    assert h.serving.dropped_since_reply == 0 == h.serving.filtered_since_reply


def test_an_expired_request_gets_a_timeout_and_takes_nothing(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.store_groups(0)
    h.ask(b"learner", 0, 2, timeout_ms=0)
    deadline = time.monotonic() + 5
    while not h.replies and time.monotonic() < deadline:
        h.serving.serve_waiting()
    ((_, reply),) = h.replies
    assert isinstance(reply, ErrorReply) and reply.reason == "timeout" and reply.message.startswith("1 of 2 groups")
    assert h.serving.timeouts == 1 and h.store.counters["depth_groups"] == 1


def test_fail_all_answers_every_waiting_request(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.ask(b"a", 0, 1)
    h.ask(b"b", 0, 1)
    h.serving.fail_all("boom")
    assert [(i, r.reason) for i, r in h.replies] == [(b"a", "internal"), (b"b", "internal")]  # type: ignore[union-attr]
    assert len(h.serving.waits) == 0
