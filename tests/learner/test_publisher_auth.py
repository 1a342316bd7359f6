"""The learner's weight publisher with the run's keys: the run's clients read updates, strangers get nothing
and are counted (no key, a key the run never authorised)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import zmq

from common import protocol
from common.config import CurveConfig
from common.security import (
    ClientKeys,
    apply_client_curve,
    client_curve_keys,
    generate_keypair,
    generate_run_keys,
)
from learner.publisher import WeightPublisher
from tests.polling import wait_for


def _req(ctx: zmq.Context, addr: str, keys: ClientKeys | None) -> zmq.Socket:
    s = ctx.socket(zmq.REQ)
    s.linger = 0
    s.sndtimeo = 1000
    apply_client_curve(s, keys)
    s.connect(addr)
    return s


def test_only_the_runs_keys_read_weight_updates_and_strangers_are_counted(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="learner.publisher")
    keys = generate_run_keys(tmp_path / "keys")
    curve = CurveConfig(keys_dir=str(keys))
    seen: list[str] = []
    up = protocol.WeightUpdate(version=2, path=str(tmp_path), sha256="b" * 64, created_at=time.time())
    pub = WeightPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", curve, latest=up, on_refused=seen.append)
    _, other = generate_keypair(tmp_path / "other", "actor")
    stranger = client_curve_keys(CurveConfig(client_secret_key=str(other), server_public_key=str(keys / "server.key")))
    ctx = zmq.Context()
    try:
        for keys_ in (None, stranger):
            req = _req(ctx, pub.query_endpoint, keys_)
            try:
                req.send(protocol.encode(protocol.WeightQuery()))
                assert not req.poll(1000)
            except zmq.Again:
                pass
            req.close()
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            apply_client_curve(sub, keys_)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(pub.publish_endpoint)
            pub.publish(up)
            assert not sub.poll(500)
            sub.close()
        wait_for(lambda: pub.refused["query"] >= 2 and pub.refused["publish"] >= 2, 20, "refused handshakes")
        assert set(seen) == {"query", "publish"}
        # Each socket's first refusal is logged; the others wait for the once-a-minute summary.
        lines = sorted(r.getMessage().split(":")[0] for r in caplog.records if "CurveZMQ handshake" in r.getMessage())
        assert lines == ["weight publish socket", "weight query socket"], lines
        req = _req(ctx, pub.query_endpoint, client_curve_keys(curve, "actor"))
        req.send(protocol.encode(protocol.WeightQuery()))
        assert req.poll(10_000) and protocol.decode(req.recv()) == up
        req.close()
    finally:
        ctx.term()
        pub.close()
