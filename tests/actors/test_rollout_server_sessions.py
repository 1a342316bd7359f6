"""actors.rollout_server's weight-update session and distributed updates, answered as SGLang 0.5.23 answers
them (statuses and messages word for word): ``/begin_weight_update`` and ``/end_weight_update``; an update
outside a session refused without posting its receive; a name the model does not have accepted with a log
line; with ``--imitate-sglang``, a refused cache flush after an installed update answered 400 with the new
weights and the scheduler's version live. Real subprocesses, a real gloo group with this process as the
learner's rank 0."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from actors.rollout_server.dist_update import param_digest
from actors.weight_push_client import join_group, receive_push
from common.generation.weights import read_state_dict
from common.modeling import load_model
from common.sglang_client import SGLangClient, SGLangError
from common.weight_bucket import flatten
from learner.weight_push import WeightPusher, bucket_plan
from learner.weights import write_version
from tests.actors.http_fixtures import call

KEY = "test-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
NOT_IN_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")


def _perturbed(model_dir: Path, delta: float) -> torch.nn.Module:
    model = load_model(model_dir).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)
    return model


def _want(model: torch.nn.Module, root: Path, version: int) -> str:
    """The served-parameter digest of ``model`` once loaded (through its disk export, as the engine reads it)."""
    update = write_version(root, version, model, None)
    return param_digest(read_state_dict(update.path).items())


async def _digest(c: SGLangClient) -> tuple[str, str]:
    _, body, _ = await c._request("GET", "weights_digest", timeout_s=60)
    return body["sha256"], body["weight_version"]


async def _open_group(pusher: WeightPusher, c: SGLangClient) -> None:
    body = pusher.open_group(1)[0]
    joined = asyncio.ensure_future(asyncio.to_thread(pusher.join))
    await join_group(c, body, timeout_s=60)
    await joined


def test_sessions_and_updates_answer_as_sglang(tiny_model_dir: Path, server_factory: Any, tmp_path: Path) -> None:
    srv = server_factory(tiny_model_dir, "--admin-api-key", KEY)
    url = srv.url
    assert call(url, "/begin_weight_update", {}) == (401, {"error": "Unauthorized"})
    assert call(url, "/end_weight_update", {}) == (401, {"error": "Unauthorized"})
    assert call(url, "/begin_weight_update", {}, headers=AUTH) == (200, {"success": True, "message": "Success"})
    assert call(url, "/begin_weight_update", {}, headers=AUTH) == (400, {"success": False, "message": ALREADY_OPEN})
    generated = call(url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert generated[0] == 200  # generation goes on inside a session
    assert call(url, "/end_weight_update", {}, headers=AUTH) == (200, {"success": True, "message": "Success"})
    assert call(url, "/end_weight_update", {}, headers=AUTH) == (400, {"success": False, "message": NO_SESSION})
    assert call(url, "/begin_weight_update", {"selector": "all"}, headers=AUTH)[0] == 200
    assert call(url, "/end_weight_update", {}, headers=AUTH)[0] == 200
    assert call(url, "/begin_weight_update", {"selector": "lm_head"}, headers=AUTH)[0] == 400
    model = _perturbed(tiny_model_dir, 1e-3)

    async def main() -> None:
        c = SGLangClient(url, api_key=KEY, timeout_s=60)
        pusher = WeightPusher(1 << 20, "gloo", timeout_s=30)
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        plan = [m.body() for m in pusher.plan]
        try:
            await _open_group(pusher, c)
            # Outside a session: refused at once, and no receive is posted (it would wait for a broadcast).
            t0 = time.monotonic()
            try:
                await c.update_weights_from_distributed(**plan[0], group_name=pusher.current_name, timeout_s=20)
                raise AssertionError("an update outside a session was accepted")
            except SGLangError as e:
                assert (e.status, e.message) == (400, NOT_IN_SESSION)
            assert time.monotonic() - t0 < 10
            # The group was left as it was: a push inside a session lands byte for byte.
            lt = asyncio.ensure_future(asyncio.to_thread(pusher.push, model, 1))
            await receive_push(c, plan, 1, pause="in_place", group_name=pusher.current_name, timeout_s=60)
            assert (await lt).broadcast
            pusher.settle()
            assert await _digest(c) == (_want(model, tmp_path / "disk", 1), "1")
            # A name the model does not have: received, skipped with a log line, the rest installed, the
            # version moved (as SGLang; the sender is the one to check its names).
            norm = next(n for n, _ in model.named_parameters() if n.endswith("norm.weight"))
            before = await _digest(c)
            extra = torch.full((3,), 2.0)
            new_norm = dict(model.named_parameters())[norm].detach() + 1.0
            sent = asyncio.ensure_future(asyncio.to_thread(pusher.group.broadcast, flatten([new_norm, extra])))
            await c.begin_weight_update()
            msg = await c.update_weights_from_distributed(
                [norm, "no.such.weight"], ["float32", "float32"], [list(new_norm.shape), [3]], weight_version=2,
                flush_cache=False, group_name=pusher.current_name, timeout_s=60)
            await c.end_weight_update()
            await sent
            assert msg.endswith("Weight version updated to 2.")
            after = await _digest(c)
            assert after[1] == "2" and after[0] != before[0]
        finally:
            pusher.close()
            await c.close()

    asyncio.run(main())
    assert "names the served model does not have, skipped: ['no.such.weight']" in srv.log()


def test_imitation_refuses_the_flush_after_an_installed_distributed_update(tiny_model_dir: Path, server_factory: Any,
                                                                          tmp_path: Path) -> None:
    """SGLang answers 400 when the cache flush after a distributed update is refused, with the weights and
    the scheduler's version installed and /model_info's version unmoved; the push counts it as loaded."""
    srv = server_factory(tiny_model_dir, "--admin-api-key", KEY, "--imitate-sglang", "--refuse-flush",
                         "--weight-version", "0")
    model = _perturbed(tiny_model_dir, 1e-3)

    async def main() -> None:
        c = SGLangClient(srv.url, api_key=KEY, timeout_s=60)
        pusher = WeightPusher(1 << 20, "gloo", timeout_s=30)
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        plan = [m.body() for m in pusher.plan]
        assert len(plan) == 1
        try:
            await _open_group(pusher, c)
            try:
                await c.update_weights_from_distributed(**plan[0], group_name=pusher.current_name, timeout_s=20)
                raise AssertionError("an update outside a session was accepted")
            except SGLangError as e:
                assert (e.status, e.message) == (400, NOT_IN_SESSION)
            lt = asyncio.ensure_future(asyncio.to_thread(pusher.push, model, 1))
            await c.begin_weight_update()
            try:
                await c.update_weights_from_distributed(**plan[0], weight_version=1, flush_cache=True,
                                                        group_name=pusher.current_name, timeout_s=60)
                raise AssertionError("the refused flush was not reported")
            except SGLangError as e:
                assert (e.status, e.message) == (400, FLUSH_REFUSED)
            await c.end_weight_update()
            assert (await lt).broadcast
            pusher.settle()
            assert await _digest(c) == (_want(model, tmp_path / "disk", 1), "1")  # installed, version moved
            assert (await c.model_info())["weight_version"] == "0"  # the tokenizer manager's did not
            # receive_push (retract flushes on the last bucket): the refused flush is a loaded version.
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            lt = asyncio.ensure_future(asyncio.to_thread(pusher.push, model, 2))
            rep = await receive_push(c, plan, 2, pause="retract", group_name=pusher.current_name, timeout_s=60)
            assert (await lt).broadcast and rep.pause_s > 0
            pusher.settle()
            assert await _digest(c) == (_want(model, tmp_path / "disk", 2), "2")
        finally:
            pusher.close()
            await c.close()

    asyncio.run(main())
