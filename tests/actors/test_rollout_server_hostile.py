"""actors.rollout_server against hostile and broken input: no request kills it, none costs unbounded memory,
every malformed one is a 4xx naming what is wrong, its own I/O has deadlines, and it binds only loopback
unless told how the port is protected. Real subprocesses, real HTTP."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.actors.http_fixtures import call, message
from tests.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
LIMITS = ("--max-body-bytes", "1000000", "--max-queued-tokens", "3000", "--http-idle-timeout-s", "2",
          "--http-read-timeout-s", "2", "--max-n", "64", "--max-batch-size", "8")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def limited(server_factory, tiny_model_dir: Path):
    return server_factory(tiny_model_dir, "--weight-version", "0", *LIMITS)


GREEDY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}


def test_top_k_past_int64_beside_a_filtering_request_is_a_400_and_the_engine_lives(limited) -> None:
    """One request with top_k >= 2^63 batched with a top_p neighbour used to overflow the sampler's int64
    rank comparison, kill the engine thread and leave /health at 503 for good."""
    st, body = call(limited.url, "/generate", {"input_ids": [[5, 6], [7, 8]], "sampling_params": [
        {"top_k": 2**63, "max_new_tokens": 2}, {"top_p": 0.5, "max_new_tokens": 2}]})
    assert st == 400 and "top_k" in message(body), body
    for k in (2**30 + 1, 2**31, -2):
        st, body = call(limited.url, "/generate", {"input_ids": [5, 6], "sampling_params": {"top_k": k}})
        assert st == 400 and "top_k" in message(body), (k, body)
    # top_k at SGLang's largest value (2^30) is valid and samples like -1, next to a filtering neighbour
    st, outs = call(limited.url, "/generate", {"input_ids": [[5, 6], [7, 8]], "sampling_params": [
        {"top_k": 2**30, "max_new_tokens": 3, "ignore_eos": True}, {"top_p": 0.5, "max_new_tokens": 3, "ignore_eos": True}]})
    assert st == 200 and [len(o["output_ids"]) for o in outs] == [3, 3], outs
    assert call(limited.url, "/health")[0] == 200


def test_oversized_requests_are_refused_before_anything_is_allocated(limited) -> None:
    pid = limited.proc.pid
    before = rss_kib(pid)
    t0 = time.monotonic()
    st, body = call(limited.url, "/generate", {"input_ids": [5], "sampling_params": {"n": 10**9, "max_new_tokens": 1}})
    assert st == 400 and "n must be at most 64" in message(body), body
    # n within its cap, but prompts x n x (input + output) more than the server ever queues
    st, body = call(limited.url, "/generate", {"input_ids": [[5, 6]] * 60, "sampling_params": {"n": 64, "max_new_tokens": 1}})
    assert st == 400 and "--max-queued-tokens" in message(body), body
    st, body = call(limited.url, "/generate", raw=b'{"input_ids": [' + b"5, " * 600_000 + b"5]}")
    assert st == 413 and "--max-body-bytes" in message(body) and body["code"] == 413, body
    st, body = call(limited.url, "/generate", {"text": "x" * 900_000})
    assert st == 400 and "text" in message(body) and "context length" in message(body), body
    assert time.monotonic() - t0 < 10
    assert rss_kib(pid) - before < 50_000  # KiB: nothing of the size these requests asked for was built
    # queue full: while paused, one request holds 2000 of the 3000 queued tokens; the next one gets a 503
    assert call(limited.url, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        import threading

        held: dict[str, Any] = {}
        t = threading.Thread(target=lambda: held.update(r=call(limited.url, "/generate", {
            "input_ids": [[5, 6]] * 8, "sampling_params": {"max_new_tokens": 248, "ignore_eos": True}})))
        t.start()
        wait_for(lambda: call(limited.url, "/get_server_info")[1]["waiting_requests"] == 8, 20, "8 queued sequences")
        st, body = call(limited.url, "/generate", {"input_ids": [[5, 6]] * 8, "sampling_params": {"max_new_tokens": 248}})
        assert st == 503 and body["code"] == 503 and "busy" in message(body), body
    finally:
        assert call(limited.url, "/continue_generation", {})[0] == 200
    t.join(60)
    assert held["r"][0] == 200 and len(held["r"][1]) == 8


def test_malformed_requests_get_a_4xx_that_names_the_field(limited) -> None:
    big = "1" + "0" * 5000  # past Python's 4300-digit int conversion limit
    cases: list[tuple[bytes, dict[str, str], str]] = [
        (b'{"input_ids": [5, 6], "sampling_params": {"top_k": ' + big.encode() + b"}}", {}, "top_k"),
        (b'{"input_ids": [5, ' + big.encode() + b"]}", {}, "input_ids"),
        (b'{"input_ids": [5, 6], "sampling_params": {"temperature": ' + big[:400].encode() + b"}}", {}, "temperature"),
        (b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 99999999999999999999}}', {}, "max_new_tokens"),
        (b'{"input_ids": [5, 6], "sampling_params": {"n": 1e300}}', {}, "n"),
        (b'{"input_ids": [5, 6], "sampling_params": {"min_p": 1e999}}', {}, "min_p"),
        (b'{"input_ids": [5, 6], "sampling_params": {"stop_token_ids": [99999999999999999999]}}', {}, "stop_token_ids"),
        (b'{"input_ids": [5, 6], "return_logprob": 7}', {}, "return_logprob"),
        (b'{"input_ids": [5, 6], "return_text_in_logprobs": "yes"}', {}, "return_text_in_logprobs"),
        # /generate counts the arrays before parsing; the parser's own depth limit guards the other endpoints
        (b'{"input_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, "--max-prompts-per-request"),
        (b'{"model_path": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, "nested too deeply"),
        (b'{"text": "ab\\ud800c"}', {}, "text"),
        (b'{"input_ids": [5, 6], "rid": "r\\udfff"}', {}, "rid"),
        (b"not gzip at all", {"Content-Encoding": "gzip"}, "request body"),
        (gzip.compress(b'{"input_ids": [5, 6]')[:-6], {"Content-Encoding": "gzip"}, "JSON decode error"),  # no trailer
        (b'{"model_path": "/x\\ud800"}', {}, "model_path"),
    ]
    for raw, headers, field in cases:
        path = "/update_weights_from_disk" if b"model_path" in raw else "/generate"
        st, body = call(limited.url, path, raw=raw, headers=headers)
        assert 400 <= st < 500 and field in message(body), (raw[:80], st, body)
    st, o = call(limited.url, "/generate", raw=gzip.compress(json.dumps(GREEDY).encode()),
                 headers={"Content-Encoding": "gzip"})
    assert st == 200 and len(o["output_ids"]) == 12  # a good gzip body still works
    assert call(limited.url, "/health")[0] == 200


def test_a_weight_path_that_blocks_on_read_neither_freezes_nor_outlives_sigterm(server_factory, tiny_model_dir: Path,
                                                                                tmp_path: Path) -> None:
    srv = server_factory(tiny_model_dir, "--weight-version", "0", "--weight-load-timeout-s", "3")
    trap = tmp_path / "trap"
    trap.mkdir()
    (trap / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    os.mkfifo(trap / "model.safetensors")  # opening it for reading blocks until a writer appears: never
    t0 = time.monotonic()
    st, body = call(srv.url, "/update_weights_from_disk", {"model_path": str(trap), "weight_version": "9"}, timeout=20)
    assert st == 400 and "not a regular file" in body["message"] and not body["success"], body
    assert time.monotonic() - t0 < 5
    assert call(srv.url, "/health", timeout=5)[0] == 200
    assert call(srv.url, "/get_model_info")[1]["weight_version"] == "0"
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=20) == 0


def test_a_weight_read_past_its_deadline_is_refused_and_never_applied_later(server_factory, tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    import shutil

    srv = server_factory(tiny_model_dir, "--weight-version", "0", "--weight-load-timeout-s", "0")
    v1 = shutil.copytree(tiny_model_dir, tmp_path / "v1")
    st, body = call(srv.url, "/update_weights_from_disk", {"model_path": str(v1), "weight_version": "1"})
    assert st == 400 and "did not finish within 0.0 s" in body["message"], body
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # the abandoned read finishes meanwhile; it must not be installed
        st, o = call(srv.url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
        assert st == 200 and o["meta_info"]["weight_version"] == "0"
    assert call(srv.url, "/get_model_info")[1]["weight_version"] == "0"


def test_slow_clients_are_cut_off(limited) -> None:
    host, port = limited.url.removeprefix("http://").split(":")
    # slow-loris: headers that never end
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    try:
        while True:  # trickle one header byte per 0.3 s until the server hangs up
            s.sendall(b"X")
            s.settimeout(0.3)
            try:
                if s.recv(1024) == b"":
                    break
            except TimeoutError:
                pass
            assert time.monotonic() - t0 < 10, "slow-loris connection still open after 10 s"
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        s.close()
    # a body that never arrives: 408 after --http-read-timeout-s
    s = socket.create_connection((host, int(port)), timeout=10)
    try:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408") and b"http-read-timeout" in reply, reply
    finally:
        s.close()
    assert call(limited.url, "/health")[0] == 200


def test_an_engine_whose_thread_died_exits_nonzero(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Any exception in the engine thread (here a sampler fault injected by the test's wrapper) must end the
    process, so that whoever supervises it restarts it, instead of a live process answering 503 forever."""
    wrapper = ("import sys, common.generation.scheduler as E, actors.rollout_server.__main__ as R\n"
               "orig = E.sample\n"
               "def faulty(logits, params, *a):\n"
               "    if any(p.max_new_tokens == 77 for p in params):\n"
               "        raise RuntimeError('injected sampler fault')\n"
               "    return orig(logits, params, *a)\n"
               "E.sample = faulty\n"
               "R.main(sys.argv[1:])\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "faulty.log", "w")  # the child owns it
    p = subprocess.Popen([sys.executable, "-c", wrapper, "--model-path", str(tiny_model_dir), "--port", "0",
                          "--threads", "1", "--log-level", "warning"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=log, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        url = line.split("ready on ", 1)[1].split()[0]
        st, _ = call(url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 77}})
        assert st == 500
        assert p.wait(timeout=20) == 1
        assert "engine thread died" in (tmp_path / "faulty.log").read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_non_loopback_bind_needs_its_protection_stated(tiny_model_dir: Path) -> None:
    from common.config import ConfigError, load_config

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "actors.rollout_server", "--model-path", str(tiny_model_dir),
                        "--host", "0.0.0.0", "--port", "0"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "--bind-protection" in r.stderr and "engine.bind_protection" in r.stderr, r.stderr
    # What is true: /generate is open; the control API takes the admin key (here none is set, so it is open too).
    assert "generation API (/generate) has no authentication" in r.stderr, r.stderr
    assert "control API" in r.stderr and "no --admin-api-key" in r.stderr, r.stderr
    with pytest.raises(ConfigError, match="engine.host: '0.0.0.0' is not a loopback.*engine.bind_protection"):
        load_config(None, ["engine.host=0.0.0.0"])
    with pytest.raises(ConfigError, match="engine.bind_protection"):
        load_config(None, ["engine.host=10.0.0.5", "engine.bind_protection=trust_me"])
    assert load_config(None, ["engine.host=0.0.0.0", "engine.bind_protection=firewall"]).engine.host == "0.0.0.0"
    assert load_config(None, ["engine.host=::1"]).engine.bind_protection == ""
    # The IPv6 any address (a mapping to YAML) is an address like 0.0.0.0, not "{':': None}".
    with pytest.raises(ConfigError, match="engine.host: '::' is not a loopback.*engine.bind_protection"):
        load_config(None, ["engine.host=::"])
    assert load_config(None, ["engine.host=::", "engine.bind_protection=firewall"]).engine.host == "::"
    with pytest.raises(ConfigError, match="engine.host: an IPv6 address is written without brackets"):
        load_config(None, ["engine.host=[::]", "engine.bind_protection=firewall"])


def _hostile_requests(rng: random.Random, n: int) -> list[tuple[str, bytes, dict[str, str]]]:
    """``n`` malformed or adversarial requests, generated: wrong types, out-of-range and huge numbers, broken
    JSON, bad encodings, oversized counts, unknown fields, on every endpoint that takes a body."""
    weird: list[Any] = [None, True, -1, 0, 2**31, 2**63, -(2**63) - 1, 10**30, 1e308, -1e308, float("nan"), "x",
                        "\u0000", [], [[]], {}, {"a": 1}, [1.5], ["5"], "9" * 50, 3.7]
    fields = ["temperature", "top_p", "top_k", "min_p", "n", "max_new_tokens", "stop_token_ids", "ignore_eos",
              "frequency_penalty", "stop", "json_schema", "bogus"]
    out: list[tuple[str, bytes, dict[str, str]]] = []
    for i in range(n):
        kind = i % 10
        headers: dict[str, str] = {}
        if kind in (0, 1, 2):  # one sampling param with a hostile value, sometimes beside a filtering neighbour
            sp = {rng.choice(fields): rng.choice(weird), "max_new_tokens": 2}
            body: Any = {"input_ids": [[5, 6], [7, 8]], "sampling_params": [sp, {"top_p": 0.5, "max_new_tokens": 2}]} \
                if kind == 2 else {"input_ids": [5, 6], "sampling_params": sp}
            raw = json.dumps(body, allow_nan=True).encode()
        elif kind == 3:  # hostile top-level fields
            body = {"input_ids": rng.choice(weird + [[5, 6]]), rng.choice(["return_logprob", "rid", "text", "stream",
                    "logprob_start_len", "top_logprobs_num", "input_embeds", "return_text_in_logprobs"]): rng.choice(weird)}
            raw = json.dumps(body, allow_nan=True).encode()
        elif kind == 4:  # huge integer literals anywhere
            digits = rng.choice([20, 400, 4301, 20000])
            raw = rng.choice([b'{"input_ids": [5, %s]}', b'{"input_ids": [5], "sampling_params": {"n": %s}}',
                              b'{"input_ids": [5], "sampling_params": {"top_k": %s}}']) % (b"7" * digits)
        elif kind == 5:  # nesting, truncation, garbage
            depth = rng.choice([50, 2000, 200_000])
            raw = rng.choice([b'{"input_ids": ' + b"[" * depth + b"]" * depth + b"}", b'{"input_ids": [5, 6',
                              bytes(rng.getrandbits(8) for _ in range(64)), b"[]", b'"x"', b"null", b"{}"])
        elif kind == 6:  # text with lone surrogates, overlong text, bad UTF-8
            raw = rng.choice([b'{"text": "a\\ud800"}', b'{"text": ["ok", "\\udc00"]}', b'{"text": "\xff\xfe"}',
                              json.dumps({"text": "z" * 500_000}).encode()])
        elif kind == 7:  # broken compression
            headers = {"Content-Encoding": rng.choice(["gzip", "deflate", "br", "zstd", "x-bogus"])}
            raw = rng.choice([b"garbage", gzip.compress(b'{"input_ids": [5]}')[:-4], b""])
        elif kind == 8:  # allocation: counts and batch sizes past their caps
            raw = json.dumps({"input_ids": [[5, 6]] * rng.choice([1, 100, 5000]),
                              "sampling_params": {"n": rng.choice([65, 10**6, 10**9]), "max_new_tokens": 1}}).encode()
        else:  # control endpoints
            path = rng.choice(["/update_weights_from_disk", "/pause_generation", "/abort_request"])
            if path == "/update_weights_from_disk":
                body = rng.choice([{"model_path": rng.choice(weird)},
                                   {"model_path": "/nonexistent", "weight_version": rng.choice(weird)},
                                   {"model_path": "/proc/self", "load_format": rng.choice(weird)},
                                   {"model_path": "/tmp", "abort_all_requests": rng.choice(weird)}])
            elif path == "/pause_generation":  # never a valid mode: the test must not pause its engine
                body = {"mode": rng.choice([m for m in weird if m is not None])}
            else:
                body = {"rid": rng.choice(weird)}
            out.append((path, json.dumps(body, allow_nan=True).encode(), headers))
            continue
        out.append(("/generate", raw, headers))
    return out


def test_hostile_input_leaves_the_engine_serving_the_same_answers(limited, capsys) -> None:
    """A few hundred generated malformed requests: each gets a 4xx or a valid 200, /health stays 200, the
    greedy reference answer is unchanged afterwards, and RSS stays bounded."""
    st, ref = call(limited.url, "/generate", GREEDY)
    assert st == 200
    pid = limited.proc.pid
    rss_before = rss_kib(pid)
    statuses: Counter[int] = Counter()
    reqs = _hostile_requests(random.Random(16), 300)
    for i, (path, raw, headers) in enumerate(reqs):
        st, body = call(limited.url, path, raw=raw, headers=headers)
        statuses[st] += 1
        if st == 200:
            if path == "/generate":
                outs = body if isinstance(body, list) else [body]
                assert all(isinstance(o, dict) and isinstance(o["output_ids"], list) for o in outs), (raw[:100], body)
        else:
            assert 400 <= st < 500, (path, raw[:200], headers, st, body)
        if i % 50 == 0:
            assert call(limited.url, "/health", timeout=10)[0] == 200
    assert call(limited.url, "/continue_generation", {})[0] == 200  # a hostile pause may have held it
    assert call(limited.url, "/health")[0] == 200
    st, again = call(limited.url, "/generate", GREEDY)
    assert st == 200 and again["output_ids"] == ref["output_ids"]
    rss_after = rss_kib(pid)
    with capsys.disabled():
        print(f"\nhostile input: {len(reqs)} requests, statuses {dict(sorted(statuses.items()))}, "
              f"RSS {rss_before} KiB -> {rss_after} KiB")
    assert rss_after - rss_before < 150_000, (rss_before, rss_after)  # KiB
    assert sum(statuses.values()) == len(reqs) and statuses[500] == 0
