"""Distributed weight push against real rollout_server processes: the learner's ``WeightPusher`` (rank 0
of a gloo group, this process) and engines joined through ``/init_weights_update_group``, buckets through
``/update_weights_from_distributed`` inside a ``/begin_weight_update`` session (with an admin API key, as
the workers run them)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.rollout_server.dist_update import param_digest
from actors.weight_push_client import join_group, receive_push
from common.checksum import weights_sha256
from common.generation.weights import read_state_dict
from common.modeling import load_model
from common.sglang_client import SGLangClient, SGLangError
from common.weight_bucket import BucketMeta, flatten
from learner.weight_push import DurableWriter, WeightPusher, bucket_finite, bucket_plan
from learner.weights import write_version

KEY = "test-admin-key"


def perturbed(model_dir: Path, delta: float) -> torch.nn.Module:
    model = load_model(model_dir).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)
    return model


async def digest(c: SGLangClient) -> tuple[str, str]:
    _, body, _ = await c._request("GET", "weights_digest", timeout_s=60)
    return body["sha256"], body["weight_version"]


async def open_group(pusher: WeightPusher, clients: list[SGLangClient]) -> None:
    bodies = pusher.open_group(len(clients))
    joined = asyncio.ensure_future(asyncio.to_thread(pusher.join))
    await asyncio.gather(*(join_group(c, b, timeout_s=60) for c, b in zip(clients, bodies, strict=True)))
    await joined


async def push(pusher: WeightPusher, model: torch.nn.Module, version: int, clients: list[SGLangClient],
               writer: DurableWriter, pause: str = "in_place") -> tuple[Any, list[Any]]:
    held: list[Any] = []
    settled: list[Any] = []

    def learner() -> Any:
        res = pusher.push(model, version, sink=lambda meta, buf: held.append((meta, buf)), on_settled=settled.append)
        writer.submit(version, held)
        return res

    t = asyncio.ensure_future(asyncio.to_thread(learner))
    plan = [b.body() for b in pusher.plan or []]
    reps = await asyncio.gather(*(receive_push(c, plan, version, pause=pause, group_name=pusher.current_name,
                                               timeout_s=60) for c in clients), return_exceptions=True)
    res = await t
    pusher.settle()  # the final bucket's broadcast may complete after push returned
    assert settled == [res]  # its outcome reported once, when final
    return res, reps


def test_distributed_push_is_bitwise_the_disk_version(tiny_model_dir: Path, server_factory: Any, tmp_path: Path) -> None:
    engines = [server_factory(tiny_model_dir, "--admin-api-key", KEY) for _ in range(2)]
    model = perturbed(tiny_model_dir, 1e-3)

    async def main() -> None:
        clients = [SGLangClient(e.url, api_key=KEY, timeout_s=60) for e in engines]
        try:
            before = [await digest(c) for c in clients]
            pusher = WeightPusher(4096, "gloo", timeout_s=30)  # several buckets even for the tiny model
            pusher.plan = bucket_plan(model, pusher.bucket_bytes)
            assert len(pusher.plan) > 2
            await open_group(pusher, clients)
            done: list[Any] = []
            writer = DurableWriter(tmp_path / "pushed", done.append, recycle=pusher.recycle)
            res, reps = await push(pusher, model, 1, clients, writer)
            assert res.broadcast, res.error
            assert not [r for r in reps if isinstance(r, BaseException)], reps
            assert writer.wait(60) and len(done) == 1
            write_version(tmp_path / "disk", 1, model, None)  # the disk transport, same weights
            want = param_digest(read_state_dict(tmp_path / "disk" / "v1").items())
            assert param_digest(read_state_dict(done[0].path).items()) == want
            after = [await digest(c) for c in clients]
            assert after == [(want, "1")] * 2
            assert before[0][0] != want  # the push changed what the engines serve
            # The durable copy's checksum was computed while writing: the actors' re-read agrees with it.
            assert weights_sha256(done[0].path) == done[0].sha256
            assert json.loads((Path(done[0].path) / "STABLE").read_text())["sha256"] == done[0].sha256
            # The next version is flattened into the buffers the writer gave back, and is still bitwise right.
            ptrs = {t.data_ptr() for t in pusher.pool._free.values()}
            assert len(ptrs) == len(pusher.plan)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            taken: list[Any] = []
            take = pusher.pool.take

            def spy(*a: Any, **k: Any) -> Any:
                taken.append(take(*a, **k))
                return taken[-1]

            pusher.pool.take = spy  # type: ignore[method-assign]
            res2, reps2 = await push(pusher, model, 2, clients, writer)
            assert res2.broadcast and not [r for r in reps2 if isinstance(r, BaseException)], reps2
            assert {t.data_ptr() for t in taken} == ptrs
            assert writer.wait(60) and len(done) == 2
            write_version(tmp_path / "disk", 2, model, None)
            want2 = param_digest(read_state_dict(tmp_path / "disk" / "v2").items())
            assert want2 != want and param_digest(read_state_dict(done[1].path).items()) == want2
            assert [await digest(c) for c in clients] == [(want2, "2")] * 2
            pusher.close()
        finally:
            for c in clients:
                await c.close()

    asyncio.run(main())


def test_engine_killed_mid_broadcast(tiny_model_dir: Path, server_factory: Any, tmp_path: Path) -> None:
    """One engine dies after its first bucket: the learner's push ends (bounded), the survivor and a
    restarted engine load that version from disk and both join the rebuilt group for the next push."""
    a, b = (server_factory(tiny_model_dir, "--admin-api-key", KEY) for _ in range(2))
    model = perturbed(tiny_model_dir, 1e-3)

    async def main() -> None:
        ca, cb = (SGLangClient(e.url, api_key=KEY, timeout_s=60) for e in (a, b))
        pusher = WeightPusher(4096, "gloo", timeout_s=20)
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        plan = [m.body() for m in pusher.plan]
        done: list[Any] = []
        writer = DurableWriter(tmp_path / "w", done.append)
        try:
            await open_group(pusher, [ca, cb])
            held: list[Any] = []

            def learner() -> Any:
                r = pusher.push(model, 1, sink=lambda meta, buf: held.append((meta, buf)))
                writer.submit(1, held)
                return r

            t0 = time.monotonic()
            lt = asyncio.ensure_future(asyncio.to_thread(learner))

            async def dying() -> None:
                await cb.begin_weight_update()
                await cb.update_weights_from_distributed(**plan[0], flush_cache=False, group_name=pusher.current_name,
                                                         timeout_s=60)
                b.proc.kill()  # mid-broadcast: the other buckets never reach it

            ra = asyncio.ensure_future(receive_push(ca, plan, 1, group_name=pusher.current_name, timeout_s=60))
            await dying()
            res = await lt
            pusher.settle()  # had the failure come on the final bucket, it would show once that completed
            assert not res.broadcast and res.error
            assert time.monotonic() - t0 < 20 + 10  # the learner went on within its bounded wait
            with pytest.raises(SGLangError):
                await ra  # the survivor's bucket failed with the group
            assert writer.wait(60) and done and done[0].version == 1
            v1 = param_digest(read_state_dict(done[0].path).items())
            # Recovery from disk: the survivor (still paused) loads it, a restarted engine starts from it.
            await ca.update_weights_from_disk(done[0].path, weight_version=1)
            await ca.continue_generation()
            b2 = server_factory(tiny_model_dir, "--admin-api-key", KEY)
            cb2 = SGLangClient(b2.url, api_key=KEY, timeout_s=60)
            await cb2.update_weights_from_disk(done[0].path, weight_version=1)
            assert [await digest(c) for c in (ca, cb2)] == [(v1, "1")] * 2
            # The group is rebuilt with the restarted engine; the next version is pushed to both.
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            await open_group(pusher, [ca, cb2])
            res2, reps = await push(pusher, model, 2, [ca, cb2], writer)
            assert res2.broadcast and not [r for r in reps if isinstance(r, BaseException)], reps
            assert writer.wait(60)
            v2 = param_digest(read_state_dict(done[-1].path).items())
            assert v2 != v1 and [await digest(c) for c in (ca, cb2)] == [(v2, "2")] * 2
            await cb2.close()
        finally:
            pusher.close()
            for c in (ca, cb):
                await c.close()

    asyncio.run(main())


def test_in_place_pause_under_load(tiny_model_dir: Path, server_factory: Any, tmp_path: Path) -> None:
    """Requests running during a push keep going (no abort, no drain) and report the versions of their
    tokens: a prefix on the old weights, the rest on the new."""
    e = server_factory(tiny_model_dir, "--admin-api-key", KEY)
    model = perturbed(tiny_model_dir, 1e-3)

    async def main() -> None:
        c = SGLangClient(e.url, api_key=KEY, timeout_s=120)
        pusher = WeightPusher(1 << 20, "gloo", timeout_s=30)
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        writer = DurableWriter(tmp_path / "w", lambda u: None)
        try:
            await open_group(pusher, [c])
            params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
            gen = asyncio.ensure_future(c._request("POST", "generate", {"input_ids": [[5, 6, 7]] * 4,
                                                                       "sampling_params": params}, 120))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # under load: requests are running when the push starts
                _, info, _ = await c._request("GET", "get_server_info", timeout_s=10)
                if info.get("running_requests", 0) >= 1:
                    break
            assert info.get("running_requests", 0) >= 1
            res, reps = await push(pusher, model, 1, [c], writer, pause="in_place")
            assert res.broadcast and not isinstance(reps[0], BaseException), reps
            _, outs, _ = await gen
            for o in outs:
                assert o["meta_info"]["finish_reason"]["type"] == "length"
                spans = o["meta_info"]["output_weight_version_spans"]
                assert sum(k for _, k in spans) == 200
                versions = [v for v, _ in spans]
                assert versions[-1] == "1"
            assert any([v for v, _ in o["meta_info"]["output_weight_version_spans"]] == ["default", "1"] for o in outs)
            assert writer.wait(60)
        finally:
            pusher.close()
            await c.close()

    asyncio.run(main())


def test_actor_verifies_a_learner_checked_version_by_sizes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A durable version of the push carries the learner's own check (sizes, finite): the actor verifies
    it by file sizes without reading it again; a short file fails, and a version without that record is
    still re-hashed whole."""
    from actors.weight_watcher import verify_tensors, verify_update
    from common.checksum import checkpoint_shapes
    from common.weight_bucket import flatten
    from learner.weight_push import write_buckets

    model = perturbed(tiny_model_dir, 1e-3)
    plan = bucket_plan(model, 4096)
    state = dict(model.state_dict())
    upd = write_buckets(tmp_path, 1, [(m, flatten([state[n] for n in m.names])) for m in plan])
    assert verify_update(upd) is None
    assert verify_tensors(upd.path, checkpoint_shapes(tiny_model_dir)) is None
    f = sorted(Path(upd.path).glob("*.safetensors"))[-1]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF  # same size: the size check passes, the full digest does not
    f.write_bytes(bytes(raw))
    assert verify_update(upd) is None
    stable = Path(upd.path) / "STABLE"
    info = json.loads(stable.read_text())
    stable.write_text(json.dumps({k: v for k, v in info.items() if k not in ("sizes", "finite")}))
    assert verify_update(upd)[0] == "checksum"  # no learner record: re-hashed, and the flipped byte is found
    stable.write_text(json.dumps(info))
    f.write_bytes(bytes(raw[:-8]))  # a partial copy
    assert verify_update(upd)[0] == "checksum"


ZERO3_HARNESS = '''
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

model, out, url, key = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
cfg = load_config(None, [f"model.path={{model}}", "learner.zero_stage=3", "metrics.prometheus=false"])
policy = build_policy(cfg)
with torch.no_grad():  # a version the engine does not serve yet: every partition moves
    for p in policy.module.parameters():
        p.ds_tensor.add_(1e-3)
pusher = WeightPusher(4096, "gloo", timeout_s=60)
pusher.plan = bucket_plan(policy, pusher.bucket_bytes)
engine = None
if rank() == 0:
    body = pusher.open_group(1)[0]
    plan = [b.body() for b in pusher.plan]

    async def engine_side():
        c = SGLangClient(url, api_key=key, timeout_s=120)
        await join_group(c, body, timeout_s=120)
        await receive_push(c, plan, 1, group_name=body["group_name"], timeout_s=120)
        await c.close()

    engine = threading.Thread(target=asyncio.run, args=(engine_side(),))
    engine.start()
    pusher.join()
res = pusher.push(policy, 1)
pusher.settle()  # res.broadcast is final only once the last bucket's broadcast has ended
if rank() == 0:
    engine.join(120)
update = write_version(out, 1, policy, None)
if rank() == 0:
    (out / "result.json").write_text(json.dumps({{"broadcast": res.broadcast, "error": res.error,
                                                 "buckets": len(pusher.plan), "path": update.path}}))
pusher.close()
exit_process(0)  # no interpreter finalisation: a gloo worker thread can abort it (SIGABRT at exit)
'''


def test_two_rank_zero3_push_equals_the_disk_export(tiny_model_dir: Path, server_factory: Any, tmp_path: Path) -> None:
    """Under 2-rank ZeRO-3 both ranks gather each bucket and rank 0 alone broadcasts: the engine then serves
    exactly what the (collective) disk export of the same weights holds."""
    import subprocess
    import sys

    from tests.learner.synth import child_env
    from tests.ports import free_port

    e = server_factory(tiny_model_dir, "--admin-api-key", KEY)
    harness = tmp_path / "zero3_push.py"
    repo = Path(__file__).resolve().parents[2]
    harness.write_text(ZERO3_HARNESS.format())
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(harness), str(tiny_model_dir), str(out), e.url, KEY]
    p = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1", VAPO_DS_SHM="0"), capture_output=True, text=True,
                       timeout=900, cwd=repo)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    r = json.loads((out / "result.json").read_text())
    assert r["broadcast"] and r["buckets"] > 2, r

    async def served() -> tuple[str, str]:
        c = SGLangClient(e.url, api_key=KEY, timeout_s=60)
        try:
            return await digest(c)
        finally:
            await c.close()

    assert asyncio.run(served()) == (param_digest(read_state_dict(r["path"]).items()), "1")


@pytest.mark.parametrize("imitate", [False, True])
def test_unpaused_bucket_waits_for_running_requests(tiny_model_dir: Path, server_factory: Any, tmp_path: Path,
                                                    imitate: bool) -> None:
    """Without a pause a bucket is applied only after the running requests end, which finish on the old
    weights. SGLang (and the imitation) also waits before it receives, holding up the sender's broadcast;
    rollout_server by default receives at once, so the learner is never held up by a drain."""
    e = server_factory(tiny_model_dir, "--admin-api-key", KEY, *(["--imitate-sglang"] if imitate else []))
    model = perturbed(tiny_model_dir, 1e-3)

    async def main() -> None:
        c = SGLangClient(e.url, api_key=KEY, timeout_s=120)
        pusher = WeightPusher(1 << 20, "gloo", timeout_s=60)
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        try:
            await open_group(pusher, [c])
            params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
            sent = time.time()
            gen = asyncio.ensure_future(c._request("POST", "generate", {"input_ids": [5, 6, 7], "sampling_params": params}, 120))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                _, info, _ = await c._request("GET", "get_server_info", timeout_s=10)
                if info.get("running_requests", 0) >= 1:
                    break
            times: dict[str, float] = {}

            def learner() -> Any:
                r = pusher.push(model, 1)
                pusher.settle()  # the final bucket's broadcast ends after push returns
                times["pushed_wall"] = time.time()
                return r

            lt = asyncio.ensure_future(asyncio.to_thread(learner))
            rep = await receive_push(c, [b.body() for b in pusher.plan], 1, pause="none",
                                     group_name=pusher.current_name, timeout_s=120)
            _, out, _ = await gen
            assert (await lt).broadcast and rep.pause_s == 0.0
            meta = out["meta_info"]
            versions = ([s["version"] for s in meta["weight_versions"]] if imitate
                        else [v for v, _ in meta["output_weight_version_spans"]])
            assert versions == ["default"]  # drained: every token on the old weights
            if imitate:  # the broadcast ended only after the request (created >= sent) had finished
                assert times["pushed_wall"] >= sent + meta["e2e_latency"]
            else:
                # received at once, applied after the drain: the broadcast ended while the request still ran
                assert times["pushed_wall"] < sent + meta["e2e_latency"]
            assert (await digest(c))[1] == "1"
        finally:
            pusher.close()
            await c.close()

    asyncio.run(main())


def test_non_finite_weights_are_never_pushed(tiny_model_dir: Path, server_factory: Any, tmp_path: Path) -> None:
    """A NaN in the policy refuses the version on the learner (before its bucket leaves the device): the
    engine's pending bucket fails at once instead of waiting out its group, and it keeps its weights."""
    e = server_factory(tiny_model_dir, "--admin-api-key", KEY)
    model = perturbed(tiny_model_dir, 1e-3)
    with torch.no_grad():
        list(model.parameters())[-1].view(-1)[0] = float("nan")

    async def main() -> None:
        c = SGLangClient(e.url, api_key=KEY, timeout_s=120)
        pusher = WeightPusher(4096, "gloo", timeout_s=60)
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        try:
            before = await digest(c)
            await open_group(pusher, [c])
            t0 = time.monotonic()
            lt = asyncio.ensure_future(asyncio.to_thread(pusher.push, model, 1))
            with pytest.raises(SGLangError):
                await receive_push(c, [b.body() for b in pusher.plan], 1, group_name=pusher.current_name, timeout_s=120)
            with pytest.raises(ValueError, match="NaN or Inf"):
                await lt
            assert time.monotonic() - t0 < 30  # not the group's timeout
            await c.continue_generation()
            assert (await digest(c))[1] == before[1]  # the version did not move
        finally:
            pusher.close()
            await c.close()

    asyncio.run(main())


def test_bucket_finite_checks_every_dtype_run_of_the_flat_bucket() -> None:
    """The finiteness check runs on the flattened bytes, one reduction per run of same-dtype tensors."""
    ts = [torch.ones(3), torch.ones(2), torch.ones(4, dtype=torch.float16), torch.ones(2)]
    meta = BucketMeta()
    for i, t in enumerate(ts):
        meta.add(f"w{i}", t.dtype, t.shape)
    assert bucket_finite(flatten(ts), meta)
    for i, bad in ((1, float("nan")), (2, float("inf")), (3, float("-inf"))):
        broken = [t.clone() for t in ts]
        broken[i][-1] = bad
        assert not bucket_finite(flatten(broken), meta), i


def test_a_restarted_learners_groups_never_reuse_a_name_an_engine_still_holds() -> None:
    """An SGLang engine keeps every group name it joined until told to destroy it, and outlives a learner that
    restarts (``--resume``): the new learner's first group must not be called what the old one's was."""
    names = []
    for _ in range(2):  # the learner before and after its restart
        pusher = WeightPusher(4096, "gloo", timeout_s=5)
        for _ in range(2):  # each of its groups
            names.append(pusher.open_group(1)[0]["group_name"])
        pusher.close()
    assert len(set(names)) == 4, names
    assert all(n.startswith("weight_update_group_") for n in names)
