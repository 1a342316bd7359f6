"""actors.engine_supervisor: the supervisors count the engine's starts and restarts (theirs alone), the health
watch holds its probes while a push pauses the engine, and against a real rollout_server reached as an external
engine: failed probes declare a stopped engine dead and a remote engine that does not come back is given up."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from actors.engine_link import EngineLost
from tests.actors.link_fixtures import Owner, link_config, make_link, sample


def test_starts_and_restarts_are_the_supervisors_and_a_push_hold_nests(tiny_model_dir: Path) -> None:
    link, watcher = make_link(link_config(tiny_model_dir, "http://127.0.0.1:9"), Owner())
    try:
        sup = link.supervisor
        sup.count_start()
        sup.count_start()
        assert (sup.starts, link.engine_starts, sup.restarts) == (2, 2, 0)
        assert sup._count_restart() == 1 and link.counts.engine_restarts == 1
        assert sample(link, "engine_restarts_total") == 1
        health = link.health
        with health.pushing():
            with health.pushing():
                assert health.held and link.pushing_now
            assert health.held  # the outer push still pauses the engine
        assert not health.held
        with pytest.raises(RuntimeError), health.pushing():
            raise RuntimeError("a push that failed")
        assert not health.held  # released on the way out of a failed push too
    finally:
        watcher.close()


def test_health_probes_find_a_stopped_engine_and_supervise_gives_it_up(tiny_model_dir: Path, server_factory: Any) -> None:
    server = server_factory(tiny_model_dir)
    cfg = link_config(tiny_model_dir, server.url, "engine.health_interval_s=0.2", "engine.health_timeout_s=1",
                  "engine.health_failures=2", "engine.startup_timeout_s=1", "engine.max_restarts=0")

    async def main() -> None:
        link, watcher = make_link(cfg, Owner())
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


def test_health_probes_neither_run_nor_count_while_a_push_pauses_the_engine(tiny_model_dir: Path,
                                                                           server_factory: Any) -> None:
    """A distributed push pauses the engine, and a paused engine fails /health (SGLang's probe is a generation):
    inside ``link.pushing()`` those failures must not get the engine declared dead; outside it they do."""
    server = server_factory(tiny_model_dir)
    cfg = link_config(tiny_model_dir, server.url, "engine.health_interval_s=0.2", "engine.health_timeout_s=1",
                  "engine.health_failures=2")

    async def main() -> None:
        link, watcher = make_link(cfg, Owner())
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
