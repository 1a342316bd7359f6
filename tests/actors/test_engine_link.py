"""actors.engine_link.EngineLink: which supervisor and engine implementation each ``engine.kind`` gets, and
what the link shows the worker is read from the part that owns it (the served version and the counts from the
weight follower and the supervisor). The parts' own behaviour: tests/actors/test_weight_follower.py,
test_engine_supervisor.py, test_link_state.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.engine import RolloutServerEngine, SGLangEngine
from actors.engine_supervisor import LocalSupervisor, RemoteSupervisor
from common.config import load_config
from tests.actors.link_fixtures import Owner, link_config, make_link, sample


def test_each_engine_kind_gets_its_supervisor_and_implementation(tiny_model_dir: Path) -> None:
    owner = Owner()
    remote, watcher = make_link(link_config(tiny_model_dir, "http://127.0.0.1:1"), owner)
    watcher.close()
    assert isinstance(remote.supervisor, RemoteSupervisor) and remote.process is None and not remote.owned
    kinds = {}
    for kind, imitate in (("rollout_server", "false"), ("rollout_server", "true"), ("sglang", "false")):
        cfg = load_config(None, [f"model.path={tiny_model_dir}", f"engine.kind={kind}",
                                 f"engine.imitate_sglang={imitate}", "metrics.prometheus=false"])
        link, watcher = make_link(cfg, owner)
        watcher.close()
        asyncio.run(link.use_engine("http://127.0.0.1:1"))  # what a (re)start does with the engine's URL
        kinds[kind, imitate] = (type(link.supervisor), type(link.client))
        asyncio.run(link.close())
    assert kinds == {("rollout_server", "false"): (LocalSupervisor, RolloutServerEngine),
                     ("rollout_server", "true"): (LocalSupervisor, SGLangEngine),
                     ("sglang", "false"): (RemoteSupervisor, SGLangEngine)}


def test_a_distributed_push_moves_the_version_and_counts_its_pause(tiny_model_dir: Path) -> None:
    cfg = link_config(tiny_model_dir, "http://127.0.0.1:9")  # never reached: a push is recorded, not performed here

    async def main() -> None:
        owner = Owner()
        link, watcher = make_link(cfg, owner)
        try:
            link.pushed(4, 0.0125)
            link.pushed(5, 0.02)
            assert link.version == 5 and owner.changes == 2 and sample(link, "weight_version") == 5
            assert link.counts.as_dict() == {"engine_restarts": 0, "weight_loads": 0, "weight_sync_failures": 0,
                                             "weight_pushes": 2, "push_pause_ms": 32}
            assert link.weights.version == 5 and link.weights.pushes == 2  # the follower's, read through the link
            link.supervisor.count_start()
            assert link.engine_starts == link.supervisor.starts == 1
        finally:
            watcher.close()

    asyncio.run(main())
