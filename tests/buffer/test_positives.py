"""Positives: harvested from the frame as received (finished, rewarded samples only); requests are sampled
from LMDB and capped; through the server process: deduplicated, the oldest evicted, kept over a restart, and a
truncated response never stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from buffer.client import BatchClient
from buffer.layout import positive_hash
from buffer.positives import Positives, harvest_positives
from buffer.store import BufferStore, GroupRecord
from common.protocol import PositivesReply, PositivesRequest, SampleGroup, decode, encode
from common.splice import encode_positives_reply
from tests.buffer.fixtures import SyncSender, make_group, make_sample


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


# ------------------------------------------------------------------------------ through the server process


def test_positives_dedup_eviction_and_restart(buffer_proc: Any) -> None:
    srv = buffer_proc(["buffer.positives_capacity=6"])
    base = [make_sample(reward=1.0, seed=i) for i in range(4)]
    g1 = SampleGroup(group_id="g1", prompt_id="p", task="t", actor_id=0,
                     samples=base + [make_sample(reward=0.0, seed=99)], created_at=0.0)
    g2 = SampleGroup(group_id="g2", prompt_id="p", task="t", actor_id=0, samples=base[:2], created_at=0.0)
    with SyncSender(srv.ingest_addr, 0) as s, BatchClient(srv.serve_addr) as c:
        s.send_many([g1, g2], timeout_s=10)
        st = c.stats()
        assert st["positives"] == 4 and st["positives_duplicates"] == 2
        more = [make_sample(reward=1.0, seed=100 + i) for i in range(4)]
        s.send(SampleGroup(group_id="g3", prompt_id="q", task="t", actor_id=0, samples=more, created_at=0.0),
               timeout_s=10)
        st = c.stats()
        assert st["positives"] == 6 and st["positives_evicted"] == 2
        before = {positive_hash(x.prompt_ids, x.output_ids) for x in c.positives(100)}
        assert len(before) == 6
        assert {positive_hash(x.prompt_ids, x.output_ids) for x in base[:2]}.isdisjoint(before)  # oldest went
        assert all(x.reward == 1.0 for x in c.positives(3)) and len(c.positives(3)) == 3
    srv.kill()
    srv.start()
    with BatchClient(srv.serve_addr) as c:
        after = {positive_hash(x.prompt_ids, x.output_ids) for x in c.positives(100)}
        assert after == before


def test_truncated_responses_are_never_stored_as_positives(buffer_proc: Any) -> None:
    """A reward-1 response cut at the length limit (finish_reason "length") is not harvested: imitating it
    would teach the policy not to stop."""
    srv = buffer_proc()
    done, cut = make_sample(reward=1.0, seed=1), make_sample(reward=1.0, seed=2)
    cut.finish_reason = "length"
    g = SampleGroup(group_id="t1", prompt_id="p", task="t", actor_id=0, samples=[done, cut], created_at=0.0)
    with SyncSender(srv.ingest_addr, 0) as s, BatchClient(srv.serve_addr) as c:
        assert s.send(g, timeout_s=10).committed
        assert c.stats()["positives"] == 1
        assert [positive_hash(x.prompt_ids, x.output_ids) for x in c.positives(10)] == [
            positive_hash(done.prompt_ids, done.output_ids)]
