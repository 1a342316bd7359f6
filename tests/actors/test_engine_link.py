"""actors.engine_link.EngineLink on its own, with its parts (``actors.engine_supervisor``,
``actors.weight_follower``), against a real ``actors.rollout_server`` subprocess reached as an external engine:
disk weight sync, refused and failed updates, health probes and a lost engine; and which supervisor and
engine implementation each ``engine.kind`` gets."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.engine import RolloutServerEngine, SGLangEngine
from actors.engine_link import EngineLink, EngineLost
from actors.engine_supervisor import LocalSupervisor, RemoteSupervisor
from actors.weight_watcher import WeightWatcher
from common.checksum import weights_sha256
from common.config import Config, load_config
from common.metrics import Metrics
from common.protocol import WeightUpdate
from tests.actors.actor_harness import make_weights
from tests.sockdirs import socket_dir


class Owner:
    """The worker's side of the link: counts the changes it is told about."""

    def __init__(self) -> None:
        self.changes = 0
        self.stop = False

    def engine_changed(self) -> None:
        self.changes += 1

    def stopping(self) -> bool:
        return self.stop


def _config(model_dir: Path, url: str, *extra: str) -> Config:
    return load_config(None, [f"model.path={model_dir}", "engine.kind=external", f"engine.urls=[{url}]",
                              "metrics.prometheus=false", *extra])


def _link(cfg: Config, owner: Owner) -> tuple[EngineLink, WeightWatcher]:
    sockets = socket_dir("vl")  # no learner there: the watcher only hears offer()
    watcher = WeightWatcher(f"ipc://{sockets}/pub", f"ipc://{sockets}/query", query_timeout_s=0.2)
    return EngineLink(cfg, 0, watcher, owner, Metrics("actor"), generate_timeout_s=30.0), watcher


def _sample(link: EngineLink, name: str, **labels: str) -> float | None:
    return link.metrics.registry.get_sample_value(f"vapo_actor_{name}", {"actor": "0", **labels})


async def _until(done: Callable[[], bool], link: EngineLink, timeout_s: float) -> None:
    """Wait (on the link's change notices) until ``done()``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        left = deadline - time.monotonic()
        assert left > 0, "the link did not get there in time"
        await link.wait_changed(min(left, 1.0))


def _misshapen_weights(base: Path, out: Path, version: int) -> WeightUpdate:
    """A version whose checksum is right but one of whose matrices lost a row: only the engine's load fails."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            name = next(k for k, v in tensors.items() if v.dim() == 2)
            tensors[name] = tensors[name][:-1].contiguous()
            save_file(tensors, str(out / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, out / f.name)
    return WeightUpdate(version=version, path=str(out), sha256=weights_sha256(out), created_at=time.time())


def test_each_engine_kind_gets_its_supervisor_and_implementation(tiny_model_dir: Path) -> None:
    owner = Owner()
    remote, watcher = _link(_config(tiny_model_dir, "http://127.0.0.1:1"), owner)
    watcher.close()
    assert isinstance(remote.supervisor, RemoteSupervisor) and remote.process is None and not remote.owned
    kinds = {}
    for kind, imitate in (("rollout_server", "false"), ("rollout_server", "true"), ("sglang", "false")):
        cfg = load_config(None, [f"model.path={tiny_model_dir}", f"engine.kind={kind}",
                                 f"engine.imitate_sglang={imitate}", "metrics.prometheus=false"])
        link, watcher = _link(cfg, owner)
        watcher.close()
        asyncio.run(link.use_engine("http://127.0.0.1:1"))  # what a (re)start does with the engine's URL
        kinds[kind, imitate] = (type(link.supervisor), type(link.client))
        asyncio.run(link.close())
    assert kinds == {("rollout_server", "false"): (LocalSupervisor, RolloutServerEngine),
                     ("rollout_server", "true"): (LocalSupervisor, SGLangEngine),
                     ("sglang", "false"): (RemoteSupervisor, SGLangEngine)}


def test_disk_sync_moves_the_served_version_and_refusals_are_counted(tiny_model_dir: Path, server_factory: Any,
                                                                     tmp_path: Path) -> None:
    server = server_factory(tiny_model_dir)
    cfg = _config(tiny_model_dir, server.url, "actors.verify_tensors=false")  # the engine's own load refuses
    v1 = make_weights(tiny_model_dir, tmp_path / "v1", 0.5, 1)
    bad_sum = dataclasses.replace(make_weights(tiny_model_dir, tmp_path / "v2", 0.25, 2), sha256="0" * 64)
    misshapen = _misshapen_weights(tiny_model_dir, tmp_path / "v3", 3)

    async def main() -> None:
        owner = Owner()
        link, watcher = _link(cfg, owner)
        sync = None
        try:
            await link.connect()
            assert link.version == 0 and link.url == server.url and not link.owned and owner.changes == 1
            assert type(link.client) is SGLangEngine  # an external engine: SGLang's behaviour is assumed
            link.gate.set()
            sync = asyncio.get_running_loop().create_task(link.sync_loop())
            watcher.offer(v1)
            await _until(lambda: link.version == 1, link, 60)
            assert await link.client.get_weight_version() == "1"  # type: ignore[union-attr]
            assert link.model_path == v1.path and link.counts.weight_loads == 1 and owner.changes == 2
            assert _sample(link, "weight_version") == 1 and _sample(link, "weight_sync_seconds_count") == 1
            watcher.offer(bad_sum)  # refused before the engine hears of it
            await _until(lambda: 2 in link.refused, link, 30)
            watcher.offer(misshapen)  # the engine answers the load with an error and keeps v1
            await _until(lambda: 3 in link.refused, link, 60)
            assert link.refused == {2: "checksum", 3: "load_error"} and link.version == 1
            assert await link.client.get_weight_version() == "1"  # type: ignore[union-attr]
            assert dataclasses.asdict(link.counts) == {"engine_restarts": 0, "weight_loads": 1,
                                                       "weight_sync_failures": 2, "weight_pushes": 0,
                                                       "push_pause_ms": 0}
            assert link.counts.as_dict() == {"engine_restarts": 0, "weight_loads": 1, "weight_sync_failures": 2}
            assert _sample(link, "weight_sync_failures_total", reason="checksum") == 1
            assert _sample(link, "weight_sync_failures_total", reason="load_error") == 1
            assert owner.changes == 4  # each refusal wakes the prompts held for that version
        finally:
            if sync is not None:
                sync.cancel()
                await asyncio.gather(sync, return_exceptions=True)
            await link.close()
            watcher.close()

    asyncio.run(main())


def test_health_probes_find_a_stopped_engine_and_supervise_gives_it_up(tiny_model_dir: Path, server_factory: Any) -> None:
    server = server_factory(tiny_model_dir)
    cfg = _config(tiny_model_dir, server.url, "engine.health_interval_s=0.2", "engine.health_timeout_s=1",
                  "engine.health_failures=2", "engine.startup_timeout_s=1", "engine.max_restarts=0")

    async def main() -> None:
        link, watcher = _link(cfg, Owner())
        loop = asyncio.get_running_loop()
        health = supervise = None
        try:
            await link.connect()
            link.gate.set()
            health = loop.create_task(link.watch_health())
            supervise = loop.create_task(link.supervise())
            with pytest.raises(TimeoutError):  # a live engine passes its probes: no trouble
                await asyncio.wait_for(link.trouble.wait(), 1.5)
            stopped = time.monotonic()
            await asyncio.to_thread(server.stop)
            # A remote engine that stops answering: waited for startup_timeout_s x (max_restarts + 1), then lost.
            with pytest.raises(EngineLost, match="did not come back"):
                await asyncio.wait_for(supervise, 20)
            assert time.monotonic() - stopped < 10
            assert not link.gate.is_set()  # nothing new goes to a lost engine
        finally:
            for task in (health, supervise):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (health, supervise) if t is not None), return_exceptions=True)
            await link.close()
            watcher.close()

    asyncio.run(main())


def test_a_distributed_push_moves_the_version_and_counts_its_pause(tiny_model_dir: Path) -> None:
    cfg = _config(tiny_model_dir, "http://127.0.0.1:9")  # never reached: a push is recorded, not performed here

    async def main() -> None:
        owner = Owner()
        link, watcher = _link(cfg, owner)
        try:
            link.pushed(4, 0.0125)
            link.pushed(5, 0.02)
            assert link.version == 5 and owner.changes == 2 and _sample(link, "weight_version") == 5
            assert link.counts.as_dict() == {"engine_restarts": 0, "weight_loads": 0, "weight_sync_failures": 0,
                                             "weight_pushes": 2, "push_pause_ms": 32}
        finally:
            watcher.close()

    asyncio.run(main())


def test_health_probes_neither_run_nor_count_while_a_push_pauses_the_engine(tiny_model_dir: Path,
                                                                           server_factory: Any) -> None:
    """A distributed push pauses the engine, and a paused engine fails /health (SGLang's probe is a generation):
    inside ``link.pushing()`` those failures must not get the engine declared dead; outside it they do."""
    server = server_factory(tiny_model_dir)
    cfg = _config(tiny_model_dir, server.url, "engine.health_interval_s=0.2", "engine.health_timeout_s=1",
                  "engine.health_failures=2")

    async def main() -> None:
        link, watcher = _link(cfg, Owner())
        health = None
        try:
            await link.connect()
            link.gate.set()
            assert link.client is not None
            health = asyncio.get_running_loop().create_task(link.watch_health())
            with link.pushing():
                await link.client.pause_generation("in_place")  # /health answers 503 from here on
                with pytest.raises(TimeoutError):  # ten probe intervals: none counted
                    await asyncio.wait_for(link.trouble.wait(), 2.0)
            await asyncio.wait_for(link.trouble.wait(), 10)  # still paused, no push: the probes count again
            await link.client.continue_generation()
        finally:
            if health is not None:
                health.cancel()
                await asyncio.gather(health, return_exceptions=True)
            await link.close()
            watcher.close()

    asyncio.run(main())
