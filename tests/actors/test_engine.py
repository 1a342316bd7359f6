"""actors.engine: both implementations satisfy the ``Engine`` protocol, and behave through it against a live
``actors.rollout_server``, as itself and imitating SGLang 0.5.23 (where they differ: the served version).
The real SGLang server is held to the same in ``test_sglang_live.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.engine import Engine, RolloutServerEngine, SGLangEngine, engine_class
from common.sglang_client import SGLangClient, SGLangError
from tests.actors.actor_harness import make_weights
from tests.actors.servers import ServerProc

IMPLEMENTATIONS = [SGLangEngine, RolloutServerEngine]


def test_both_implementations_satisfy_the_protocol_and_a_bare_client_does_not() -> None:
    for cls in IMPLEMENTATIONS:
        engine = cls("http://127.0.0.1:1")
        assert isinstance(engine, Engine), cls
        assert engine.kind in ("sglang", "rollout_server")
    assert not isinstance(SGLangClient("http://127.0.0.1:1"), Engine)  # no probe, no kind: not an engine


def test_engine_class_follows_the_kind_and_the_imitation() -> None:
    assert engine_class("rollout_server", False) is RolloutServerEngine
    assert engine_class("rollout_server", True) is SGLangEngine  # it behaves as SGLang: treated as SGLang
    assert engine_class("sglang", False) is SGLangEngine
    assert engine_class("external", False) is SGLangEngine  # whatever it is, SGLang's path holds for both


async def _round_trip(engine: Engine, weights: str, version: int) -> dict[str, Any]:
    """Generate, load weights from disk, pause and continue, through the interface only."""
    seen: dict[str, Any] = {}
    outs = await engine.generate([[5, 6, 7], [8, 9]], {"temperature": 1.0, "max_new_tokens": 4, "n": 2})
    seen["outputs"] = len(outs)
    seen["logprobs"] = all(o.output_logprobs is not None and len(o.output_logprobs) == len(o.output_ids) for o in outs)
    await engine.update_weights_from_disk(weights, weight_version=version)
    seen["version"] = await engine.get_weight_version()
    seen["served"] = await engine.served_weight_version(timeout_s=30)
    seen["stamped"] = (await engine.generate([5, 6], {"max_new_tokens": 2, "temperature": 0}))[0].weight_version_int
    await engine.pause_generation("in_place")
    seen["probe_updating_paused"] = await engine.probe(True, 5.0)
    await engine.continue_generation()
    seen["health"] = await engine.health(10.0)
    seen["probe"] = await engine.probe(False, 10.0)
    return seen


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_an_implementation_drives_a_live_rollout_server(cls: type[SGLangEngine | RolloutServerEngine], tiny_model_dir: Path,
                                                        tmp_path: Path, server_factory: Callable[..., ServerProc]) -> None:
    server = server_factory(tiny_model_dir)
    version = 3 if cls is SGLangEngine else 4
    upd = make_weights(tiny_model_dir, tmp_path / f"v{version}", 1.05, version)

    async def main() -> dict[str, Any]:
        engine = cls(server.url, timeout_s=60, control_timeout_s=10)
        try:
            await engine.wait_healthy(30)
            return await _round_trip(engine, upd.path, version)
        finally:
            await engine.close()

    seen = asyncio.run(main())
    assert seen["outputs"] == 4 and seen["logprobs"]
    assert seen["version"] == seen["served"] == str(version) and seen["stamped"] == version
    assert seen["probe_updating_paused"]  # /model_info answers while paused, where /health would not
    assert seen["health"] and seen["probe"]


def test_the_served_version_where_the_implementations_differ(tiny_model_dir: Path, tmp_path: Path,
                                                            server_factory: Callable[..., ServerProc]) -> None:
    """SGLang 0.5.23 (imitated): an update whose cache flush is refused answers 400 with the new weights live and
    ``/model_info`` unmoved, and there is no ``/get_weight_version``: only SGLangEngine's one-token generation
    tells the truth. The rollout_server's own ``/get_weight_version`` is the scheduler's version."""
    imitating = server_factory(tiny_model_dir, "--imitate-sglang", "--refuse-flush")
    own = server_factory(tiny_model_dir, "--refuse-flush")
    upd = make_weights(tiny_model_dir, tmp_path / "v5", 0.95, 5)

    async def main() -> tuple[str | None, str | None, int | None, str | None]:
        sg, rs_on_sg, rs = (SGLangEngine(imitating.url, timeout_s=60), RolloutServerEngine(imitating.url, timeout_s=60),
                            RolloutServerEngine(own.url, timeout_s=60))
        try:
            for engine in (sg, rs):
                with pytest.raises(SGLangError) as e:
                    await engine.update_weights_from_disk(upd.path, weight_version=5)
                assert e.value.status == 400 and "Weights were updated" in e.value.message
            with pytest.raises(SGLangError) as e:
                await rs_on_sg.served_weight_version(timeout_s=10)
            return (await sg.get_weight_version(), await sg.served_weight_version(timeout_s=30), e.value.status,
                    await rs.served_weight_version(timeout_s=10))
        finally:
            for engine in (sg, rs_on_sg, rs):
                await engine.close()

    model_info_version, sglang_served, missing_route, own_served = asyncio.run(main())
    assert model_info_version != "5" and sglang_served == "5"  # the tokenizer manager's stayed, the scheduler's moved
    assert missing_route == 404
    assert own_served == "5"
