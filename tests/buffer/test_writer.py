"""The writer thread on a real LMDB store: a batch is committed off the main thread, collected once, and a
storage error comes back as the batch's result instead of killing the thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from buffer.store import BufferStore, GroupRecord
from buffer.writer import Pending, Writer
from common.protocol import encode
from tests.buffer.fixtures import make_group


def pending(frame_bytes: bytes | None = None) -> Pending:
    g = make_group()
    frame = frame_bytes if frame_bytes is not None else encode(g)
    return GroupRecord(g.group_id, frame, 0, len(g.samples), []), (b"peer", g.group_id, 7)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def test_a_batch_is_committed_then_collected_once(tmp_path: Path, ctx: zmq.Context) -> None:
    store = BufferStore(tmp_path)
    writer = Writer(store, ctx)
    batch = [pending(), pending()]
    writer.submit(batch, dict(store.counters))
    assert writer.busy and writer.batch == batch
    writer.wait()
    (done,) = writer.collect()
    assert done.err is None and done.results == [("stored", False), ("stored", False)]
    assert done.batch == batch and done.before["depth_groups"] == 0
    assert not writer.busy and writer.batch == []
    assert store.counters["depth_groups"] == 2 and len(store.iter_group_frames()) == 2
    assert writer.collect() == []
    writer.submit(batch[:1], dict(store.counters))  # a re-sent group: recorded as a duplicate
    writer.wait()
    assert writer.collect()[0].results == [("stored", True)]
    writer.stop()
    writer.notify.close(linger=0)
    store.close()


def test_a_storage_error_is_reported_with_its_batch(tmp_path: Path, ctx: zmq.Context) -> None:
    store = BufferStore(tmp_path, map_size=1 << 20, max_map_size=1 << 20)
    writer = Writer(store, ctx)
    writer.submit([pending(b"x" * (2 << 20))], dict(store.counters))  # larger than the map may grow
    writer.wait()
    (done,) = writer.collect()
    assert done.results is None and done.err is not None and done.err.reason == "map_full"
    assert store.counters["depth_groups"] == 0
    writer.submit([pending()], dict(store.counters))  # the thread survived
    writer.wait()
    assert writer.collect()[0].results == [("stored", False)]
    writer.stop()
    writer.notify.close(linger=0)
    store.close()
