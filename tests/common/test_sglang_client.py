"""common.sglang_client against SGLang's recorded shapes (replayed by an in-process fake) and a live rollout_server."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from common.modeling import load_model
from common.sglang_client import (
    NO_SESSION,
    NOT_IN_SESSION,
    SESSION_ALREADY_OPEN,
    SGLangClient,
    SGLangError,
    cache_flush_refused,
    error_message,
    session_already_open,
)
from learner.losses import token_logprobs
from tests.actors.servers import ServerProc, start_rollout_server

# Captured by ops/sglang_cpu/contract.py beside the actors' contract test, which holds rollout_server to it.
FIXTURE = json.loads((Path(__file__).parents[1] / "actors" / "fixtures" / "sglang_api.json").read_text())


# --------------------------------------------------------------------------- errors
# The answers' shapes are read in tests/common/test_sglang_output.py.


def test_error_message_reads_both_sglang_error_shapes() -> None:
    assert error_message(FIXTURE["error_value_error"]["body"]) == "top_p must be in (0, 1], got 1.5."
    assert "validation error" in error_message(FIXTURE["error_validation"]["body"])
    assert error_message(FIXTURE["unauthorized"]["body"]) == "Unauthorized"
    assert error_message(None, "Internal Server Error\n") == "Internal Server Error"


# --------------------------------------------------------------------------- fake SGLang (replays the fixture)


async def _fake_sglang(scenario: dict[str, Any]) -> tuple[web.AppRunner, str]:
    seen: list[tuple[str, Any]] = scenario.setdefault("seen", [])

    def replay(name: str):
        async def handler(request: web.Request) -> web.Response:
            raw = await request.read()
            seen.append((request.path, json.loads(raw) if raw else None))
            if scenario.get(name, name) == "down":  # no record: SGLang's /health while it cannot generate
                return web.Response(status=503)
            rec = FIXTURE[scenario.get(name, name)]
            if "body" in rec:
                return web.json_response(rec["body"], status=rec["status"])
            return web.Response(text=rec["text"], status=rec["status"])
        return handler

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.path, body))
        if scenario.get("generate") == "error":
            rec = FIXTURE["error_value_error"]
            return web.json_response(rec["body"], status=rec["status"])
        if scenario.get("generate") == "slow":
            await asyncio.sleep(5)
        return web.json_response(FIXTURE["generate_batched"]["body"][:2])

    app = web.Application()
    app.router.add_post("/generate", generate)
    for endpoint in ("update_weights_from_disk", "pause_generation", "continue_generation", "flush_cache",
                     "begin_weight_update", "end_weight_update", "update_weights_from_distributed"):
        app.router.add_post(f"/{endpoint}", replay(endpoint))
    app.router.add_get("/health", replay("health"))
    app.router.add_get("/model_info", replay("model_info"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_client_against_recorded_sglang_shapes() -> None:
    async def main() -> None:
        sc: dict[str, Any] = {"update_weights_from_disk": "update_weights_from_disk_ok", "flush_cache": "flush_cache_ok",
                              "health": "health_ok"}
        runner, url = await _fake_sglang(sc)
        try:
            async with SGLangClient(url, timeout_s=2) as c:
                outs = await c.generate([[5, 6, 7]], {"max_new_tokens": 4, "n": 2})
                assert [o.output_ids for o in outs] == [x["output_ids"] for x in FIXTURE["generate_batched"]["body"][:2]]
                assert sc["seen"][-1] == ("/generate", {"input_ids": [[5, 6, 7]], "sampling_params": {"max_new_tokens": 4, "n": 2},
                                                        "return_logprob": True})
                with pytest.raises(SGLangError, match="expected 3 outputs, got 2"):
                    await c.generate([[1], [2], [3]], {"max_new_tokens": 1})
                msg = await c.update_weights_from_disk("/ckpt/v8", weight_version=8)
                assert msg.endswith("Weight version updated to 8.")
                assert sc["seen"][-1][1] == {"model_path": "/ckpt/v8", "abort_all_requests": False, "weight_version": "8"}
                await c.pause_generation("in_place")
                assert sc["seen"][-1] == ("/pause_generation", {"mode": "in_place"})
                await c.continue_generation()
                assert await c.flush_cache() is True
                assert await c.health() is True
                assert await c.get_weight_version() == FIXTURE["model_info"]["body"]["weight_version"]
                sc.update({"update_weights_from_disk": "update_weights_from_disk_failed", "flush_cache": "flush_cache_refused",
                           "health": "down", "generate": "error"})
                with pytest.raises(SGLangError, match="Failed to get weights iterator") as ei:
                    await c.update_weights_from_disk("/ckpt/v9", weight_version="9")
                assert ei.value.status == 400 and not cache_flush_refused(ei.value)
                sc["update_weights_from_disk"] = "update_weights_from_disk_flush_refused"
                with pytest.raises(SGLangError) as ei:
                    await c.update_weights_from_disk("/ckpt/v10", weight_version="10")
                assert cache_flush_refused(ei.value)  # loaded, only the flush refused
                assert await c.flush_cache() is False
                assert await c.health() is False
                with pytest.raises(SGLangError, match=r"HTTP 400: top_p must be in \(0, 1\], got 1.5.") as ei:
                    await c.generate([5, 6], {"top_p": 1.5})
                sc["generate"] = "slow"
                with pytest.raises(SGLangError, match="timed out"):
                    await c.generate([5, 6], {}, timeout_s=0.2)
                with pytest.raises(SGLangError, match="not healthy"):
                    await c.wait_healthy(timeout_s=0.3, poll_s=0.05)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_client_reads_sglangs_recorded_weight_update_session() -> None:
    """The session calls against SGLang's own answers: begin, a second begin, end, an end without a
    session, a distributed update outside one (each refusal a 400 with SGLang's message)."""

    async def main() -> None:
        sc: dict[str, Any] = {"begin_weight_update": "begin_weight_update_ok", "end_weight_update": "end_weight_update_ok",
                              "update_weights_from_distributed": "update_weights_from_distributed_outside_session"}
        runner, url = await _fake_sglang(sc)
        try:
            async with SGLangClient(url, timeout_s=5) as c:
                assert await c.begin_weight_update() == "Success"
                assert sc["seen"][-1] == ("/begin_weight_update", {})
                assert await c.end_weight_update() == "Success"
                assert sc["seen"][-1] == ("/end_weight_update", {})
                sc.update({"begin_weight_update": "begin_weight_update_twice",
                           "end_weight_update": "end_weight_update_without_session"})
                with pytest.raises(SGLangError) as ei:
                    await c.begin_weight_update()
                assert ei.value.status == 400 and session_already_open(ei.value)
                assert ei.value.message.startswith(SESSION_ALREADY_OPEN)
                with pytest.raises(SGLangError) as ei:
                    await c.end_weight_update()
                assert ei.value.status == 400 and ei.value.message.startswith(NO_SESSION)
                assert not session_already_open(ei.value)
                with pytest.raises(SGLangError) as ei:
                    await c.update_weights_from_distributed(["w"], ["float32"], [[1]], group_name="g")
                assert ei.value.status == 400 and NOT_IN_SESSION in ei.value.message
                assert not cache_flush_refused(ei.value)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_unreachable_server_is_a_clear_error() -> None:
    async def main() -> None:
        async with SGLangClient("http://127.0.0.1:9", timeout_s=2) as c:
            with pytest.raises(SGLangError, match="cannot reach"):
                await c.get_model_info()
            assert await c.health(timeout_s=1) is False

    asyncio.run(main())


# --------------------------------------------------------------------------- live rollout_server


@pytest.fixture
def srv(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServerProc]:
    server = start_rollout_server(tiny_model_dir, tmp_path, "--max-batch-size", "32", "--weight-version", "3")
    yield server
    server.stop()


def test_client_against_live_rollout_server(srv: ServerProc, tiny_model_dir: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = load_model(tiny_model_dir).eval()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]

    async def main() -> None:
        async with SGLangClient(srv.url, timeout_s=60) as c:
            await c.wait_healthy(timeout_s=30)
            assert await c.health_generate()
            info = await c.get_model_info()
            assert info["is_generation"] and info["weight_version"] == "3"
            outs = await c.generate(prompts, {"temperature": 1.0, "max_new_tokens": 12, "n": 4})
            assert len(outs) == 8
            for k, o in enumerate(outs):
                p = prompts[k // 4]  # prompt-major
                assert o.prompt_tokens == len(p) and o.completion_tokens == len(o.output_ids) > 0
                assert o.finish_reason in ("stop", "length") and o.weight_version_int == 3
                with torch.no_grad():
                    logits = model(torch.tensor([p + o.output_ids])).logits[:, len(p) - 1 : -1]
                ref = token_logprobs(logits, torch.tensor([o.output_ids]))[0]
                assert o.output_logprobs is not None
                assert max(abs(a - b) for a, b in zip(o.output_logprobs, ref.tolist(), strict=True)) <= 1e-4
                assert all(math.isfinite(x) for x in o.output_logprobs)
            msg = await c.update_weights_from_disk(str(tiny_model_dir), weight_version=4)
            assert "Weight version updated to 4." in msg
            assert await c.get_weight_version() == "4"
            with pytest.raises(SGLangError, match="not a directory") as ei:
                await c.update_weights_from_disk(str(tmp_path / "nope"), weight_version=5)
            assert ei.value.status == 400 and await c.get_weight_version() == "4"
            with pytest.raises(SGLangError, match="top_k must be -1") as ei:
                await c.generate([5, 6], {"top_k": 0})
            assert ei.value.status == 400
            await c.pause_generation("abort")
            await c.continue_generation()
            assert await c.flush_cache() is True
            (o,) = await c.generate([5, 6, 7], {"max_new_tokens": 5, "ignore_eos": True})
            assert o.finish_reason == "length" and o.completion_tokens == 5 and o.min_weight_version == "4"
            await _session_round(c)

    asyncio.run(main())


async def _session_round(c: SGLangClient) -> None:
    """SGLang 0.5.23's weight-update session, word for word: begin, a second begin refused, end, an end
    without a session refused; a distributed update outside a session refused before anything else."""
    with pytest.raises(SGLangError) as ei:
        await c.update_weights_from_distributed(["w"], ["float32"], [[1]], group_name="none", timeout_s=10)
    assert (ei.value.status, ei.value.message) == (400, "update_weights_from_distributed must run between "
                                                        "begin_weight_update() and end_weight_update()")
    assert await c.begin_weight_update() == "Success"
    with pytest.raises(SGLangError) as ei:
        await c.begin_weight_update()
    assert (ei.value.status, ei.value.message) == (400, "a weight-update session is already open; call "
                                                        "end_weight_update() first")
    assert session_already_open(ei.value) and not cache_flush_refused(ei.value)
    (o,) = await c.generate([5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True})  # generation goes on inside
    assert o.completion_tokens == 3
    assert await c.end_weight_update() == "Success"
    with pytest.raises(SGLangError) as ei:
        await c.end_weight_update()
    assert (ei.value.status, ei.value.message) == (400, "no weight-update session is open; call "
                                                        "begin_weight_update() first")
    assert not session_already_open(ei.value)


def test_every_request_to_a_stopped_engine_ends_at_its_deadline(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A SIGSTOPped engine accepts connections (the kernel does) and never answers: each call fails at the
    client's deadline (control calls used to pass timeout=None to aiohttp, which waits for ever)."""
    srv = start_rollout_server(tiny_model_dir, tmp_path, "--weight-version", "0")

    async def main() -> list[float]:
        took = []
        async with SGLangClient(srv.url, timeout_s=1.0, control_timeout_s=0.5) as c:
            calls = [c.pause_generation("abort"), c.continue_generation(), c.flush_cache(),
                     c.abort_request(abort_all=True), c.model_info(), c.get_weight_version_route(),
                     c.begin_weight_update(), c.end_weight_update(),
                     c.update_weights_from_disk(str(tiny_model_dir), weight_version=1), c.generate([5, 6], {})]
            for call in calls:
                t = time.monotonic()
                with pytest.raises(SGLangError, match="timed out"):
                    await asyncio.wait_for(call, 10)
                took.append(time.monotonic() - t)
        return took

    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        took = asyncio.run(main())
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
        srv.stop()
    assert all(t < 3 for t in took), took


def test_idle_connections_are_dropped_before_sglangs_keepalive_closes_them() -> None:
    """SGLang's uvicorn closes an idle connection after 5 s (SGLANG_TIMEOUT_KEEP_ALIVE); a client that keeps it
    longer may send a request on a connection the server just closed ("Server disconnected")."""
    async def main() -> float:
        c = SGLangClient("http://127.0.0.1:9")
        try:
            return c._sess().connector._keepalive_timeout  # type: ignore[union-attr]
        finally:
            await c.close()

    assert asyncio.run(main()) < 5.0
