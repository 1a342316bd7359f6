"""actors.weight_follower.WeightFollower, the served version's one owner: what a (re)started or reached engine
serves, the newest verified version to start with, refusals counted once and never retried, a grant held until
its version is served (and not for a refused one), and against a real rollout_server reached as an external
engine: disk syncs that move the served version and refusals that leave it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

from actors.engine import SGLangEngine
from actors.link_state import LinkState
from actors.weight_follower import WeightFollower
from actors.weight_watcher import WeightWatcher
from common.config import Config, load_config
from common.metrics import Metrics
from common.protocol import WeightUpdate
from tests.actors.actor_harness import make_weights
from tests.actors.link_fixtures import Owner, link_config, make_link, misshapen_weights, sample, until_changed
from tests.sockdirs import socket_dir


def _follower(cfg: Config) -> tuple[WeightFollower, WeightWatcher, Owner, Metrics]:
    """A follower of no engine (nothing is loaded) with a watcher that hears only ``offer()``."""
    sockets = socket_dir("vf")
    watcher = WeightWatcher(f"ipc://{sockets}/pub", f"ipc://{sockets}/query", query_timeout_s=0.2)
    owner, metrics = Owner(), Metrics("actor")
    follower = WeightFollower(cfg, 0, LinkState(cfg, "", 30.0), watcher,
                              lambda name, **labels: getattr(metrics, name).labels(actor="0", **labels),
                              owner.engine_changed)
    return follower, watcher, owner, metrics


def _served(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("vapo_actor_weight_version", {"actor": "0"})


def test_what_a_started_or_reached_engine_serves_becomes_the_served_version(tiny_model_dir: Path) -> None:
    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    f, watcher, owner, metrics = _follower(cfg)
    try:
        assert (f.version, f.model_path, owner.changes) == (0, str(tiny_model_dir), 0)
        f.started(3, "/w/v3")  # our engine restarted on v3's directory
        assert (f.version, f.model_path, owner.changes, _served(metrics)) == (3, "/w/v3", 1, 3)
        assert f.reached(3) is False and f.model_path == "/w/v3"  # the same version: its directory is known
        assert f.reached(1) is True  # a remote engine back on older weights: their directory is not ours to know
        assert (f.version, f.model_path, owner.changes, _served(metrics)) == (1, str(tiny_model_dir), 3, 1)
        f.pushed(4, 0.012)
        assert (f.version, f.model_path, f.pushes, f.push_pause_ms, f.loads) == (4, str(tiny_model_dir), 1, 12, 0)
    finally:
        watcher.close()


def test_the_newest_verified_version_is_offered_to_start_with_and_a_bad_one_is_refused_once(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    f, watcher, owner, metrics = _follower(cfg)
    try:
        assert f.newest_verified() == (0, str(tiny_model_dir))  # nothing announced: the base model
        bad = dataclasses.replace(make_weights(tiny_model_dir, tmp_path / "v2", 0.5, 2), sha256="0" * 64)
        watcher.offer(bad)
        assert f.newest_verified() == (0, str(tiny_model_dir)) and f.refused == {2: "checksum"}
        assert f.newest_verified() == (0, str(tiny_model_dir))  # never tried again, never counted again
        assert (f.failures, owner.changes) == (1, 1)  # the refusal woke the prompts held for v2
        assert metrics.registry.get_sample_value("vapo_actor_weight_sync_failures_total",
                                                 {"actor": "0", "reason": "checksum"}) == 1
        good = make_weights(tiny_model_dir, tmp_path / "v3", 0.5, 3)
        watcher.offer(good)
        assert f.newest_verified() == (3, good.path)
        assert f.version == 0  # offered to start with, not served until an engine starts on it
        f.refused[3] = "mine"  # a copy: nobody but the follower writes its refusals
        assert f.refused == {2: "checksum"}
    finally:
        watcher.close()


def test_a_grant_waits_for_its_version_but_not_for_a_refused_one(tiny_model_dir: Path) -> None:
    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    f, watcher, _, _ = _follower(cfg)
    announced = WeightUpdate(version=5, path="/nowhere/v5", sha256="0" * 64, created_at=time.time())

    async def main() -> None:
        assert await f.await_version(0, 30.0) == 0.0  # served already
        watcher.offer(announced)
        held = asyncio.get_running_loop().create_task(f.await_version(5, 30.0))
        await asyncio.sleep(0)  # the grant is waiting now
        assert not held.done()
        f.pushed(5, 0.0)  # the version arrives: the grant goes ahead at once
        waited = await asyncio.wait_for(held, 10)
        assert 0 < waited < 10
        watcher.offer(dataclasses.replace(announced, version=6))
        assert f.newest_verified() == (5, str(tiny_model_dir)) and 6 in f.refused  # no such directory
        t0 = time.monotonic()
        await f.await_version(6, 30.0)  # refused: nothing will move, so nothing is waited for
        assert time.monotonic() - t0 < 5

    try:
        asyncio.run(main())
    finally:
        watcher.close()


def test_disk_sync_moves_the_served_version_and_refusals_are_counted(tiny_model_dir: Path, server_factory: Any,
                                                                     tmp_path: Path) -> None:
    server = server_factory(tiny_model_dir)
    cfg = link_config(tiny_model_dir, server.url, "actors.verify_tensors=false")  # the engine's own load refuses
    v1 = make_weights(tiny_model_dir, tmp_path / "v1", 0.5, 1)
    bad_sum = dataclasses.replace(make_weights(tiny_model_dir, tmp_path / "v2", 0.25, 2), sha256="0" * 64)
    misshapen = misshapen_weights(tiny_model_dir, tmp_path / "v3", 3)

    async def main() -> None:
        owner = Owner()
        link, watcher = make_link(cfg, owner)
        sync = None
        try:
            await link.connect()
            assert link.version == 0 and link.url == server.url and not link.owned and owner.changes == 1
            assert type(link.client) is SGLangEngine  # an external engine: SGLang's behaviour is assumed
            link.gate.set()
            sync = asyncio.get_running_loop().create_task(link.sync_loop())
            watcher.offer(v1)
            await until_changed(lambda: link.version == 1, link, 60)
            assert await link.client.get_weight_version() == "1"  # type: ignore[union-attr]
            assert link.model_path == v1.path and link.counts.weight_loads == 1 and owner.changes == 2
            assert sample(link, "weight_version") == 1 and sample(link, "weight_sync_seconds_count") == 1
            watcher.offer(bad_sum)  # refused before the engine hears of it
            await until_changed(lambda: 2 in link.refused, link, 30)
            watcher.offer(misshapen)  # the engine answers the load with an error and keeps v1
            await until_changed(lambda: 3 in link.refused, link, 60)
            assert link.refused == {2: "checksum", 3: "load_error"} and link.version == 1
            assert await link.client.get_weight_version() == "1"  # type: ignore[union-attr]
            assert dataclasses.asdict(link.counts) == {"engine_restarts": 0, "weight_loads": 1,
                                                       "weight_sync_failures": 2, "weight_pushes": 0,
                                                       "push_pause_ms": 0}
            assert link.counts.as_dict() == {"engine_restarts": 0, "weight_loads": 1, "weight_sync_failures": 2}
            assert sample(link, "weight_sync_failures_total", reason="checksum") == 1
            assert sample(link, "weight_sync_failures_total", reason="load_error") == 1
            assert owner.changes == 4  # each refusal wakes the prompts held for that version
        finally:
            if sync is not None:
                sync.cancel()
                await asyncio.gather(sync, return_exceptions=True)
            await link.close()
            watcher.close()

    asyncio.run(main())
