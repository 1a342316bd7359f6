"""actors.weight_push_client: the engine side of a distributed push as the HTTP calls it makes, against a
recording engine double on a real loopback socket: pause, one post per bucket (the version and any cache
flush only with the last), continue; a refused bucket leaves the engine paused. (PushMember and the real
broadcast are covered with rollout_server processes in test_weight_push.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from actors.weight_push_client import PAUSE_MODES, PushReport, join_group, receive_push
from common.sglang_client import SGLangClient, SGLangError
from tests.actors.http_fixtures import serving

BUCKETS = [{"names": [f"w{i}"], "dtypes": ["float32"], "shapes": [[2, i + 1]]} for i in range(3)]


def _engine(calls: list[tuple[str, dict[str, Any]]], refuse_bucket: str | None = None) -> web.Application:
    """Records each (endpoint, JSON body); refuses the bucket that names ``refuse_bucket`` as SGLang does."""

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        endpoint = request.path.lstrip("/")
        calls.append((endpoint, body))
        if endpoint == "update_weights_from_distributed" and refuse_bucket in body["names"]:
            return web.json_response({"success": False, "message": "Failed to update weights: bucket refused"},
                                     status=400)
        return web.json_response({"success": True, "message": "ok"})

    app = web.Application()
    for endpoint in ("pause_generation", "continue_generation", "update_weights_from_distributed",
                     "init_weights_update_group"):
        app.router.add_post(f"/{endpoint}", handle)
    return app


def _push(pause: str, refuse_bucket: str | None = None) -> tuple[list[tuple[str, dict[str, Any]]], PushReport | Exception]:
    calls: list[tuple[str, dict[str, Any]]] = []

    async def go() -> PushReport | Exception:
        async with serving(_engine(calls, refuse_bucket)) as url, SGLangClient(url, timeout_s=30) as client:
            try:
                return await receive_push(client, BUCKETS, 7, pause=pause, group_name="g1", timeout_s=30)
            except SGLangError as e:
                return e

    return calls, asyncio.run(go())


def _buckets(calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[list[str], str | None, bool]]:
    """(names, weight_version, flush_cache) of each bucket post."""
    return [(b["names"], b.get("weight_version"), b["flush_cache"]) for e, b in calls
            if e == "update_weights_from_distributed"]


@pytest.mark.parametrize("pause, flush", [("in_place", False), ("retract", True), ("abort", True)])
def test_a_paused_push_posts_each_bucket_and_the_version_with_the_last(pause: str, flush: bool) -> None:
    calls, report = _push(pause)
    assert isinstance(report, PushReport)
    assert [e for e, _ in calls] == ["pause_generation", *["update_weights_from_distributed"] * 3,
                                     "continue_generation"]
    assert calls[0][1] == {"mode": pause}
    # in_place keeps running requests, whose cache SGLang will not flush: no flush is asked for.
    assert _buckets(calls) == [(["w0"], None, False), (["w1"], None, False), (["w2"], "7", flush)]
    for _, body in calls[1:4]:
        assert body["load_format"] == "flattened_bucket" and body["group_name"] == "g1"
    assert calls[1][1]["shapes"] == [[2, 1]] and calls[3][1]["dtypes"] == ["float32"]
    assert report.pause_s >= report.receive_s > 0


def test_without_a_pause_only_the_buckets_are_posted_and_the_last_flushes() -> None:
    calls, report = _push("none")
    assert isinstance(report, PushReport) and report.pause_s == 0.0 and report.receive_s > 0
    assert [e for e, _ in calls] == ["update_weights_from_distributed"] * 3
    assert _buckets(calls) == [(["w0"], None, False), (["w1"], None, False), (["w2"], "7", True)]


def test_a_refused_bucket_raises_and_leaves_the_engine_paused() -> None:
    calls, err = _push("in_place", refuse_bucket="w1")
    assert isinstance(err, SGLangError) and "bucket refused" in err.message
    # No later bucket, and no continue: the caller loads the version from disk before generation goes on.
    assert [e for e, _ in calls] == ["pause_generation", "update_weights_from_distributed",
                                     "update_weights_from_distributed"]


def test_an_unknown_pause_mode_is_refused_before_any_call() -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    async def go() -> None:
        async with serving(_engine(calls)) as url, SGLangClient(url) as client:
            await receive_push(client, BUCKETS, 1, pause="drain")

    with pytest.raises(ValueError, match=r"pause 'drain': one of \('in_place', 'retract', 'abort', 'none'\)"):
        asyncio.run(go())
    assert calls == [] and PAUSE_MODES == ("in_place", "retract", "abort", "none")


def test_join_group_posts_the_learners_group_with_sglangs_defaults() -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    async def go() -> str:
        async with serving(_engine(calls)) as url, SGLangClient(url) as client:
            body = {"master_address": "10.0.0.1", "master_port": 29555, "rank_offset": 3, "world_size": 5}
            return await join_group(client, body, timeout_s=30)

    assert asyncio.run(go()) == "ok"
    assert calls == [("init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29555,
                                                    "rank_offset": 3, "world_size": 5,
                                                    "group_name": "weight_update_group", "backend": "nccl"})]
