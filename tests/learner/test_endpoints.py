"""learner.endpoints: the learner's listening sockets are bound when made (rank 0's publisher announcing the
newest complete version on disk, a crashed write's leftovers pruned), a weight-group store address that may not
listen fails at once with its key and leaves nothing bound, and closing is idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from common.config import Config, ConfigError, load_config
from common.metrics import Metrics
from common.modeling import build_char_tokenizer
from learner.endpoints import Endpoints, _Later
from tests.polling import wait_for
from tests.ports import free_port


def _cfg(root: Path, *extra: str) -> Config:
    return load_config(None, [f"run.root={root}", "run.name=r", "metrics.prometheus=false",
                              "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0", *extra])


def test_disk_transport_binds_the_publisher_and_prunes_a_crashed_write(tmp_path: Path) -> None:
    (tmp_path / "r" / "weights" / "v3.tmp").mkdir(parents=True)  # a write a crash cut short
    ep = Endpoints(_cfg(tmp_path), Metrics("learner"))
    try:
        assert ep.push is None and ep.publisher is not None
        assert ep.publisher.publish_endpoint.startswith("tcp://127.0.0.1:") and ep.publisher.latest is None
        assert not (tmp_path / "r" / "weights" / "v3.tmp").exists()
    finally:
        ep.close()
    assert ep.publisher is None
    ep.close()  # idempotent


def test_a_store_address_that_may_not_listen_fails_at_once_and_unbinds(tmp_path: Path) -> None:
    port = free_port()
    cfg = _cfg(tmp_path, f"learner.publish_addr=tcp://127.0.0.1:{port}", "learner.weight_transport=distributed",
               "learner.push_addr=tcp://127.0.0.1:0", "learner.push_master_address=0.0.0.0")
    with pytest.raises(ConfigError, match="learner.push_master_address"):
        Endpoints(cfg, Metrics("learner"))
    sock = zmq.Context.instance().socket(zmq.PUB)

    def bound() -> bool:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            return False
        return True

    try:
        # The publisher made first was closed on the way out; ZeroMQ releases a closed socket's port in its I/O
        # thread, a moment later, so the port is asked for until then (a publisher left open keeps it for good).
        wait_for(bound, 10, "the publisher's port to be released")
    finally:
        sock.close(linger=0)


def test_what_goes_beside_a_pushed_version_waits_for_the_learner(tmp_path: Path) -> None:
    later = _Later()
    later.save_pretrained(tmp_path / "before")  # no learner yet: nothing is written
    assert not (tmp_path / "before").exists()
    later.target = build_char_tokenizer()
    later.save_pretrained(tmp_path / "after")
    assert (tmp_path / "after" / "tokenizer.json").is_file()
