"""The learner against a real buffer server subprocess: fetch over ZeroMQ, staleness floor, one step."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.data import BufferSource
from learner.synthetic import synth_groups
from learner.train import Learner
from tests.buffer.fixtures import BufferProc, SyncSender
from tests.learner.train_fixtures import make_cfg


def test_learner_step_on_batch_from_real_buffer(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = BufferProc(tmp_path, ["buffer.max_staleness=1"]).start()
    try:
        groups = synth_groups(6, 4, 60, seed=8)
        with SyncSender(srv.ingest_addr, 0) as s:
            for g in groups:
                s.send(g, timeout_s=10)
        src = BufferSource(srv.serve_addr, max_staleness=1)
        learner = Learner(make_cfg(tiny_model_dir), src)
        stats = learner.step()  # fetches learner.batch_groups = 4 groups through the REQ socket
        assert stats["weight_version"] == 1 and stats["samples"] == 16
        assert src.groups_consumed == 4 and src.state_dict()["groups_consumed"] == 4
        assert src.client.stats()["depth_groups"] == 2
        # Remaining groups are version 0: still within max_staleness=1 of learner version 1.
        got = src.get_batch(1, 2, 10).groups
        assert {g.group_id for g in got} <= {g.group_id for g in groups[4:]} and len(got) == 2
    finally:
        srv.cleanup()


def test_one_rank_fetch_decodes_nothing_and_encodes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one rank ``fetch`` takes the source's decoded groups as they are: no frame is built or read."""
    from common import protocol
    from learner.data import ListSource, fetch

    def no_frames(*a: object, **kw: object) -> bytes:
        raise AssertionError("one rank must not encode frames")

    monkeypatch.setattr(protocol, "encode_batch_reply", no_frames)
    monkeypatch.setattr(protocol, "encode", no_frames)
    groups = synth_groups(3, 2, 40, seed=1, p_correct=1.0)
    positives = [s for g in synth_groups(1, 4, 40, seed=2) for s in g.samples]
    got, extra = fetch(ListSource(groups, positives), 0, 2, 1.0, replay_fraction=0.25)  # 4 positives -> 1
    assert all(a is b for a, b in zip(got, groups[:2], strict=True)) and extra == positives[:1]
    # Positives are counted at the buffer's threshold: above every reward there are none to replay.
    _, none = fetch(ListSource(groups, positives), 0, 2, 1.0, replay_fraction=0.25, positive_reward=2.0)
    assert none == []


def test_fetch_drops_unusable_groups_counts_them_and_asks_again() -> None:
    """A group with a token past the vocabulary is dropped whole (2 samples counted under ``token_id``) and the
    next group in the list is asked for in its place: the first two usable groups, in order, in two asks."""
    from common.limits import SampleLimits
    from learner.data import ListSource, fetch

    groups = synth_groups(4, 2, 40, seed=5)
    bad = groups[1].samples[0]
    bad.output_ids = bad.output_ids.copy()
    bad.output_ids[0] = 40  # == vocab_size: one past the table
    counted: list[tuple[str, int]] = []
    src = ListSource(groups)
    got, _ = fetch(src, 0, 2, 1.0, limits=SampleLimits(vocab_size=40), count=lambda r, n: counted.append((r, n)))
    assert [g.group_id for g in got] == [groups[0].group_id, groups[2].group_id]
    assert counted == [("token_id", 2)] and src.cursor == 3  # asked for 2, then for the 1 it lacked


def test_list_source_encodes_its_batch_and_positives_only_when_asked() -> None:
    """A list's batch and positives carry no frames; their wire forms decode back to the same rows (and no
    positives asked for is the empty frame)."""
    from learner.data import BatchFrames, ListSource, Positives

    groups = synth_groups(3, 2, 40, seed=6)
    positives = [s for g in synth_groups(1, 3, 40, seed=7) for s in g.samples]
    src = ListSource(groups, positives)
    batch = src.get_batch(0, 2)
    assert batch.frames is None and [g.group_id for g in batch.groups] == [g.group_id for g in groups[:2]]
    again = BatchFrames.decode(batch.wire_frames(), batch.min_version)
    assert [g.group_id for g in again.groups] == [g.group_id for g in groups[:2]]
    pos = src.positives(4)  # wraps around the 3 stored positives
    assert [s.reward for s in Positives.decode(pos.wire_frame())] == [s.reward for s in [*positives, positives[0]]]
    assert src.positives(0) == Positives([]) and Positives([]).wire_frame() == b"" and Positives.decode(b"") == []
    assert src.state_dict() == {"cursor": 2, "pos_cursor": 4}


class FrameClient:
    """Stands in for buffer.client.BatchClient's frame API: replies are real protocol frames, handed out in
    order (``get_batch_frame``) or built from ``positives`` (``positives_frame``)."""

    def __init__(self, replies: list[bytes], positives: list) -> None:
        self.replies, self.positives = list(replies), positives

    def get_batch_frame(self, learner_version: int, n_groups: int, timeout_s: float):
        from common import protocol

        frame = self.replies.pop(0)
        return protocol.decode_as(frame, protocol.BatchReply), frame

    def positives_frame(self, n: int):
        from common import protocol

        frame = protocol.encode(protocol.PositivesReply(samples=self.positives[:n]))
        return protocol.decode_as(frame, protocol.PositivesReply).samples, frame


def test_buffer_source_hands_out_the_frames_it_received_and_drops_stale_groups_alike() -> None:
    """The frames are the buffer's replies byte for byte; rank 0's groups and what another rank decodes
    from those frames (``BatchFrames.decode`` with the same floor) are the same non-stale groups; the
    counters count what the buffer and the floor dropped."""
    from common import protocol
    from learner.data import BatchFrames, Positives

    old = synth_groups(1, 2, 40, seed=3, version=2)  # learner version 5, max_staleness 2: floor 3
    fresh = synth_groups(3, 2, 40, seed=4, version=4)
    replies = [protocol.encode_batch_reply([protocol.encode(g) for g in [old[0], fresh[0]]], 1, 2),
               protocol.encode_batch_reply([protocol.encode(g) for g in fresh[1:]], 0, 1)]
    positives = [s for g in fresh for s in g.samples]
    src = BufferSource("ipc://unused", max_staleness=2, client=FrameClient(replies, positives))
    batch = src.get_batch(5, 3, 10.0)
    assert batch.frames == replies and batch.min_version == 3
    assert [g.group_id for g in batch.groups] == [g.group_id for g in fresh]
    again = BatchFrames.decode(batch.frames, batch.min_version)
    assert [g.group_id for g in again.groups] == [g.group_id for g in fresh]
    assert (src.stale_dropped, src.filtered, src.groups_consumed) == (1 + 1, 2 + 1, 3)
    pos = src.positives(2)
    assert [s.response_length for s in pos.samples] == [s.response_length for s in positives[:2]] and pos.frame
    assert pos.wire_frame() is pos.frame and src.positives(0) == Positives([], b"")


def test_a_batch_the_buffer_could_not_commit_is_asked_for_again() -> None:
    """A full disk under the buffer answers the take with ``storage``: the learner waits and asks again
    (the chaos run's disk fault stopped the run here before), until its own deadline."""
    from buffer.client import BufferStorageFailed
    from common import protocol

    groups = synth_groups(2, 2, 40, seed=5, version=1)
    reply = protocol.encode_batch_reply([protocol.encode(g) for g in groups], 0, 0)

    class FullOnce(FrameClient):
        calls = 0

        def get_batch_frame(self, learner_version: int, n_groups: int, timeout_s: float):
            FullOnce.calls += 1
            if FullOnce.calls == 1:
                raise BufferStorageFailed("buffer: file_too_large: LMDB write failed")
            return super().get_batch_frame(learner_version, n_groups, timeout_s)

    src = BufferSource("ipc://unused", max_staleness=1, client=FullOnce([reply], []))
    assert [g.group_id for g in src.get_batch(1, 2, 10.0).groups] == [g.group_id for g in groups]
    assert FullOnce.calls == 2

    class AlwaysFull(FrameClient):
        def get_batch_frame(self, learner_version: int, n_groups: int, timeout_s: float):
            raise BufferStorageFailed("buffer: file_too_large")

    with pytest.raises(TimeoutError, match="got 0/2 groups"):
        BufferSource("ipc://unused", max_staleness=1, client=AlwaysFull([], [])).get_batch(1, 2, 1.5)
