"""Weight push: atomic versioned safetensors with checksum, PUB announcement, REP latest, pruning."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import zmq

from common import protocol
from common.checksum import weights_sha256
from common.modeling import load_model, load_tokenizer
from learner.publisher import WeightPublisher
from learner.weights import (
    STABLE,
    complete_versions,
    latest_update,
    prune,
    write_version,
)


def _recv(sock: zmq.Socket, timeout_s: float = 10.0) -> bytes:
    assert sock.poll(int(timeout_s * 1000)), "no message before the deadline"
    return sock.recv()


def test_write_version_is_complete_and_checksummed(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    root = tmp_path / "weights"
    up = write_version(root, 4, model, tok)
    d = Path(up.path)
    assert d.name == "v4" and (d / STABLE).is_file() and not (root / "v4.tmp").exists()
    assert up.sha256 == weights_sha256(d)  # common.checksum: what the actors verify
    assert up.sha256 != hashlib.sha256(b"").hexdigest()
    reloaded = load_model(d)
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True))
    # An interrupted write (no STABLE, .tmp name) is never reported and is cleaned up by prune.
    (root / "v5.tmp").mkdir()
    (root / "v6").mkdir()  # no STABLE marker: incomplete
    assert complete_versions(root) == [4] and latest_update(root).version == 4
    for v in (7, 8, 9):
        write_version(root, v, model, tok)
    assert prune(root, keep=2) == [4, 7]
    assert complete_versions(root) == [8, 9] and not (root / "v5.tmp").exists()
    try:
        write_version(root, 9, model, tok)
        raise AssertionError("a version was written twice")
    except FileExistsError:
        pass


def test_publisher_pub_and_late_query(tmp_path: Path) -> None:
    pub = WeightPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    req = ctx.socket(zmq.REQ)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.publish_endpoint)
        req.connect(pub.query_endpoint)
        req.send(protocol.encode(protocol.WeightQuery()))
        err = protocol.decode(_recv(req))
        assert isinstance(err, protocol.ErrorReply) and err.reason == "no_weights"
        up = protocol.WeightUpdate(version=3, path=str(tmp_path), sha256="a" * 64, created_at=time.time())
        # PUB drops messages to a subscriber that is still joining: re-publish until one arrives.
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:
            pub.publish(up)
            if sub.poll(100):
                got = protocol.decode(sub.recv())
        assert got == up
        req.send(protocol.encode(protocol.WeightQuery()))
        assert protocol.decode(_recv(req)) == up
        req.send(b"\x00garbage")
        bad = protocol.decode(_recv(req))
        assert isinstance(bad, protocol.ErrorReply)
    finally:
        sub.close(0)
        req.close(0)
        pub.close()


def test_non_loopback_bind_without_keys_is_refused() -> None:
    try:
        WeightPublisher("tcp://0.0.0.0:0", "tcp://127.0.0.1:0")
    except Exception as e:  # SecurityError (common.security) or RuntimeError without it
        assert "Curve" in str(e) or "curve" in str(e)
    else:
        raise AssertionError("bound 0.0.0.0 without CurveZMQ keys")
