"""BufferStats of a real (not running) BufferServer: the StatsReply map reads every role's counters, and a
forced gauge update shows the store's depth."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from buffer.server import BufferServer
from buffer.store import GroupRecord
from common.metrics import Metrics
from common.protocol import encode
from tests.buffer.fixtures import buffer_config, make_group


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BufferServer]:
    srv = BufferServer(buffer_config(tmp_path, ["learner.batch_groups=4", "buffer.max_staleness=2"]),
                       Metrics("buffer"))
    yield srv
    srv.close()


def test_the_reply_reads_the_store_and_every_role(server: BufferServer) -> None:
    g = make_group(version=3)
    server.store.put_groups([GroupRecord(g.group_id, encode(g), 3, len(g.samples), [])])
    server.rejections.reject("multipart", "x")
    server.rejections.reject("role", "y")
    stats = server.stats.reply()
    assert stats["depth_groups"] == 1.0 and stats["min_version"] == 3.0 == stats["max_version"]
    assert stats["rejected_multipart"] == 1.0 and stats["rejected_role"] == 1.0 and stats["rejected_total"] == 2.0
    assert stats["admission_capacity"] == 2 * 4 - 1
    assert stats["batch_waiting"] == 0.0 and stats["credit_outstanding"] == 0.0
    assert stats["invalid_total"] == 0.0 and stats["storage_errors"] == 0.0
    assert stats["auth_refused_ingest"] == 0.0 == stats["auth_refused_serve"]
    assert stats["pid"] == float(os.getpid())
    assert all(isinstance(v, float) for v in stats.values())


def test_a_forced_gauge_update_shows_the_depth(server: BufferServer) -> None:
    gauge = "vapo_buffer_depth_groups"
    assert server.metrics.registry.get_sample_value(gauge) == 0.0
    g = make_group()
    server.store.put_groups([GroupRecord(g.group_id, encode(g), 0, len(g.samples), [])])
    server.stats.update_gauges(force=True)
    assert server.metrics.registry.get_sample_value(gauge) == 1.0
    assert server.metrics.registry.get_sample_value("vapo_buffer_admission_capacity") == 2 * 4 - 1
