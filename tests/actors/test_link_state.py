"""actors.link_state: what the parts of an engine link share and nothing more — the engine's client (replaced
only through ``use_engine``, the previous one closed, carrying the deadlines and the admin key), the gate, the
control lock and the trouble flag."""

from __future__ import annotations

import asyncio

from actors.engine import RolloutServerEngine, SGLangEngine
from actors.link_state import LinkState
from common.config import load_config


def test_use_engine_picks_the_kinds_client_with_the_links_deadlines_and_key() -> None:
    cfg = load_config(None, ["engine.kind=rollout_server", "engine.health_timeout_s=7"])

    async def main() -> None:
        state = LinkState(cfg, "k3y", generate_timeout_s=90.0)
        assert state.client is None and state.url is None  # nothing before the first start
        client = await state.use_engine("http://127.0.0.1:1")
        assert state.client is client and type(client) is RolloutServerEngine and state.url == "http://127.0.0.1:1"
        assert isinstance(client, RolloutServerEngine)
        assert (client.timeout_s, client.control_timeout_s) == (90.0, 7.0)  # control calls get a probe's deadline
        assert client.headers == {"Authorization": "Bearer k3y"}
        await state.close()

    asyncio.run(main())


def test_a_new_engine_closes_the_previous_client() -> None:
    cfg = load_config(None, ["engine.kind=sglang"])

    async def main() -> None:
        state = LinkState(cfg, "", generate_timeout_s=30.0)
        first = await state.use_engine("http://127.0.0.1:1")
        assert isinstance(first, SGLangEngine) and first.headers == {}  # no key: no Authorization header
        session = first._sess()  # what its first request opens
        assert not session.closed
        second = await state.use_engine("http://127.0.0.1:2")
        assert session.closed and second is not first and state.url == "http://127.0.0.1:2"
        await state.close()
        await state.close()  # idempotent: the worker's shutdown may follow a failed start

    asyncio.run(main())


def test_trouble_is_reported_on_the_shared_flag_and_gate_and_lock_start_closed_and_free() -> None:
    state = LinkState(load_config(None, []), "", generate_timeout_s=1.0)
    assert not state.gate.is_set() and not state.control.locked() and not state.trouble.is_set()
    state.report_trouble()
    assert state.trouble.is_set()
