"""actors.weight_watcher: WeightUpdate delivery (PUB and the WeightQuery safety net) and checksum checks."""

from __future__ import annotations

import asyncio
import time
from contextlib import closing
from pathlib import Path

from actors.weight_watcher import WeightWatcher, verify_update
from common import protocol
from learner.publisher import WeightPublisher
from tests.actors.actor_harness import make_weights
from tests.sockdirs import socket_dir


def _addrs() -> tuple[str, str]:
    d = socket_dir("vw")
    return f"ipc://{d}/pub", f"ipc://{d}/query"


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    await asyncio.wait_for(event.wait(), timeout_s)


def test_query_pub_and_poll_deliver_the_newest_update(tmp_path: Path, tiny_model_dir: Path) -> None:
    pub, query = _addrs()
    v1 = make_weights(tiny_model_dir, tmp_path / "v1", 0.5, 1)
    v2 = make_weights(tiny_model_dir, tmp_path / "v2", 0.25, 2)
    v3 = make_weights(tiny_model_dir, tmp_path / "v3", 0.125, 3)

    async def main() -> None:
        learner = WeightPublisher(pub, query)
        w = WeightWatcher(pub, query, poll_s=0.2, query_timeout_s=2.0)
        try:
            assert await w.query() is None and w.latest is None  # learner up, nothing published yet
            learner.publish(v1)  # before anyone subscribed: PUB drops it, the query still finds it
            assert (await w.query()).version == 1
            w.changed.clear()
            task = asyncio.get_running_loop().create_task(w.run())
            learner.publish(v2)
            await _wait(w.changed, 10)
            assert w.latest.version == 2
            w.changed.clear()
            # A restarted learner that announces v3 on no PUB message: only the periodic WeightQuery sees it.
            learner.close()
            learner = WeightPublisher(pub, query, latest=v3)
            await _wait(w.changed, 10)
            assert w.latest.version == 3
            assert not w.offer(v2)  # never goes backwards
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            w.close()
            learner.close()

    asyncio.run(main())


def test_query_without_learner_times_out_and_recovers() -> None:
    pub, query = _addrs()

    async def main() -> None:
        w = WeightWatcher(pub, query, query_timeout_s=0.2)
        t0 = time.monotonic()
        assert await w.query() is None
        assert time.monotonic() - t0 < 5
        v4 = protocol.WeightUpdate(version=4, path="/x", sha256="a" * 64, created_at=1.0)
        with closing(WeightPublisher(pub, query, latest=v4)):
            assert (await w.query(timeout_s=5)).version == 4  # a fresh REQ socket after the timeout
        w.close()

    asyncio.run(main())


def test_verify_update_reasons(tmp_path: Path, tiny_model_dir: Path) -> None:
    good = make_weights(tiny_model_dir, tmp_path / "v1", 0.5, 1)
    assert verify_update(good) is None
    bad = protocol.WeightUpdate(version=2, path=good.path, sha256="f" * 64, created_at=good.created_at)
    assert verify_update(bad)[0] == "checksum"
    gone = protocol.WeightUpdate(version=3, path=str(tmp_path / "pruned"), sha256=good.sha256, created_at=1.0)
    assert verify_update(gone)[0] == "missing"
    # a truncated weight file (partial copy) no longer matches
    f = next(Path(good.path).glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-10])
    assert verify_update(good)[0] == "checksum"


def test_next_change_wakes_on_a_newer_offer_or_a_nudge_once_each() -> None:
    pub, query = _addrs()
    w = WeightWatcher(pub, query, query_timeout_s=0.2)

    async def main() -> None:
        first = protocol.WeightUpdate(version=1, path="/w/v1", sha256="0" * 64, created_at=time.time())
        assert w.offer(first)
        await asyncio.wait_for(w.next_change(), 5)  # the offer is seen...
        waiting = asyncio.get_running_loop().create_task(w.next_change())
        await asyncio.sleep(0)
        assert not waiting.done()  # ...once: the next wait is for the next change
        assert not w.offer(first)  # not newer: no change
        await asyncio.sleep(0)
        assert not waiting.done()
        w.nudge()  # an engine restarted: look again as if announced
        await asyncio.wait_for(waiting, 5)
        assert w.latest is first

    try:
        asyncio.run(main())
    finally:
        w.close()
