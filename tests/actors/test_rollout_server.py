"""actors.rollout_server as a real subprocess: SGLang API, logprob fidelity, batching, weight updates, errors."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from common.modeling import build_char_tokenizer, build_tiny_qwen2, load_model, save_hf
from learner.losses import token_logprobs
from tests.polling import wait_for

EOS = 2


def call(url: str, path: str, payload: Any = None, raw: bytes | None = None, method: str | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body) if body else None
    except json.JSONDecodeError:
        return status, body.decode()




def info(url: str) -> dict[str, Any]:
    return call(url, "/get_server_info")[1]


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 12, vocab: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def learner_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor([output]))[0]


@pytest.fixture(scope="module")
def server(server_factory, tiny_model_dir: Path):
    return server_factory(tiny_model_dir, "--max-batch-size", "64", "--weight-version", "0")


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    torch.set_num_threads(1)
    return load_model(tiny_model_dir).eval()


def test_logprobs_equal_learner_recomputation(server, model) -> None:
    ps = prompts(6, seed=1)
    for sp in ({"temperature": 1.0, "max_new_tokens": 40},
               {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 40}):
        status, outs = call(server.url, "/generate", {"input_ids": ps, "sampling_params": sp, "return_logprob": True})
        assert status == 200, outs
        assert len(outs) == len(ps)
        for p, o in zip(ps, outs, strict=True):
            meta = o["meta_info"]
            assert meta["prompt_tokens"] == len(p) and meta["completion_tokens"] == len(o["output_ids"])
            triples = meta["output_token_logprobs"]
            assert [t[1] for t in triples] == o["output_ids"] and all(t[2] is None for t in triples)
            ref = learner_logprobs(model, p, o["output_ids"])
            got = torch.tensor([t[0] for t in triples])
            assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()


def test_greedy_equals_hf_generate(server, model) -> None:
    ps = prompts(8, seed=2)
    status, outs = call(server.url, "/generate", {"input_ids": ps, "sampling_params": {"temperature": 0, "max_new_tokens": 24}})
    assert status == 200
    for p, o in zip(ps, outs, strict=True):
        assert o["output_ids"] == hf_greedy(model, p, 24)
        fr = o["meta_info"]["finish_reason"]
        if fr["type"] == "stop":
            assert fr["matched"] == EOS == o["output_ids"][-1]
        else:
            assert fr == {"type": "length", "length": 24}


def test_single_request_shape_stop_tokens_and_n_order(server, model) -> None:
    p = prompts(1, seed=3)[0]
    greedy = hf_greedy(model, p, 30)
    stop_tok = greedy[3]
    status, o = call(server.url, "/generate", {"input_ids": p, "rid": "abc",
                                               "sampling_params": {"temperature": 0, "max_new_tokens": 30,
                                                                   "stop_token_ids": [stop_tok]}})
    assert status == 200 and isinstance(o, dict)  # single prompt -> single dict, like SGLang
    assert o["meta_info"]["id"] == "abc" and "output_token_logprobs" not in o["meta_info"]
    assert o["output_ids"] == greedy[: greedy.index(stop_tok) + 1]
    assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert isinstance(o["text"], str)
    # ignore_eos runs to max_new_tokens
    status, o = call(server.url, "/generate", {"input_ids": p, "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}})
    assert len(o["output_ids"]) == 50 and o["meta_info"]["finish_reason"] == {"type": "length", "length": 50}
    # n > 1 with a batch: prompt-major order, as SGLang's tokenizer manager expands it
    ps = [[5, 6, 7], [8, 9, 10, 11, 12]]
    status, outs = call(server.url, "/generate", {"input_ids": ps, "sampling_params": {"n": 3, "max_new_tokens": 5},
                                                  "return_logprob": True})
    assert status == 200 and len(outs) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 3, 5, 5, 5]
    assert len({o["meta_info"]["id"] for o in outs}) == 6


def test_concurrent_clients_get_independent_results(server, model) -> None:
    ps = prompts(32, seed=4, lo=2, hi=16)
    refs = [hf_greedy(model, p, 20) for p in ps]
    sampled = prompts(32, seed=5)

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[dict, list[dict]]:
        # Each client mixes a greedy request with a sampled one so batches hold mixed parameters.
        body = {"input_ids": ps[i], "sampling_params": {"temperature": 0, "max_new_tokens": 20}, "return_logprob": True}
        body2 = {"input_ids": [sampled[i]], "sampling_params": {"temperature": 1.0, "top_p": 0.8, "max_new_tokens": 20, "n": 2}}
        async with session.post(server.url + "/generate", json=body) as r1, \
                session.post(server.url + "/generate", json=body2) as r2:
            assert r1.status == 200 and r2.status == 200
            return await r1.json(), await r2.json()

    async def main() -> list:
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s, i) for i in range(32)))

    results = asyncio.run(main())
    for i, (g, samp) in enumerate(results):
        assert g["output_ids"] == refs[i], i
        assert g["meta_info"]["prompt_tokens"] == len(ps[i])
        assert len(samp) == 2 and all(s["meta_info"]["prompt_tokens"] == len(sampled[i]) for s in samp)
        ref_lp = learner_logprobs(model, ps[i], g["output_ids"])
        assert torch.allclose(torch.tensor([t[0] for t in g["meta_info"]["output_token_logprobs"]]), ref_lp, atol=1e-4)


def test_bad_requests_get_4xx_and_server_keeps_serving(server) -> None:
    url = server.url
    st, body = call(url, "/generate", raw=b'{"input_ids": [1, 2,')
    assert st == 400 and body["object"] == "error" and body["code"] == 400
    st, body = call(url, "/generate", raw=b"[1, 2, 3]")
    assert st == 400 and "JSON object" in body["message"]
    cases = [
        ({"input_ids": [5, 6], "sampling_params": {"top_p": 1.5}}, "top_p must be in (0, 1], got 1.5."),
        ({"input_ids": [5, 6], "sampling_params": {"temperature": -1}}, "temperature must be a non-negative finite number"),
        ({"input_ids": [5, 6], "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or at least 1"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens must be at least 0"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 10_000}}, "maximum context length"),
        ({"input_ids": [5, 99999]}, "greater than the vocab size"),
        ({"input_ids": list(range(3, 60)) * 5}, "longer than the model's context length"),
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": [5, 6], "sampling_params": {"bogus": 1}}, "unknown sampling param 'bogus'"),
        ({"input_ids": [5, 6], "sampling_params": {"repetition_penalty": 1.3}}, "not supported"),
        ({"input_ids": [5, 6], "stream": True}, "stream"),
        ({"input_ids": [[5, 6], [7]], "sampling_params": [{"n": 2}, {"n": 3}]}, "parallel_sample_num"),
    ]
    for payload, msg in cases:
        st, body = call(url, "/generate", payload)
        assert st == 400, (payload, body)
        assert msg in body["error"]["message"], (msg, body)
    st, body = call(url, "/generate", {"input_ids": [5, "x"]})
    assert st == 400 and body["object"] == "error"
    st, body = call(url, "/pause_generation", {"mode": "sideways"})
    assert st == 400 and "Invalid mode" in body["message"]
    st, body = call(url, "/update_weights_from_disk", {"weight_version": "3"})
    assert st == 400 and "model_path" in body["message"]
    assert call(url, "/health")[0] == 200
    st, o = call(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert st == 200 and len(o["output_ids"]) == 3
    st, metrics = call(url, "/metrics")
    assert st == 200 and "vapo_engine_bad_requests_total" in metrics and "vapo_engine_generated_tokens_total" in metrics


def test_weight_update_switches_and_bad_paths_keep_old_weights(server, model, tiny_model_dir: Path, tmp_path: Path) -> None:
    url = server.url
    tok = build_char_tokenizer()
    new_model = build_tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64, max_position_embeddings=256, seed=7).eval()
    new_dir = save_hf(new_model, tok, tmp_path / "v5")
    ps = prompts(4, seed=6)

    def served_by(m: torch.nn.Module) -> bool:
        """Do the server's logprobs equal ``m``'s recomputation of the served tokens?"""
        st, outs = call(url, "/generate", {"input_ids": ps, "sampling_params": {"max_new_tokens": 16},
                                           "return_logprob": True})
        assert st == 200
        return all(torch.allclose(torch.tensor([t[0] for t in o["meta_info"]["output_token_logprobs"]]),
                                  learner_logprobs(m, p, o["output_ids"]), atol=1e-4)
                   for p, o in zip(ps, outs, strict=True))

    assert served_by(model) and not served_by(new_model)
    st, body = call(url, "/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "5"})
    assert st == 200 and body["success"] is True and body["message"].endswith("Weight version updated to 5.")
    assert served_by(new_model) and not served_by(model)
    st, outs = call(url, "/generate", {"input_ids": ps, "sampling_params": {"max_new_tokens": 4}})
    assert all(o["meta_info"]["weight_version"] == "5" for o in outs)
    assert all(o["meta_info"]["output_weight_version_spans"] == [["5", len(o["output_ids"])]] for o in outs)
    assert call(url, "/get_model_info")[1]["weight_version"] == "5"

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes((new_dir / "model.safetensors").read_bytes()[:300])
    wrong = save_hf(build_tiny_qwen2(len(tok), hidden_size=48, num_layers=1, num_heads=2, num_kv_heads=1,
                                     intermediate_size=64, seed=1), tok, tmp_path / "wrong_shape")
    for bad in (tmp_path / "missing", corrupt, wrong):
        st, body = call(url, "/update_weights_from_disk", {"model_path": str(bad), "weight_version": "6"})
        assert st == 400 and body["success"] is False and body["message"], body
    assert served_by(new_model)  # still the v5 weights
    assert call(url, "/get_model_info")[1]["weight_version"] == "5"
    st, metrics = call(url, "/metrics")
    assert 'vapo_engine_weight_updates_total{status="failed"} 3.0' in metrics
    # and back to the original weights
    st, body = call(url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "0"})
    assert st == 200 and served_by(model)


def _long_request(url: str) -> dict[str, Any]:
    return {"input_ids": [[5, 6, 7, 8]], "sampling_params": {"n": 48, "max_new_tokens": 240, "ignore_eos": True},
            "return_logprob": True}


async def _post(url: str, path: str, payload: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=payload) as r:
        return r.status, await r.json(content_type=None)


def test_update_waits_for_running_requests_then_applies(server, tiny_model_dir: Path) -> None:
    url = server.url

    async def main() -> tuple:
        gen = asyncio.create_task(_post(url, "/generate", _long_request(url)))
        await asyncio.to_thread(wait_for, lambda: info(url)["running_requests"] > 0, 30, "running requests")
        upd = asyncio.create_task(_post(url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "11"}))
        return await gen, await upd

    (st, outs), (ust, ubody) = asyncio.run(main())
    assert st == 200 and ust == 200 and ubody["success"]
    # SGLang semantics: in-flight requests finish on the old weights, the update applies afterwards.
    assert all(o["meta_info"]["output_weight_version_spans"] == [["0", 240]] for o in outs)
    assert all(len(o["output_ids"]) == 240 for o in outs)
    assert info(url)["weight_version"] == "11"
    call(url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "0"})


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_update_continue_mixes_versions(server, tiny_model_dir: Path, mode: str) -> None:
    url = server.url

    async def main() -> tuple:
        gen = asyncio.create_task(_post(url, "/generate", _long_request(url)))
        await asyncio.to_thread(wait_for, lambda: info(url)["running_requests"] > 0, 30, "running requests")
        assert (await _post(url, "/pause_generation", {"mode": mode}))[0] == 200
        i = info(url)
        assert i["paused"] == mode
        steps = i["steps"]
        ust, ubody = await _post(url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "21"})
        assert info(url)["steps"] == steps and not gen.done()  # nothing generated while paused
        assert (await _post(url, "/continue_generation", {}))[0] == 200
        return await gen, ust, ubody

    (st, outs), ust, ubody = asyncio.run(main())
    assert ust == 200 and ubody["success"] and st == 200
    for o in outs:
        spans = o["meta_info"]["output_weight_version_spans"]
        assert len(o["output_ids"]) == 240 and sum(n for _, n in spans) == 240
        assert [v for v, _ in spans] == ["0", "21"] and all(n > 0 for _, n in spans)
        assert o["meta_info"]["total_retractions"] == (1 if mode == "retract" else 0)
    call(url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "0"})


def test_pause_abort_returns_requests_and_holds_new_ones(server) -> None:
    url = server.url

    async def main() -> tuple:
        gen = asyncio.create_task(_post(url, "/generate", _long_request(url)))
        await asyncio.to_thread(wait_for, lambda: info(url)["running_requests"] > 0, 30, "running requests")
        assert (await _post(url, "/pause_generation", {"mode": "abort"}))[0] == 200
        aborted = await gen
        held = asyncio.create_task(_post(url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}}))
        await asyncio.to_thread(wait_for, lambda: info(url)["waiting_requests"] == 1, 30, "held request")
        assert not held.done()
        flush_busy = call(url, "/flush_cache", method="POST")[0]
        assert (await _post(url, "/continue_generation", {}))[0] == 200
        return aborted, await held, flush_busy

    (st, outs), (hst, held), flush_busy = asyncio.run(main())
    assert st == 200 and all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert all(len(o["output_ids"]) < 240 for o in outs)
    assert all(len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"]) for o in outs)
    assert hst == 200 and held["meta_info"]["finish_reason"] is not None
    assert flush_busy == 400  # SGLang refuses to flush with requests waiting
    assert call(url, "/flush_cache", method="POST")[0] == 200
    assert call(url, "/health_generate")[0] == 200


def _abort_count(url: str) -> float:
    metrics = call(url, "/metrics")[1]
    line = next((ln for ln in metrics.splitlines() if ln.startswith('vapo_engine_requests_total{status="abort"}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_abort_request_by_rid_prefix_and_client_disconnect(server) -> None:
    url = server.url

    async def main() -> tuple:
        gen = asyncio.create_task(_post(url, "/generate", {**_long_request(url), "rid": "job7"}))
        await asyncio.to_thread(wait_for, lambda: info(url)["running_requests"] > 0, 30, "running requests")
        assert call(url, "/abort_request", {"rid": "job7"})[0] == 200
        aborted = await gen
        before = _abort_count(url)
        # Paused, the request cannot finish before the client gives up, however fast the machine.
        assert (await _post(url, "/pause_generation", {"mode": "in_place"}))[0] == 200
        timeout = aiohttp.ClientTimeout(total=0.5)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            with pytest.raises(TimeoutError):
                async with s.post(url + "/generate", json=_long_request(url)) as r:
                    await r.read()
        # The server notices the disconnect and aborts the request's 48 sequences.
        await asyncio.to_thread(wait_for, lambda: _abort_count(url) >= before + 48, 30, "disconnect abort")
        assert info(url)["waiting_requests"] == 0 and info(url)["running_requests"] == 0
        assert (await _post(url, "/continue_generation", {}))[0] == 200
        return aborted

    st, outs = asyncio.run(main())
    assert st == 200 and len(outs) == 48
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert all(o["meta_info"]["id"].startswith("job7") for o in outs)
