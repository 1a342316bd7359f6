"""What vapo relies on from the real SGLang 0.5.23 server, checked live on the CPU (tests marked ``sglang``).

One server per module, started as vapo starts a CPU engine (``common.sglang_args``) with an admin key, on the
shipped ``ops/bases/addition-tiny`` base in float32. Each test talks to it through vapo's own client
(``common.sglang_client``): /generate fields and log-probs, n-sampling, log-probs equal to the learner's own
recomputation (``SGLANG_RETURN_ORIGINAL_LOGPROB``: before temperature), /update_weights_from_disk, the
per-token ``weight_versions`` spans of a request that spans an update, each pause mode, control endpoints
that refuse a missing admin key, and its temporary files kept in the TMPDIR vapo gives it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.engine import Engine, RolloutServerEngine, SGLangEngine
from common.sglang_client import GenerateOutput, SGLangClient, SGLangError
from learner.losses import token_logprobs
from ops.sglang_cpu.contract import FIXTURE, conversation, violations
from ops.sglang_cpu.live import LiveSGLang
from tests.actors.actor_harness import REPO, make_weights, metric
from tests.actors.push_fixtures import load_from_disk

pytestmark = pytest.mark.sglang

BASE = REPO / "ops" / "bases" / "addition-tiny"
ADMIN_KEY = "live-test-admin-key"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
LOGPROB_TOL = 2e-3  # float32 on both sides; different kernels (SGLang's torch-native attention vs HF's)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSGLang]:
    s = LiveSGLang.start(BASE, tmp_path_factory.mktemp("sglang_logs"), admin_key=ADMIN_KEY)
    yield s
    s.stop()
    assert not s.tmp_dir.exists()  # its temporary files went with it


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def client(server: LiveSGLang, key: str | None = ADMIN_KEY) -> SGLangClient:
    return SGLangClient(server.url, timeout_s=120, control_timeout_s=60, api_key=key)


def recompute(model_dir: Path, prompt: list[int], out: GenerateOutput) -> torch.Tensor:
    """The learner's log π(output tokens | prompt) at temperature 1 (``learner.losses.token_logprobs``)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out.output_ids])
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt) - 1:-1]
    return token_logprobs(logits, ids[:, len(prompt):])[0]


def served_version(server: LiveSGLang) -> str:
    return str(server.request("GET", "/model_info")[1]["weight_version"])


def running_requests(server: LiveSGLang) -> float:
    """SGLang's own gauge (``--enable-metrics``, which vapo always passes)."""
    _, text = server.request("GET", "/metrics", key=None)
    return metric(str(text), "sglang:num_running_reqs") or 0.0


def test_the_servers_temporary_files_are_in_a_directory_of_its_own(server: LiveSGLang) -> None:
    """SGLang honours the TMPDIR vapo gives it (``common.sglang_args.private_tmp_env``): its ZeroMQ ipc sockets,
    which it never removes, and its Prometheus multiprocess files are there, not in the system's TMPDIR."""
    entries = list(server.tmp_dir.iterdir())
    assert sum(e.is_socket() for e in entries) >= 3, entries  # tokenizer, scheduler, detokenizer
    assert any(e.is_dir() and any(e.glob("*.db")) for e in entries), entries  # --enable-metrics' counters


def test_generate_returns_n_samples_per_prompt_with_logprobs_and_version_spans(server: LiveSGLang) -> None:
    async def go() -> list[GenerateOutput]:
        async with client(server) as c:
            return await c.generate(PROMPTS, {"temperature": 1.0, "max_new_tokens": 6, "n": 3})

    outs = run(go())
    assert len(outs) == 6  # prompt-major: 3 samples of the first prompt, then 3 of the second
    assert [o.prompt_tokens for o in outs] == [4, 4, 4, 3, 3, 3]
    for o in outs:
        assert 1 <= len(o.output_ids) <= 6
        assert o.output_logprobs is not None and len(o.output_logprobs) == len(o.output_ids)
        assert all(lp <= 0.0 for lp in o.output_logprobs)
        assert o.finish_reason in ("length", "stop")
        assert o.completion_tokens == len(o.output_ids)
        assert o.weight_version == served_version(server)
        assert o.version_spans == [(int(o.weight_version), len(o.output_ids))]


def test_float32_logprobs_are_the_learners_recomputation_before_temperature(server: LiveSGLang) -> None:
    """vapo starts SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB=1: at temperature 0.7 the log-probs must still be
    log_softmax(logits), what the learner's ratio uses, not log_softmax(logits / 0.7)."""
    async def go() -> list[GenerateOutput]:
        async with client(server) as c:
            await load_from_disk(c, BASE, 0)  # the base, whatever earlier tests loaded
            return await c.generate(PROMPTS[0], {"temperature": 0.7, "max_new_tokens": 12, "ignore_eos": True})

    (out,) = run(go())
    ours = recompute(BASE, PROMPTS[0], out)
    theirs = torch.tensor(out.output_logprobs)
    assert torch.allclose(theirs, ours, atol=LOGPROB_TOL), (theirs - ours).abs().max()


def test_update_from_disk_moves_the_version_and_the_weights(server: LiveSGLang, tmp_path: Path) -> None:
    upd = make_weights(BASE, tmp_path / "v1", 0.9, 1)

    async def go() -> tuple[str, list[GenerateOutput]]:
        async with client(server) as c:
            await c.update_weights_from_disk(upd.path, weight_version=7)
            version = await c.get_weight_version()
            return str(version), await c.generate(PROMPTS[1], {"temperature": 0, "max_new_tokens": 10,
                                                               "ignore_eos": True})

    version, (out,) = run(go())
    assert version == "7" and out.weight_version == "7" and out.version_spans == [(7, 10)]
    new = recompute(Path(upd.path), PROMPTS[1], out)
    old = recompute(BASE, PROMPTS[1], out)
    theirs = torch.tensor(out.output_logprobs)
    assert torch.allclose(theirs, new, atol=LOGPROB_TOL), (theirs - new).abs().max()
    assert (theirs - old).abs().max() > 10 * LOGPROB_TOL  # the update did change what is served


async def _paused_while_running(server: LiveSGLang, c: SGLangClient, mode: str) -> asyncio.Future[Any]:
    """A long request started, then generation paused in ``mode`` while it runs; returns the request's future."""
    req = asyncio.ensure_future(c.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}))
    deadline = asyncio.get_running_loop().time() + 60
    while await asyncio.to_thread(running_requests, server) < 1:
        assert not req.done(), "the request finished before it could be paused; make it longer"
        assert asyncio.get_running_loop().time() < deadline, "the request never started running"
        await asyncio.sleep(0.02)
    await c.pause_generation(mode)
    return req


def test_request_spanning_an_in_place_update_reports_one_span_per_version(server: LiveSGLang, tmp_path: Path) -> None:
    upd = make_weights(BASE, tmp_path / "v2", 1.1, 2)

    async def go() -> tuple[GenerateOutput, str]:
        async with client(server) as c:
            await load_from_disk(c, BASE, 1)
            req = await _paused_while_running(server, c, "in_place")
            # paused in place, the request still holds its KV cache: the load completes, the cache flush after it
            # is refused, and SGLang answers 400 although the weights are live (vapo accepts that case)
            with pytest.raises(SGLangError) as e:
                await c.update_weights_from_disk(upd.path, weight_version=2)
            assert e.value.status == 400 and "Weights were updated" in e.value.message
            await c.continue_generation()
            out = (await req)[0]
            return out, str(await c.served_weight_version())

    out, served = run(go())
    assert served == "2"
    spans = out.version_spans
    assert spans is not None and [v for v, _ in spans] == [1, 2], spans
    assert sum(n for _, n in spans) == len(out.output_ids) == 200
    assert out.weight_version_int == 1  # the oldest version among its tokens: what staleness must count


@pytest.mark.parametrize("mode", ["retract", "abort"])
def test_pause_modes_retract_recomputes_and_abort_ends_the_running_request(server: LiveSGLang, mode: str) -> None:
    async def go() -> GenerateOutput:
        async with client(server) as c:
            req = await _paused_while_running(server, c, mode)
            await c.continue_generation()
            return (await req)[0]

    out = run(go())
    if mode == "abort":
        assert out.finish_reason == "abort" and len(out.output_ids) < 200
    else:  # retracted: re-queued and recomputed after continue, then finished in full
        assert out.finish_reason == "length" and len(out.output_ids) == 200


@pytest.mark.parametrize("endpoint,body", [
    ("/pause_generation", {"mode": "abort"}), ("/continue_generation", {}), ("/flush_cache", None),
    ("/update_weights_from_disk", {"model_path": str(BASE)}), ("/begin_weight_update", {}),
    ("/end_weight_update", {}), ("/destroy_weights_update_group", {"group_name": "g"}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "group_name": "g", "backend": "gloo"}),
])
def test_control_endpoints_refuse_a_missing_or_wrong_admin_key(server: LiveSGLang, endpoint: str, body: Any) -> None:
    assert server.request("POST", endpoint, body, key=None)[0] == 401
    assert server.request("POST", endpoint, body, key="not-the-key")[0] == 401
    # generation and health need none: the actors' requests and Prometheus' scrape carry no key
    assert server.request("GET", "/health", key=None)[0] == 200
    assert server.request("POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}},
                          key=None)[0] == 200


def test_the_engine_interface_holds_for_the_real_server(server: LiveSGLang, tmp_path: Path) -> None:
    """``actors.engine.SGLangEngine`` is the engine the actors drive: what it relies on where SGLang and
    rollout_server differ. There is no ``/get_weight_version`` (the rollout_server implementation's route), so
    the served version comes from a generation; ``/health`` cannot run while paused, ``/model_info`` can."""
    upd = make_weights(BASE, tmp_path / "v9", 1.02, 9)

    async def go() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        engine = SGLangEngine(server.url, timeout_s=120, control_timeout_s=60, api_key=ADMIN_KEY)
        other = RolloutServerEngine(server.url, timeout_s=120, control_timeout_s=60, api_key=ADMIN_KEY)
        try:
            seen["is_engine"] = isinstance(engine, Engine)
            await engine.update_weights_from_disk(upd.path, weight_version=9)
            seen["versions"] = (await engine.get_weight_version(), await engine.served_weight_version())
            with pytest.raises(SGLangError) as e:
                await other.served_weight_version(timeout_s=10)
            seen["missing_route"] = e.value.status
            await engine.pause_generation("in_place")
            try:
                seen["paused"] = (await engine.probe(True, 10.0), await engine.health(3.0))
            finally:
                await engine.continue_generation()
            seen["running"] = (await engine.health(30.0), await engine.probe(False, 30.0))
        finally:
            await engine.close()
            await other.close()
        return seen

    seen = run(go())
    assert seen["is_engine"] and seen["versions"] == ("9", "9")
    assert seen["missing_route"] == 404
    assert seen["paused"] == (True, False)  # the update-time probe answers; SGLang's /health generation cannot
    assert seen["running"] == (True, True)


def test_the_captured_contract_still_holds_for_the_installed_server(server: LiveSGLang) -> None:
    """The fixture the imitation is held to (``ops/sglang_cpu/contract.py capture``) is still what this server
    answers: re-capture it when an SGLang upgrade breaks this. Last: the conversation moves the weights."""
    reference = json.loads(FIXTURE.read_text())
    records = conversation(server.url, ADMIN_KEY, BASE)
    assert violations(records, reference) == []
