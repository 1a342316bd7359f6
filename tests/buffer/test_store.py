"""BufferStore on a real LMDB directory: ordering, idempotence, positives, growth, storage errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from buffer.directory import inspect, ledger
from buffer.layout import FILTERED, STALE, positive_hash
from buffer.store import BufferStore, GroupRecord, StorageError
from common.protocol import SampleGroup, decode, encode
from tests.buffer.fixtures import make_group


def record(g: SampleGroup, fate: bytes = b"S", pos_reward: float = 1.0) -> GroupRecord:
    pos = [(positive_hash(s.prompt_ids, s.output_ids), encode(s)) for s in g.samples if s.reward >= pos_reward]
    return GroupRecord(g.group_id, encode(g), g.weight_version, len(g.samples), pos, fate)


def ids(frames: list[bytes]) -> list[str]:
    out = []
    for f in frames:
        g = decode(f)
        assert isinstance(g, SampleGroup)
        out.append(g.group_id)
    return out


def test_groups_come_out_oldest_version_first_then_arrival(tmp_path: Path) -> None:
    st = BufferStore(tmp_path)
    versions = [3, 1, 2, 1, 0, 3, 2]
    groups = [make_group(f"g{i}", version=v) for i, v in enumerate(versions)]
    st.put_groups([record(g) for g in groups[:4]])
    st.put_groups([record(g) for g in groups[4:]])
    expected = [g.group_id for g in sorted(groups, key=lambda g: (g.weight_version, int(g.group_id[1:])))]
    assert ids(st.iter_group_frames()) == expected
    frames, dropped = st.take_groups(3, min_version=1)
    assert dropped == 1  # the version-0 group
    assert ids(frames) == expected[1:4]
    assert st.counters["depth_groups"] == 3 and st.counters["served_groups"] == 3
    assert st.counters["depth_samples"] == 3 * 4
    st.close()


def test_take_is_all_or_nothing_unless_partial(tmp_path: Path) -> None:
    st = BufferStore(tmp_path)
    st.put_groups([record(make_group(version=5)) for _ in range(2)])
    assert st.take_groups(3) == ([], 0)
    assert st.counters["depth_groups"] == 2
    frames, _ = st.take_groups(3, partial=True)
    assert len(frames) == 2 and st.counters["depth_groups"] == 0 and st.counters["depth_bytes"] == 0


def test_resent_group_id_is_stored_once_and_counters_survive_reopen(tmp_path: Path) -> None:
    st = BufferStore(tmp_path)
    g = make_group("same")
    assert st.put_groups([record(g), record(g)]) == [("stored", False), ("stored", True)]
    assert st.put_groups([record(g)]) == [("stored", True)]
    st.take_groups(1)
    # Still recognised after it was served: a late re-send must not come back.
    assert st.put_groups([record(g)]) == [("stored", True)]
    assert st.put_groups([record(make_group("f"), FILTERED), record(make_group("x"), STALE)]) == [
        ("filtered", False), ("stale", False)]
    before = dict(st.counters)
    st.close()
    st2 = BufferStore(tmp_path)
    assert st2.counters == before
    assert before["duplicates"] == 3 and before["depth_groups"] == 0 and before["filtered"] == 1
    assert before["stale_dropped"] == 1 and before["accepted_groups"] == 1


def test_positives_dedup_eviction_and_reopen(tmp_path: Path) -> None:
    st = BufferStore(tmp_path, positives_capacity=5)
    g1 = make_group(rewards=[1.0, 1.0, 0.0, 0.0], seed=1)
    st.put_groups([record(g1)])
    assert st.positives_count == 2
    # Same prompt+output tokens in a new group: not stored twice.
    g1b = SampleGroup(group_id="other", prompt_id="p", task="t", actor_id=0, samples=g1.samples[:2], created_at=0.0)
    st.put_groups([record(g1b)])
    assert st.positives_count == 2 and st.counters["positives_duplicates"] == 2
    later = [make_group(rewards=[1.0] * 4, seed=10 + i) for i in range(2)]
    st.put_groups([record(g) for g in later])
    assert st.positives_count == 5 and st.counters["positives_evicted"] == 5
    kept = {positive_hash(s.prompt_ids, s.output_ids) for s in later[1].samples}
    kept.add(positive_hash(later[0].samples[3].prompt_ids, later[0].samples[3].output_ids))
    st.close()
    st2 = BufferStore(tmp_path, positives_capacity=5)
    got = [decode(f) for f in st2.iter_positives()]
    assert {positive_hash(s.prompt_ids, s.output_ids) for s in got} == kept
    sample = [decode(f) for f in st2.sample_positives(3, random.Random(0))]
    assert len({positive_hash(s.prompt_ids, s.output_ids) for s in sample}) == 3
    # An evicted positive can come back (its index entry went with it).
    st2.put_groups([record(SampleGroup(group_id="again", prompt_id="p", task="t", actor_id=0,
                                       samples=g1.samples[:1], created_at=0.0))])
    assert st2.counters["positives_duplicates"] == 2


def test_map_grows_automatically(tmp_path: Path) -> None:
    st = BufferStore(tmp_path, map_size=1 << 20)
    groups = [make_group(g=8, length=2000) for _ in range(40)]  # ~40 x 64 KB > 1 MiB
    for i in range(0, 40, 10):
        st.put_groups([record(g) for g in groups[i:i + 10]])
    assert st.map_size > 1 << 20
    assert st.counters["depth_groups"] == 40
    assert len(st.iter_group_frames()) == 40


def test_map_ceiling_is_a_storage_error_and_keeps_committed_state(tmp_path: Path) -> None:
    st = BufferStore(tmp_path, map_size=1 << 20, max_map_size=2 << 20)
    ok = 0
    with pytest.raises(StorageError) as ei:
        for _ in range(100):
            st.put_groups([record(make_group(g=8, length=2000))])
            ok += 1
    assert ei.value.reason == "map_full"
    assert 0 < ok < 100
    assert st.counters["depth_groups"] == ok
    st.close()
    st2 = BufferStore(tmp_path, map_size=1 << 20, max_map_size=2 << 20)
    assert st2.counters["depth_groups"] == ok == len(st2.iter_group_frames())
    st2.close()
    # A higher ceiling lets writes continue on the same files.
    st3 = BufferStore(tmp_path, map_size=1 << 20, max_map_size=8 << 20)
    st3.put_groups([record(make_group(g=8, length=2000))])
    assert st3.counters["depth_groups"] == ok + 1


def test_inspect_summary(tmp_path: Path) -> None:
    st = BufferStore(tmp_path)
    st.put_groups([record(make_group(version=v, rewards=[1, 0, 0, 0])) for v in (4, 2, 7)])
    st.close()  # py-lmdb allows one handle per environment per process; the CLI test covers a live server
    info = inspect(tmp_path)
    assert info["groups"] == 3 and info["samples"] == 12 and info["positives"] == 3
    assert info["min_weight_version"] == 2 and info["max_weight_version"] == 7
    assert info["bytes_on_disk"] > 0
    with pytest.raises(FileNotFoundError):
        inspect(tmp_path / "nope")


def test_record_served_keeps_every_take_in_its_transaction(tmp_path: Path) -> None:
    st = BufferStore(tmp_path, record_served=True)
    st.put_groups([record(make_group(f"g{i}", version=v)) for i, v in enumerate([0, 1, 2, 2])])
    frames, dropped = st.take_groups(2, min_version=1)
    assert dropped == 1 and ids(frames) == ["g1", "g2"]
    assert st.take_groups(5) == ([], 0)  # nothing taken: no record
    st.close()
    led = ledger(tmp_path)
    assert len(led["acked"]) == 4 and len(led["waiting"]) == 1
    (take,) = led["takes"]
    assert take["min_version"] == 1 and take["dropped"] == [(0, 0)]
    assert take["served"] == [(1, 1), (2, 2)]  # (weight_version, seq), in the order served


def test_no_served_record_unless_asked(tmp_path: Path) -> None:
    st = BufferStore(tmp_path)
    st.put_groups([record(make_group(f"g{i}")) for i in range(2)])
    assert len(st.take_groups(2)[0]) == 2
    st.close()
    assert ledger(tmp_path)["takes"] == []
