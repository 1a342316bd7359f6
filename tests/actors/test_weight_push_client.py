"""actors.weight_push_client: the engine side of a distributed push as the HTTP calls it makes, against a
recording engine double on a real loopback socket that keeps SGLang 0.5.23's weight-update session (its
statuses and messages word for word): pause, begin, one post per bucket (the version and any cache flush
only with the last), end, continue; a stale session is ended and begun again; a refused begin leaves the
engine generating; a refused bucket ends the session and leaves the engine paused; a last bucket whose
only fault is a refused cache flush is loaded. PushMember: the real member over a worker's EngineLink to a
real rollout_server, the learner's side played by the test over real ZeroMQ sockets (a gloo group with a
WeightPusher as rank 0). (The learner's PushCoordinator with real members: tests/learner/
test_push_coordinator.py; the broadcast itself: test_weight_push.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from actors.weight_push_client import (
    PAUSE_MODES,
    NotReady,
    PushCancelled,
    PushMember,
    PushReport,
    join_group,
    receive_push,
)
from common import protocol
from common.modeling import load_model
from common.sglang_client import SGLangClient, SGLangError
from learner.weight_push import WeightPusher, bucket_plan
from tests.actors.http_fixtures import serving
from tests.actors.push_fixtures import (
    connected_link,
    distributed_updates,
    engine_digest,
    member_config,
    perturbed,
    served_digest,
)

BUCKETS = [{"names": [f"w{i}"], "dtypes": ["float32"], "shapes": [[2, i + 1]]} for i in range(3)]
# SGLang 0.5.23's answers (scheduler_components/weight_updater.py), as its server sends them.
ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
NOT_IN_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")

Calls = list[tuple[str, dict[str, Any]]]


def _engine(calls: Calls, refuse_bucket: str | None = None, session_open: bool = False,
            refuse_begin: str | None = None, refuse_flush: bool = False) -> web.Application:
    """Records each (endpoint, JSON body) and keeps one weight-update session as SGLang does; refuses the
    bucket that names ``refuse_bucket``, every begin with ``refuse_begin``, the flush of a bucket that asks
    for one with ``refuse_flush`` (installed all the same, as SGLang)."""
    state = {"session": session_open}

    def answer(ok: bool, message: str) -> web.Response:
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        endpoint = request.path.lstrip("/")
        calls.append((endpoint, body))
        if endpoint == "begin_weight_update":
            if refuse_begin is not None:
                return answer(False, refuse_begin)
            if state["session"]:
                return answer(False, ALREADY_OPEN)
            state["session"] = True
            return answer(True, "Success")
        if endpoint == "end_weight_update":
            if not state["session"]:
                return answer(False, NO_SESSION)
            state["session"] = False
            return answer(True, "Success")
        if endpoint == "update_weights_from_distributed":
            if not state["session"]:
                return answer(False, NOT_IN_SESSION)
            if refuse_bucket in body["names"]:
                return answer(False, "Failed to update weights: bucket refused")
            if refuse_flush and body["flush_cache"]:
                return answer(False, FLUSH_REFUSED)
        return answer(True, "ok")

    app = web.Application()
    for endpoint in ("pause_generation", "continue_generation", "update_weights_from_distributed",
                     "init_weights_update_group", "begin_weight_update", "end_weight_update"):
        app.router.add_post(f"/{endpoint}", handle)
    return app


def _push(pause: str, go: bool | None = None, **engine: Any) -> tuple[Calls, PushReport | Exception]:
    """One receive_push against the double; ``go``: a ready() hook answering it (recorded as a call)."""
    calls: Calls = []

    async def ready() -> bool:
        calls.append(("ready", {}))
        assert go is not None
        return go

    async def main() -> PushReport | Exception:
        async with serving(_engine(calls, **engine)) as url, SGLangClient(url, timeout_s=30) as client:
            try:
                return await receive_push(client, BUCKETS, 7, pause=pause, group_name="g1", timeout_s=30,
                                          ready=None if go is None else ready)
            except (SGLangError, PushCancelled) as e:
                return e

    return calls, asyncio.run(main())


def _endpoints(calls: Calls) -> list[str]:
    return [e for e, _ in calls]


def _buckets(calls: Calls) -> list[tuple[list[str], str | None, bool]]:
    """(names, weight_version, flush_cache) of each bucket post."""
    return [(b["names"], b.get("weight_version"), b["flush_cache"]) for e, b in calls
            if e == "update_weights_from_distributed"]


UPDATES = ["update_weights_from_distributed"] * 3


@pytest.mark.parametrize("pause, flush", [("in_place", False), ("retract", True), ("abort", True)])
def test_a_paused_push_posts_each_bucket_inside_a_session(pause: str, flush: bool) -> None:
    calls, report = _push(pause)
    assert isinstance(report, PushReport)
    assert _endpoints(calls) == ["pause_generation", "begin_weight_update", *UPDATES, "end_weight_update",
                                 "continue_generation"]
    assert calls[0][1] == {"mode": pause} and calls[1][1] == {} and calls[-2][1] == {}
    # in_place keeps running requests, whose cache SGLang will not flush: no flush is asked for.
    assert _buckets(calls) == [(["w0"], None, False), (["w1"], None, False), (["w2"], "7", flush)]
    for _, body in calls[2:5]:
        assert body["load_format"] == "flattened_bucket" and body["group_name"] == "g1"
    assert calls[2][1]["shapes"] == [[2, 1]] and calls[4][1]["dtypes"] == ["float32"]
    assert report.pause_s >= report.receive_s > 0


def test_without_a_pause_the_buckets_still_run_inside_a_session() -> None:
    calls, report = _push("none")
    assert isinstance(report, PushReport) and report.pause_s == 0.0 and report.receive_s > 0
    assert _endpoints(calls) == ["begin_weight_update", *UPDATES, "end_weight_update"]
    assert _buckets(calls) == [(["w0"], None, False), (["w1"], None, False), (["w2"], "7", True)]


def test_a_session_left_open_is_ended_and_begun_again_once() -> None:
    calls, report = _push("in_place", session_open=True)
    assert isinstance(report, PushReport)
    assert _endpoints(calls) == ["pause_generation", "begin_weight_update", "end_weight_update",
                                 "begin_weight_update", *UPDATES, "end_weight_update", "continue_generation"]


def test_a_refused_begin_is_not_ready_and_generation_continues() -> None:
    calls, err = _push("in_place", refuse_begin="no weight updates on this engine")
    assert isinstance(err, NotReady) and err.status == 400 and "no weight updates" in err.message
    # Nothing was received, the weights are untouched: generation goes on.
    assert _endpoints(calls) == ["pause_generation", "begin_weight_update", "continue_generation"]


def test_a_refused_bucket_ends_the_session_and_leaves_the_engine_paused() -> None:
    calls, err = _push("in_place", refuse_bucket="w1")
    assert isinstance(err, SGLangError) and not isinstance(err, NotReady) and "bucket refused" in err.message
    # No later bucket and no continue (the caller loads the version from disk before generation goes on);
    # the session is ended so that the next push's begin is not refused.
    assert _endpoints(calls) == ["pause_generation", "begin_weight_update", "update_weights_from_distributed",
                                 "update_weights_from_distributed", "end_weight_update"]


@pytest.mark.parametrize("pause", ["retract", "none"])
def test_a_last_bucket_whose_cache_flush_was_refused_is_loaded(pause: str) -> None:
    calls, report = _push(pause, refuse_flush=True)
    assert isinstance(report, PushReport), report
    assert _buckets(calls)[-1] == (["w2"], "7", True)
    assert _endpoints(calls)[-2 if pause != "none" else -1] == "end_weight_update"


def test_ready_is_asked_once_paused_in_a_session_and_no_go_receives_nothing() -> None:
    calls, report = _push("in_place", go=True)
    assert isinstance(report, PushReport)
    assert _endpoints(calls)[:3] == ["pause_generation", "begin_weight_update", "ready"]
    calls, err = _push("in_place", go=False)
    assert isinstance(err, PushCancelled)
    assert _endpoints(calls) == ["pause_generation", "begin_weight_update", "ready", "end_weight_update",
                                 "continue_generation"]


def test_an_unknown_pause_mode_is_refused_before_any_call() -> None:
    calls: Calls = []

    async def go() -> None:
        async with serving(_engine(calls)) as url, SGLangClient(url) as client:
            await receive_push(client, BUCKETS, 1, pause="drain")

    with pytest.raises(ValueError, match=r"pause 'drain': one of \('in_place', 'retract', 'abort', 'none'\)"):
        asyncio.run(go())
    assert calls == [] and PAUSE_MODES == ("in_place", "retract", "abort", "none")


def test_join_group_posts_the_learners_group_with_sglangs_defaults() -> None:
    calls: Calls = []

    async def go() -> str:
        async with serving(_engine(calls)) as url, SGLangClient(url) as client:
            body = {"master_address": "10.0.0.1", "master_port": 29555, "rank_offset": 3, "world_size": 5}
            return await join_group(client, body, timeout_s=30)

    assert asyncio.run(go()) == "ok"
    assert calls == [("init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29555,
                                                    "rank_offset": 3, "world_size": 5,
                                                    "group_name": "weight_update_group", "backend": "nccl"})]


# --------------------------------------------------------------------------- PushMember, real engine and sockets


async def _recv(router: zmq.asyncio.Socket, timeout_s: float = 60.0) -> tuple[bytes, protocol.AnyMessage]:
    ident, frame = await asyncio.wait_for(router.recv_multipart(), timeout_s)
    return ident, protocol.decode(frame)


async def _send(router: zmq.asyncio.Socket, ident: bytes, msg: protocol.Message) -> None:
    await router.send_multipart([ident, protocol.encode(msg)])


async def _session_open(c: SGLangClient) -> bool:
    """Whether the engine has a weight-update session open (a begin from outside is refused); leaves none
    of its own behind."""
    try:
        await c.begin_weight_update()
    except SGLangError as e:
        assert "already open" in e.message, e
        return True
    await c.end_weight_update()
    return False


async def _paused(c: SGLangClient) -> str | None:
    _, info, _ = await c._request("GET", "get_server_info", timeout_s=30)
    return info["paused"]


def test_a_member_is_paused_in_a_session_before_the_broadcast_and_receives_only_on_go(
        tiny_model_dir: Path, server_factory: Any, tmp_path: Path) -> None:
    """The learner's side is this test (a ROUTER and a WeightPusher as rank 0 of a gloo group); the member is
    the real PushMember over a worker's EngineLink to a real rollout_server."""
    srv = server_factory(tiny_model_dir)
    cfg = member_config(tiny_model_dir, [srv.url], "learner.push_timeout_s=30")
    model = perturbed(tiny_model_dir, 1e-3)

    async def main() -> None:
        link = await connected_link(cfg, 0)
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind("tcp://127.0.0.1:0")
        member = PushMember(link, router.getsockopt(zmq.LAST_ENDPOINT).decode(), "in_place", ctx=ctx)
        task = asyncio.ensure_future(member.run())
        pusher = WeightPusher(1 << 20, "gloo", timeout_s=30)
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        c = link.client
        assert c is not None
        try:
            ident, join = await _recv(router)
            assert isinstance(join, protocol.PushJoin) and join.actor_id == 0
            body = pusher.open_group(1)[0]
            joined = asyncio.ensure_future(asyncio.to_thread(pusher.join))
            await _send(router, ident, protocol.PushGroup(epoch=1, buckets=[m.body() for m in pusher.plan], **body))
            await joined
            _, done = await _recv(router)
            assert isinstance(done, protocol.PushDone) and (done.version, done.ok) == (-1, True)
            # v1: the member answers ready only once paused with its session open, probes held off.
            await _send(router, ident, protocol.PushVersion(epoch=1, version=1))
            _, ready = await _recv(router)
            assert isinstance(ready, protocol.PushReady) and (ready.version, ready.ok) == (1, True), ready
            assert await _paused(c) == "in_place" and await _session_open(c) and link.pushing_now
            assert link.version == 0
            await _send(router, ident, protocol.PushGo(epoch=1, version=1, go=True))
            res = await asyncio.to_thread(pusher.push, model, 1)
            await asyncio.to_thread(pusher.settle)
            _, done = await _recv(router)
            assert isinstance(done, protocol.PushDone) and (done.version, done.ok) == (1, True), done
            assert res.broadcast and link.version == 1
            assert await engine_digest(c) == (served_digest(model, tmp_path / "disk", 1), "1")
            assert await _paused(c) is None and not await _session_open(c) and not link.pushing_now
            # v2 without go: nothing is received, the session is ended, generation goes on, and the member
            # announces itself again (the learner rebuilds the group, and may have left it out).
            await _send(router, ident, protocol.PushVersion(epoch=1, version=2))
            _, ready = await _recv(router)
            assert isinstance(ready, protocol.PushReady) and ready.ok
            await _send(router, ident, protocol.PushGo(epoch=1, version=2, go=False))
            _, again = await _recv(router)
            assert isinstance(again, protocol.PushJoin) and again.engine_start > join.engine_start, again
            assert await _paused(c) is None and not await _session_open(c) and link.version == 1
            assert await distributed_updates(c) == len(pusher.plan)  # v1's buckets only
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # the member closes its socket on the way out: the context can then end
            pusher.close()
            router.close(linger=0)
            ctx.term()
            await link.close()

    asyncio.run(main())


def test_a_member_announces_itself_again_whenever_its_link_counts_an_engine_start(
        tiny_model_dir: Path, server_factory: Any) -> None:
    """A remote SGLang engine that went unreachable and came back keeps its client object: the link counts
    the start (``engine_starts``), and that alone must bring a new PushJoin; a version offered on the group
    the engine joined before is then refused (it is in no group any more)."""
    srv = server_factory(tiny_model_dir)
    cfg = member_config(tiny_model_dir, [srv.url], "learner.push_timeout_s=30")

    async def main() -> None:
        link = await connected_link(cfg, 0)
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind("tcp://127.0.0.1:0")
        member = PushMember(link, router.getsockopt(zmq.LAST_ENDPOINT).decode(), "in_place", ctx=ctx)
        task = asyncio.ensure_future(member.run())
        pusher = WeightPusher(1 << 20, "gloo", timeout_s=30)
        pusher.plan = bucket_plan(load_model(tiny_model_dir), pusher.bucket_bytes)
        try:
            ident, first = await _recv(router)
            assert isinstance(first, protocol.PushJoin)
            body = pusher.open_group(1)[0]
            joined = asyncio.ensure_future(asyncio.to_thread(pusher.join))
            await _send(router, ident, protocol.PushGroup(epoch=1, buckets=[m.body() for m in pusher.plan], **body))
            await joined
            _, done = await _recv(router)
            assert isinstance(done, protocol.PushDone) and done.ok
            client = link.client
            link.supervisor.count_start()  # what the supervisor does when its remote engine comes back (or restarts)
            _, again = await _recv(router, 10)
            assert isinstance(again, protocol.PushJoin) and again.engine_start != first.engine_start
            assert link.client is client
            await _send(router, ident, protocol.PushVersion(epoch=1, version=1))
            _, ready = await _recv(router)
            assert isinstance(ready, protocol.PushReady) and not ready.ok
            assert "not in group 1" in ready.message or "restarted" in ready.message, ready
            assert link.client is not None and not await _session_open(link.client)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # the member closes its socket on the way out: the context can then end
            pusher.close()
            router.close(linger=0)
            ctx.term()
            await link.close()

    asyncio.run(main())
