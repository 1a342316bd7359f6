"""Per-token weight versions (a sample generated across an in-place weight update) through a real buffer
server and the learner: the spans survive ingest, storage and the batch reply, the batch holds each
token's version, and the learner reports staleness per token as well as from each sample's oldest."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common import protocol
from learner.batch import collate
from learner.data import BufferSource
from learner.synthetic import synth_groups
from learner.train import Learner
from tests.buffer.fixtures import BufferProc, SyncSender
from tests.learner.train_fixtures import make_cfg


def with_spans(groups: list[protocol.SampleGroup]) -> list[protocol.SampleGroup]:
    """Each sample's first half from version 0, the rest from version 1 (weight_version stays the oldest)."""
    for g in groups:
        for s in g.samples:
            k = max(1, s.response_length // 2)
            s.version_spans = np.asarray([0, k, 1, s.response_length - k], dtype=np.int64)
    return groups


def test_sample_spans_round_trip_and_are_checked() -> None:
    s = with_spans(synth_groups(1, 1, 60, seed=1, resp_len=(4, 4)))[0].samples[0]
    back = protocol.decode(protocol.encode(s))
    assert isinstance(back, protocol.Sample)
    assert back.token_versions().tolist() == [0, 0, 1, 1]
    s.version_spans = np.asarray([1, 4], dtype=np.int64)  # oldest span must be the sample's weight_version
    try:
        protocol.decode(protocol.encode(s))
        raise AssertionError("a span list that disagrees with weight_version was accepted")
    except protocol.ProtocolError as e:
        assert e.reason == "length_mismatch"


def test_per_token_versions_through_buffer_and_learner(tiny_model_dir: Path, tmp_path: Path) -> None:
    srv = BufferProc(tmp_path, ["buffer.max_staleness=2"]).start()
    try:
        groups = with_spans(synth_groups(8, 4, 60, seed=8, resp_len=(2, 12)))
        with SyncSender(srv.ingest_addr, 0) as snd:
            for g in groups:
                snd.send(g, timeout_s=10)
        src = BufferSource(srv.serve_addr, max_staleness=2)
        got = src.get_batch(2, 4, 10).groups
        sent = {g.group_id: g for g in groups}
        for g in got:
            for a, b in zip(g.samples, sent[g.group_id].samples, strict=True):
                assert a.version_spans is not None and a.version_spans.tolist() == b.version_spans.tolist()
        batch = collate(got, pad_id=0)
        rows = [s for g in got for s in g.samples]
        for i, s in enumerate(rows):
            assert batch.token_versions[i, : s.response_length].tolist() == s.token_versions().tolist()
        learner = Learner(make_cfg(tiny_model_dir), src)
        learner.version = 2
        rest = [g for g in groups if g.group_id not in {x.group_id for x in got}]
        tokens = np.concatenate([s.token_versions() for g in rest for s in g.samples])
        stats = learner.step()
        assert stats["samples"] == 16 and stats["staleness_mean"] == 2.0  # from each sample's oldest token
        assert stats["token_staleness_max"] == 2.0
        assert abs(stats["token_staleness_mean"] - float((2 - tokens).mean())) < 1e-6
        assert stats["token_staleness_mean"] < 2.0  # the newer tokens count as fresher
    finally:
        srv.cleanup()
