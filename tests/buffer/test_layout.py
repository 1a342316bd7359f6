"""The LMDB layout: group keys sort by (weight version, arrival), counters round-trip, the positives' dedup key."""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np

from buffer.layout import (
    COUNTERS,
    GROUP_KEY,
    key_version,
    positive_hash,
    read_counters,
    version_bound,
    write_counters,
)


def open_env(path: Path) -> tuple[lmdb.Environment, object, object]:
    env = lmdb.open(str(path), map_size=1 << 24, max_dbs=8)
    return env, env.open_db(b"groups"), env.open_db(b"meta")


def test_group_keys_sort_by_weight_version_then_arrival(tmp_path: Path) -> None:
    env, groups, _ = open_env(tmp_path)
    with env.begin(write=True) as txn:
        for version, seq in ((3, 0), (1, 2), (1, 1), (2, 5)):
            txn.put(GROUP_KEY.pack(version, seq, 4), b"g", db=groups)
    with env.begin() as txn:
        order = [GROUP_KEY.unpack(k)[:2] for k, _ in txn.cursor(db=groups)]
    assert order == [(1, 1), (1, 2), (2, 5), (3, 0)]
    assert version_bound(env, groups, last=False) == 1
    assert version_bound(env, groups, last=True) == 3
    assert key_version(GROUP_KEY.pack(2**40, 7, 1)) == 2**40
    env.close()


def test_an_empty_groups_database_has_no_version(tmp_path: Path) -> None:
    env, groups, _ = open_env(tmp_path)
    assert version_bound(env, groups, last=False) == -1
    env.close()


def test_counters_round_trip_and_an_old_directory_trusts_its_learner_version_as_served(tmp_path: Path) -> None:
    env, _, meta = open_env(tmp_path)
    with env.begin() as txn:
        fresh = read_counters(txn, meta)
    assert set(fresh) == set(COUNTERS) and all(v == 0 for v in fresh.values())
    with env.begin(write=True) as txn:
        # A directory from before served_version: only learner_version was ever written.
        txn.put(b"learner_version", (9).to_bytes(8, "big", signed=True), db=meta)
    with env.begin() as txn:
        old = read_counters(txn, meta)
    assert old["learner_version"] == 9 and old["served_version"] == 9
    changed = dict(old, depth_groups=-3, served_version=4)
    with env.begin(write=True) as txn:
        write_counters(txn, meta, changed, old)
    with env.begin() as txn:
        assert read_counters(txn, meta) == changed
    env.close()


def test_positive_hash_depends_on_where_the_prompt_ends() -> None:
    a = positive_hash(np.array([1, 2], np.int32), np.array([3], np.int32))
    assert a == positive_hash(np.array([1, 2], np.int64), np.array([3], np.int64))  # ids, not their dtype
    assert a != positive_hash(np.array([1], np.int32), np.array([2, 3], np.int32))
    assert len(a) == 16
