"""The client and the worker against rollout_server's SGLang-imitation mode (``--imitate-sglang``), which
behaves as the released SGLang 0.5.23 does where that matters: /health is a one-token generation that
blocks while generation is paused or weights load, a load whose cache flush is refused answers 400 with the
new weights live, /model_info replaces /get_model_info, /metrics needs --enable-metrics, outputs carry
``meta_info.weight_versions``. Real subprocesses, real HTTP, real buffer and sockets."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from common import protocol
from common.checksum import weights_sha256
from common.sglang_client import SGLangClient, SGLangError
from learner.publisher import WeightPublisher
from tests.actors.actor_harness import REPO, Stack, env, make_weights, metric, read_tagged, scrape
from tests.polling import wait_for
from tests.ports import free_port

HEALTH_TIMEOUT = "3"  # SGLANG_HEALTH_CHECK_TIMEOUT: SGLang's own 20 s would make the test slow


def start_imitation(model: Path, log: Path, *extra: str, port: int = 0) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "actors.rollout_server", "--model-path", str(model), "--port", str(port),
           "--skip-tokenizer-init", "--threads", "1", "--weight-version", "0", "--imitate-sglang",
           "--log-level", "warning", *extra]
    with open(log, "ab") as errf:
        p = subprocess.Popen(cmd, cwd=REPO, env={**env(), "SGLANG_HEALTH_CHECK_TIMEOUT": HEALTH_TIMEOUT},
                             stdout=subprocess.PIPE, stderr=errf, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert "ready on " in line, log.read_text()[-2000:]
    return p, line.split("ready on ", 1)[1].split()[0]


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_client_follows_sglang_health_update_and_model_info_behaviours(tiny_model_dir: Path, tmp_path: Path) -> None:
    p, url = start_imitation(tiny_model_dir, tmp_path / "engine.log")
    v1 = make_weights(tiny_model_dir, tmp_path / "v1", 0.9, 1)
    try:
        assert get(url + "/metrics")[0] == 404  # no --enable-metrics, as SGLang
        assert get(url + "/get_weight_version")[0] == 404  # not a route of SGLang 0.5.23

        async def scenario() -> dict[str, Any]:
            r: dict[str, Any] = {}
            async with SGLangClient(url) as c:
                t0 = time.monotonic()
                r["health"] = await c.health()
                r["health_s"] = time.monotonic() - t0
                r["version"] = await c.get_weight_version()
                # paused in place with a request queued: the /health probe cannot run, and a load's cache
                # flush is refused (requests queued), so SGLang answers 400 with the new weights live
                await c.pause_generation("in_place")
                queued = asyncio.ensure_future(c.generate([5, 6, 7], {"max_new_tokens": 20, "ignore_eos": True,
                                                                      "temperature": 0}))
                deadline = time.monotonic() + 20
                while json.loads((await asyncio.to_thread(get, url + "/get_server_info"))[1])["waiting_requests"] < 1:
                    assert time.monotonic() < deadline, "the request never queued"
                    await asyncio.sleep(0.05)
                t0 = time.monotonic()
                r["paused_health"] = await c.health(timeout_s=10)
                r["paused_health_s"] = time.monotonic() - t0
                try:
                    await c.update_weights_from_disk(v1.path, weight_version=1)
                    r["update"] = "ok"
                except SGLangError as e:
                    r["update"] = (e.status, e.message)
                r["model_info_version"] = await c.get_weight_version()
                await c.continue_generation()
                r["queued"] = await queued
                r["served"] = await c.served_weight_version()
                r["health_after"] = await c.health()
            return r

        r = asyncio.run(scenario())
    finally:
        p.terminate()
        p.wait(30)
    assert r["health"] and r["health_s"] >= 0.9  # a generation polled once a second, not a flag check
    assert r["version"] == "0"
    assert r["paused_health"] is False and r["paused_health_s"] >= float(HEALTH_TIMEOUT) - 0.5
    assert r["update"][0] == 400 and "Weights were updated" in r["update"][1]
    assert r["model_info_version"] == "0"  # the tokenizer manager's copy did not move...
    assert r["served"] == "1"  # ...but the scheduler generates with v1
    (out,) = r["queued"]
    assert out.weight_version == "1" and out.min_weight_version == "1" and len(out.output_ids) == 20
    assert r["health_after"]


def _without_one_tensor(base: Path, out: Path, version: int) -> protocol.WeightUpdate:
    from safetensors.torch import load_file, save_file

    make_weights(base, out, 1.0, version)
    f = out / "model.safetensors"
    sd = load_file(str(f))
    sd.pop(sorted(sd)[0])
    save_file(sd, str(f), metadata={"format": "pt"})
    return protocol.WeightUpdate(version=version, path=str(out), sha256=weights_sha256(out), created_at=time.time())


def test_worker_against_sglang_imitation(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The worker: accepts a version the engine serves after a 400 and flushes the cache the 400 left, refuses NaN and incomplete weight sets
    before the engine sees them, never calls a slow or paused /health an unreachable engine."""
    port, M = free_port(), 8
    engine, url = start_imitation(tiny_model_dir, tmp_path / "engine.log", "--enable-metrics", "--refuse-flush",
                                  port=port)
    s = Stack(tmp_path, tiny_model_dir, [
        "engine.kind=external", f"engine.urls=[{url}]", "actors.group_size=2", "actors.max_new_tokens=8",
        "actors.prompts_in_flight=2", f"actors.max_prompts={M}", "actors.weight_sync=abort",
        "engine.health_interval_s=0.3", "engine.health_timeout_s=10", "engine.health_failures=2",
        "learner.batch_groups=4", "buffer.max_staleness=1"])  # the run cannot end before the test drains
    s.procs.append(engine)
    try:
        s.start_buffer()
        with closing(WeightPublisher(s.publish, s.query)) as learner:
            learner.publish(make_weights(tiny_model_dir, tmp_path / "weights" / "v1", 0.9, 1))
            p = s.start_actors("--actor-id", "0")
            ready = read_tagged(p, "ACTOR READY", 120, s.tmp / "actors.log")
            assert ready["weight_version"] == 1  # the 400 after a completed load did not refuse v1
            port_m = ready["metrics_port"]

            def failures(reason: str) -> float:
                return metric(scrape(port_m), "vapo_actor_weight_sync_failures_total", actor="0", reason=reason) or 0

            v2 = make_weights(tiny_model_dir, tmp_path / "weights" / "v2", float("nan"), 2)
            learner.publish(v2)
            wait_for(lambda: failures("non_finite") == 1, 60, "v2 (NaN) refused")
            learner.publish(_without_one_tensor(tiny_model_dir, tmp_path / "weights" / "v3", 3))
            wait_for(lambda: failures("missing_tensors") == 1, 60, "v3 (a tensor missing) refused")
            assert failures("load_error") == 0
            status, text = get(url + "/metrics")  # --enable-metrics: Prometheus' engine job has a target
            assert status == 200 and "vapo_engine_generated_tokens_total" in text
            # the load's flush was refused: the worker flushed the radix cache itself (SGLang keeps one here)
            assert (metric(text, "vapo_engine_control_requests_total", endpoint="flush_cache", status="ok") or 0) >= 1
            assert json.loads(get(url + "/get_server_info")[1])["weight_version"] == "1"  # never loaded v2/v3
            groups = s.drain_until(lambda: p.poll() is not None, 150)
            done = read_tagged(p, "ACTOR DONE", 30, s.tmp / "actors.log")
            assert p.wait(timeout=30) == 0
    finally:
        s.cleanup()
    assert done["fatal"] is None and done["engine_restarts"] == 0 and done["weight_version"] == 1
    assert done["refused_versions"] == [2, 3] and done["prompts_done"] == M
    assert sorted(int(g.group_id.split("-p")[1]) for g in groups) == list(range(M))
    assert all(g.weight_version == 1 for g in groups)
    log = (tmp_path / "actors.log").read_text()
    assert "unreachable" not in log and "failed /health" not in log


@pytest.mark.parametrize("timeout_s,base,rate,max_new,expected", [
    (0.0, 120.0, 5.0, 96, 139.2), (0.0, 120.0, 5.0, 20000, 4120.0), (600.0, 120.0, 5.0, 20000, 600.0)])
def test_generate_timeout_follows_max_new_tokens(timeout_s: float, base: float, rate: float, max_new: int,
                                                 expected: float) -> None:
    from actors.worker import generate_timeout_s
    from common.config import load_config

    cfg = load_config(None, [f"actors.generate_timeout_s={timeout_s}", f"actors.generate_timeout_base_s={base}",
                             f"actors.min_tokens_per_s={rate}", f"actors.max_new_tokens={max_new}"])
    assert generate_timeout_s(cfg) == pytest.approx(expected)
