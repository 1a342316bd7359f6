"""The learner against a real buffer server subprocess: fetch over ZeroMQ, staleness floor, one step."""

from __future__ import annotations

from pathlib import Path

from buffer.client import GroupSender
from learner.data import BufferSource
from learner.train import Learner
from tests.buffer.conftest import BufferProc
from tests.learner.synth import synth_groups
from tests.learner.test_train import make_cfg


def test_learner_step_on_batch_from_real_buffer(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = BufferProc(tmp_path, ["buffer.max_staleness=1"]).start()
    try:
        groups = synth_groups(6, 4, 60, seed=8)
        with GroupSender(srv.ingest_addr, 0) as s:
            for g in groups:
                s.send(g, timeout_s=10)
        src = BufferSource(srv.serve_addr, max_staleness=1)
        learner = Learner(make_cfg(tiny_model_dir), src)
        stats = learner.step()  # fetches learner.batch_groups = 4 groups through the REQ socket
        assert stats["weight_version"] == 1 and stats["samples"] == 16
        assert src.groups_consumed == 4 and src.state_dict()["groups_consumed"] == 4
        assert src.client.stats()["depth_groups"] == 2
        # Remaining groups are version 0: still within max_staleness=1 of learner version 1.
        got = src.get_batch(1, 2, 10)
        assert {g.group_id for g in got} <= {g.group_id for g in groups[4:]} and len(got) == 2
    finally:
        srv.cleanup()
