"""learner.push_coordinator: a durable version is announced only once its push is over, so the group's
engines receive it by broadcast rather than also loading it from disk."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from common import protocol
from common.config import load_config
from common.ports import free_port
from learner.push_coordinator import PushCoordinator
from learner.weight_push import PushResult


class _Publisher:
    def __init__(self) -> None:
        self.versions: list[int] = []
        self.published = threading.Event()

    def publish(self, update: protocol.WeightUpdate) -> None:
        self.versions.append(update.version)
        self.published.set()


def test_a_written_version_is_announced_after_its_push_settles(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
                             "learner.weight_transport=distributed", f"learner.push_addr=tcp://127.0.0.1:{free_port()}",
                             "learner.push_timeout_s=30"])
    pub = _Publisher()
    coord = PushCoordinator(cfg, tmp_path / "weights", pub)
    try:
        update = protocol.WeightUpdate(version=1, path=str(tmp_path / "weights" / "v1"), sha256="0" * 64,
                                       created_at=time.time())
        # The writer thread finished v1 while v1's final bucket is still on the wire: it must wait.
        writer = threading.Thread(target=coord._announce, args=(update,))
        writer.start()
        assert not pub.published.wait(0.5) and writer.is_alive()
        coord._settled(PushResult(version=0, broadcast=True), grouped=True)  # an older push: still waits
        assert not pub.published.wait(0.2)
        coord._settled(PushResult(version=1, broadcast=False, error="engine gone"), grouped=True)
        assert pub.published.wait(10) and pub.versions == [1]  # a failed push announces too: disk is the fallback
        writer.join(10)
        assert not writer.is_alive() and coord.dirty  # and the failure rebuilds the group at the next publish
        # A version whose push is already over is announced at once.
        coord._announce(protocol.WeightUpdate(version=1, path=update.path, sha256="0" * 64, created_at=time.time()))
        assert pub.versions == [1, 1]
    finally:
        coord.close()
