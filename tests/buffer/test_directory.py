"""The buffer directory: one server at a time (flock), the offline learner-version repair, inspect."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from buffer.directory import inspect, lock_server, repair_learner_version, unlock_server
from buffer.store import BufferStore, GroupRecord
from common.protocol import encode
from tests.buffer.fixtures import make_group


def test_a_second_lock_is_refused_naming_the_holder_and_released_on_unlock(tmp_path: Path) -> None:
    fd = lock_server(tmp_path)
    try:
        with pytest.raises(OSError) as e:
            lock_server(tmp_path)
        assert e.value.errno == errno.EBUSY and f"pid {os.getpid()}" in str(e.value)
    finally:
        unlock_server(fd)
    unlock_server(lock_server(tmp_path))  # free again


def test_repair_sets_both_versions_and_waits_for_the_server_lock(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        repair_learner_version(tmp_path / "nothing", 1)
    store = BufferStore(tmp_path)
    g = make_group(version=2)
    store.put_groups([GroupRecord(g.group_id, encode(g), 2, len(g.samples), [])])
    store.set_learner_version(40)
    store.close()
    fd = lock_server(tmp_path)
    with pytest.raises(OSError):
        repair_learner_version(tmp_path, 3)
    unlock_server(fd)
    assert repair_learner_version(tmp_path, 3) == 40
    info = inspect(tmp_path)
    assert info["learner_version"] == 3 and info["counters"]["served_version"] == 3
    assert info["groups"] == 1 and info["min_weight_version"] == 2 == info["max_weight_version"]
    assert info["samples"] == len(g.samples)


def test_inspect_refuses_a_directory_that_is_not_a_buffer(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        inspect(tmp_path)
