"""The distributed weight push into real SGLang 0.5.23 engines on the CPU (gloo; tests marked ``sglang``).

Two live engines per module, started as vapo starts them for a run with ``learner.weight_transport=distributed``
(so with the radix cache rule that mode needs). The learner side is vapo's own: a 2-rank ZeRO-3 learner under
torchrun (``WeightPusher``), or this process as rank 0; the engine side is ``actors.weight_push_client``
(weight-update session, then the buckets) or the real ``PushMember`` over a worker's ``EngineLink``.
"Bitwise" is read through the engine itself: SGLang has no digest route (``/get_weights_by_name`` answers 400
for Qwen2), but on one CPU thread it is deterministic, so an engine serves exactly the weights of a disk copy
when its greedy log-probs are equal, to the bit, to those it gives after loading that copy from disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

from actors.weight_push_client import PushMember, join_group, receive_push
from common import protocol
from common.sglang_client import GenerateOutput, SGLangClient
from learner.weight_push import WeightPusher, bucket_plan
from learner.weights import write_version
from ops.sglang_cpu.live import LiveSGLang
from tests.actors.actor_harness import REPO, metric
from tests.actors.push_fixtures import connected_link, load_from_disk, member_config, perturbed, until
from tests.learner.synth import child_env
from tests.ports import free_port

pytestmark = pytest.mark.sglang

BASE = REPO / "ops" / "bases" / "addition-tiny"
KEY = "live-push-admin-key"
PUSH_RUN = ("learner.weight_transport=distributed", "actors.push_pause=in_place")
PROBE = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LiveSGLang]]:
    logs = tmp_path_factory.mktemp("sglang_push_logs")
    started: list[LiveSGLang] = []
    try:
        for i in range(2):
            started.append(LiveSGLang.start(BASE, logs, admin_key=KEY, name=f"engine{i}", overrides=PUSH_RUN))
        yield started
    finally:
        for s in started:
            s.stop()


def client(e: LiveSGLang) -> SGLangClient:
    return SGLangClient(e.url, api_key=KEY, timeout_s=120, control_timeout_s=60)


async def greedy(c: SGLangClient, prompt: list[int] = PROBE, n_tokens: int = 24) -> GenerateOutput:
    return (await c.generate(prompt, {"temperature": 0, "max_new_tokens": n_tokens, "ignore_eos": True}))[0]


async def served_and_reloaded(c: SGLangClient, path: str, version: int) -> tuple[GenerateOutput, GenerateOutput]:
    """The engine's greedy answer now, then after loading ``path`` from disk as the same version."""
    now = await greedy(c)
    await load_from_disk(c, path, version)
    return now, await greedy(c)


ZERO3_TO_TWO_ENGINES = '''
import asyncio, json, sys, threading
from pathlib import Path
import torch
from common.config import load_config
from learner.dist import exit_process, rank
from learner.models import build_policy
from learner.weight_push import WeightPusher, bucket_plan
from learner.weights import write_version
from common.sglang_client import SGLangClient
from actors.weight_push_client import join_group, receive_push

model, out, key, urls = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
cfg = load_config(None, [f"model.path={model}", "learner.zero_stage=3", "metrics.prometheus=false"])
policy = build_policy(cfg)
with torch.no_grad():  # a version no engine serves yet: every partition moves
    for p in policy.module.parameters():
        p.ds_tensor.add_(1e-3)
pusher = WeightPusher(64 << 10, "gloo", timeout_s=120)  # several buckets for the 0.6M-parameter base
pusher.plan = bucket_plan(policy, pusher.bucket_bytes)
engines = None
if rank() == 0:
    bodies = pusher.open_group(len(urls))
    plan = [b.body() for b in pusher.plan]

    async def engine_side():
        cs = [SGLangClient(u, api_key=key, timeout_s=180) for u in urls]
        await asyncio.gather(*(join_group(c, b, timeout_s=180) for c, b in zip(cs, bodies)))
        await asyncio.gather(*(receive_push(c, plan, 1, group_name=bodies[0]["group_name"], timeout_s=180)
                               for c in cs))
        for c in cs:
            await c.close()

    engines = threading.Thread(target=asyncio.run, args=(engine_side(),))
    engines.start()
    pusher.join()
res = pusher.push(policy, 1)
pusher.settle()
if rank() == 0:
    engines.join(180)
update = write_version(out, 1, policy, None)
if rank() == 0:
    (out / "result.json").write_text(json.dumps({"broadcast": res.broadcast, "error": res.error,
                                                "buckets": len(pusher.plan), "path": update.path}))
pusher.close()
exit_process(0)  # no interpreter finalisation: a gloo worker thread can abort it (SIGABRT at exit)
'''


# slow: the SGLang rehearsal in CI (two live engines, distributed push, bitwise digests) covers the same path,
# and the two-rank ZeRO-3 gather is tested against rollout_server engines in test_weight_push.py.
@pytest.mark.slow
def test_two_rank_zero3_push_into_two_live_engines_is_bitwise_the_disk_export(
        engines: list[LiveSGLang], tmp_path: Path) -> None:
    """Both ranks gather every bucket, rank 0 broadcasts each into both engines inside their weight-update
    sessions (the real server refuses a receive outside one), and each engine then serves, to the bit, what the
    collective disk export of the same weights holds, as version 1."""
    harness = tmp_path / "zero3_push.py"
    harness.write_text(ZERO3_TO_TWO_ENGINES)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(harness), str(BASE), str(out), KEY, *(e.url for e in engines)]
    p = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1", VAPO_DS_SHM="0", PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    r = json.loads((out / "result.json").read_text())
    assert r["broadcast"] and r["buckets"] > 2, r

    async def main() -> list[tuple[GenerateOutput, GenerateOutput, str | None]]:
        got = []
        for e in engines:
            async with client(e) as c:
                version = await c.get_weight_version()
                pushed, reloaded = await served_and_reloaded(c, r["path"], 1)
                got.append((pushed, reloaded, version))
            async with client(e) as c:
                await load_from_disk(c, str(BASE), 0)  # as the next test expects
        return got

    got = asyncio.run(main())
    for pushed, reloaded, version in got:
        assert version == "1" and pushed.weight_version == "1"
        assert pushed.output_ids == reloaded.output_ids
        assert pushed.output_logprobs == reloaded.output_logprobs  # bit for bit
    assert got[0][0].output_logprobs == got[1][0].output_logprobs  # both engines got the same bytes


async def _push_in_place(pusher: WeightPusher, model: torch.nn.Module, version: int, c: SGLangClient,
                         body: dict[str, Any]) -> None:
    plan = [b.body() for b in pusher.plan or []]
    learner = asyncio.ensure_future(asyncio.to_thread(pusher.push, model, version))
    await receive_push(c, plan, version, pause="in_place", group_name=body["group_name"], timeout_s=120)
    res = await learner
    await asyncio.to_thread(pusher.settle)
    assert res is not None and res.broadcast, res


def test_after_an_in_place_push_a_cached_prefix_is_served_with_the_new_weights(
        engines: list[LiveSGLang], tmp_path: Path) -> None:
    """A prompt answered before the push (its prefix cached, were the radix cache on) and asked again after an
    in-place push with a request running through it: the answer is the fresh engine's (engine 1, loaded the
    same weights from disk while idle, which flushes), not one computed on old weights' KV."""
    a, b = engines
    model = perturbed(BASE, 2e-3)
    disk = write_version(tmp_path / "w", 2, model, None)

    async def main() -> tuple[GenerateOutput, GenerateOutput, GenerateOutput]:
        async with client(a) as ca, client(b) as cb:
            before = await greedy(ca)  # caches PROBE's prefix on a radix-cache engine
            pusher = WeightPusher(64 << 10, "gloo", timeout_s=120)
            pusher.plan = bucket_plan(model, pusher.bucket_bytes)
            body = pusher.open_group(1)[0]
            joined = asyncio.ensure_future(asyncio.to_thread(pusher.join))
            await join_group(ca, body, timeout_s=120)
            await joined
            running = asyncio.ensure_future(greedy(ca, [9, 8, 7], 200))  # runs through the push, paused in place
            await until(lambda: _running(a) >= 1, 60, "the long request to run")
            await _push_in_place(pusher, model, 2, ca, body)
            spanning = await running
            assert [v for v, _ in spanning.version_spans or []] == [0, 2], spanning.version_spans
            after = await greedy(ca)
            await load_from_disk(cb, disk.path, 2)
            fresh = await greedy(cb)
            await asyncio.to_thread(pusher.close)
            for c in (ca, cb):
                await load_from_disk(c, str(BASE), 0)
            return before, after, fresh

    before, after, fresh = asyncio.run(main())
    assert after.output_logprobs == fresh.output_logprobs  # bit for bit: no KV of the old weights reused
    assert after.output_logprobs != before.output_logprobs  # the push did change what is served


def _running(e: LiveSGLang) -> float:
    _, text = e.request("GET", "/metrics", key=None)
    return metric(str(text), "sglang:num_running_reqs") or 0.0


async def _recv(router: zmq.asyncio.Socket, timeout_s: float = 120.0) -> tuple[bytes, protocol.Message]:
    ident, frame = await asyncio.wait_for(router.recv_multipart(), timeout_s)
    return ident, protocol.decode(frame)


async def _group(router: zmq.asyncio.Socket, ident: bytes, pusher: WeightPusher, epoch: int) -> None:
    """Rank 0's side of a group of one member (the learner's ``PushCoordinator`` does this)."""
    body = pusher.open_group(1)[0]
    joined = asyncio.ensure_future(asyncio.to_thread(pusher.join))
    await router.send_multipart([ident, protocol.encode(protocol.PushGroup(
        epoch=epoch, buckets=[m.body() for m in pusher.plan or []], **body))])
    await joined
    _, done = await _recv(router)
    assert isinstance(done, protocol.PushDone) and (done.version, done.ok) == (-1, True), done


def test_a_killed_and_restarted_engine_joins_again_and_takes_the_next_push(
        engines: list[LiveSGLang], tmp_path: Path) -> None:
    """The real PushMember over a worker's EngineLink to a live engine (``engine.kind=external``, as a worker
    holds an SGLang engine it did not start). The engine is SIGKILLed after it joined a group and started again
    on its port: the link's probes see it gone and back (one more engine start), the member announces itself
    again, joins the new group, and the next version reaches the new engine by the push."""
    b = engines[1]
    key_file = tmp_path / "admin.key"
    key_file.write_text(KEY)
    cfg = member_config(BASE, [b.url], "learner.push_timeout_s=60", f"engine.admin_api_key_file={key_file}",
                        "engine.health_interval_s=0.5", "engine.health_failures=1", "engine.health_timeout_s=5",
                        "engine.startup_timeout_s=300")
    model = perturbed(BASE, 3e-3)
    port = int(b.url.rsplit(":", 1)[1])

    async def main() -> tuple[str | None, int, int]:
        link = await connected_link(cfg, 0)
        tasks = [asyncio.ensure_future(link.supervise()), asyncio.ensure_future(link.watch_health())]
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind("tcp://127.0.0.1:0")
        member = PushMember(link, router.getsockopt(zmq.LAST_ENDPOINT).decode(), "in_place", ctx=ctx)
        tasks.append(asyncio.ensure_future(member.run()))
        pusher = WeightPusher(64 << 10, "gloo", timeout_s=60)
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        try:
            ident, first = await _recv(router)
            assert isinstance(first, protocol.PushJoin)
            await _group(router, ident, pusher, 1)
            starts = link.engine_starts
            await asyncio.to_thread(b.kill)
            engines[1] = await asyncio.to_thread(LiveSGLang.start, BASE, b.log_path.parent, admin_key=KEY,
                                                 name="engine1-restarted", overrides=PUSH_RUN, port=port)
            ident, again = await _recv(router, 400)  # probes fail, the engine answers again, the member re-announces
            assert isinstance(again, protocol.PushJoin) and again.engine_start > first.engine_start, again
            await _group(router, ident, pusher, 2)
            await router.send_multipart([ident, protocol.encode(protocol.PushVersion(epoch=2, version=1))])
            _, ready = await _recv(router)
            assert isinstance(ready, protocol.PushReady) and ready.ok, ready
            await router.send_multipart([ident, protocol.encode(protocol.PushGo(epoch=2, version=1, go=True))])
            res = await asyncio.to_thread(pusher.push, model, 1)
            await asyncio.to_thread(pusher.settle)
            _, done = await _recv(router)
            assert res is not None and res.broadcast, res
            assert isinstance(done, protocol.PushDone) and (done.version, done.ok) == (1, True), done
            assert link.client is not None
            served = await link.client.get_weight_version()
            await link.client.update_weights_from_disk(str(BASE), weight_version=0)
            return served, starts, link.engine_starts
        finally:
            for t in tasks:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await asyncio.to_thread(pusher.close)
            router.close(linger=0)
            ctx.term()
            await link.close()

    served, starts_before, starts_after = asyncio.run(main())
    assert served == "1" and starts_after > starts_before


def test_an_engine_hung_then_killed_mid_push_fails_the_push_boundedly_and_the_survivor_loads_the_disk_copy(
        engines: list[LiveSGLang], tmp_path: Path) -> None:
    """Rank 0 (this process) pushes a version into both engines; engine 1 freezes (SIGSTOP) once its
    weight-update session is open, before its buckets, and is SIGKILLed after. The push ends within its
    timeout with ``broadcast`` false, the learner goes on, and engine 0 (left paused, its weights possibly a
    mix) loads the durable copy from disk."""
    a, b = engines
    model = perturbed(BASE, 4e-3)
    disk = write_version(tmp_path / "w", 3, model, None)
    timeout_s = 10.0
    began = 'POST /begin_weight_update HTTP/1.1" 200'

    async def main() -> tuple[Any, float, str | None, BaseException | None]:
        ca, cb = client(a), client(b)
        pusher = WeightPusher(4 << 10, "gloo", timeout_s=timeout_s)
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        plan = [m.body() for m in pusher.plan]
        bodies = pusher.open_group(2)
        joined = asyncio.ensure_future(asyncio.to_thread(pusher.join))
        await asyncio.gather(join_group(ca, bodies[0], timeout_s=120), join_group(cb, bodies[1], timeout_s=120))
        await joined
        sessions_before = b.log_tail(1_000_000).count(began)
        receivers = [asyncio.ensure_future(receive_push(c, plan, 3, group_name=bodies[0]["group_name"],
                                                        timeout_s=120)) for c in (ca, cb)]
        await until(lambda: b.log_tail(1_000_000).count(began) > sessions_before, 60, "engine 1's session to open")
        os.killpg(b.proc.pid, signal.SIGSTOP)  # hung, as a wedged host: no answer, no closed connection
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        res = await asyncio.to_thread(pusher.push, model, 3)
        await asyncio.to_thread(pusher.settle)
        learner_s = loop.time() - t0
        await asyncio.to_thread(b.kill)
        errors = await asyncio.gather(*receivers, return_exceptions=True)
        survivor_error = errors[0] if isinstance(errors[0], BaseException) else None
        await load_from_disk(ca, disk.path, 3)  # paused: applies at once
        await ca.continue_generation()
        served = await ca.served_weight_version()
        await load_from_disk(ca, str(BASE), 0)
        await asyncio.to_thread(pusher.close)
        await ca.close()
        await cb.close()
        return res, learner_s, served, survivor_error

    res, learner_s, served, survivor_error = asyncio.run(main())
    assert res is not None and not res.broadcast and res.error, res
    assert learner_s < 3 * timeout_s  # bounded: the learner goes on
    assert survivor_error is not None  # its receive failed with the group: it must not count the version as pushed
    assert served == "3"  # engine 1 stays dead: this is the module's last test
