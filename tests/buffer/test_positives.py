"""Positives: harvested from the frame as received (finished, rewarded samples only); requests are sampled
from LMDB and capped."""

from __future__ import annotations

from pathlib import Path

from buffer.positives import Positives, harvest_positives
from buffer.store import BufferStore, GroupRecord
from common.protocol import PositivesReply, PositivesRequest, decode, encode
from common.splice import encode_positives_reply
from tests.buffer.fixtures import make_group


def test_harvest_keeps_the_rewarded_finished_samples() -> None:
    g = make_group(rewards=[1.0, 0.0, 1.0, 1.0])
    g.samples[3].finish_reason = "length"  # rewarded but cut: imitating it would teach not to stop
    frame = encode(g)
    picked = harvest_positives(g, frame, positive_reward=1.0)
    assert len(picked) == 2
    for (h, sample_frame), expected in zip(picked, (g.samples[0], g.samples[2]), strict=True):
        assert len(h) == 16
        (back,) = decode(encode_positives_reply([sample_frame])).samples
        assert back.reward == expected.reward and back.output_ids.tobytes() == expected.output_ids.tobytes()
    assert harvest_positives(g, frame, positive_reward=2.0) == []


def test_a_request_gets_distinct_stored_positives_and_at_most_what_is_stored(tmp_path: Path) -> None:
    store = BufferStore(tmp_path, positives_capacity=100)
    g = make_group(rewards=[1.0, 1.0, 1.0, 0.0])
    frame = encode(g)
    store.put_groups([GroupRecord(g.group_id, frame, 0, 4, harvest_positives(g, frame, 1.0))])
    positives = Positives(store, seed=0)
    two = decode(positives.reply(PositivesRequest(n=2)))
    assert isinstance(two, PositivesReply) and len(two.samples) == 2
    every = decode(positives.reply(PositivesRequest(n=50)))
    assert isinstance(every, PositivesReply)
    outputs = sorted(s.output_ids.tobytes() for s in every.samples)
    assert outputs == sorted(s.output_ids.tobytes() for s in g.samples[:3])
    store.close()
