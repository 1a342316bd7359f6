"""Parts of ``ops/bench/weight_sync.py``: the two engines of a row (``rollout_server`` or live SGLang) and how
each tells that it serves a version bit for bit, the raw gloo broadcast that is the push's limit, and
the rounds' summary (on ``ops/bench/measure.py``).

Imports nothing of the learner: the raw broadcast's receivers import this module (``python -c``), and
should start in torch's import time, not DeepSpeed's.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import torch

from actors.rollout_server.process import ADMIN_KEY_ENV
from common.sglang_client import GenerateOutput, SGLangClient
from common.weight_bucket import Group, master_store, new_group
from ops.bench import measure
from ops.rehearsal.push import param_digest_of
from ops.sglang_cpu.live import REPO, LiveSGLang

ENGINES = 2
# A run with ``learner.weight_transport=distributed`` paused in place, as vapo starts its SGLang engines for one
# (``--disable-radix-cache``: a probe must never reuse KV computed by older weights); a small KV pool, since the
# probe is one short sequence and SGLang would size it from the default workload.
SGLANG_OVERRIDES = ("learner.weight_transport=distributed", "actors.push_pause=in_place",
                    "engine.sglang_max_total_tokens=2048")
PROBE = [5, 6, 7, 8, 9]  # ids every synthetic vocabulary has (the char tokenizer's 89 and up)
PROBE_TOKENS = 16
GOAL_OVER_RAW = 2.0  # the learner blocked at most twice the raw broadcast of the same bytes
T = TypeVar("T")


def start_rollout_server(model_dir: Path, log_dir: Path, key: str, timeout_s: float = 600.0) -> tuple[Any, str]:
    """``python -m actors.rollout_server`` on a free port; (process, url) once it prints its ready line."""
    env = {**os.environ, ADMIN_KEY_ENV: key, "PYTHONUNBUFFERED": "1"}
    err = open(log_dir / f"engine_{time.monotonic_ns()}.log", "w")  # lives with the process
    proc = subprocess.Popen([sys.executable, "-m", "actors.rollout_server", "--model-path", str(model_dir), "--port", "0",
                             "--threads", "1", "--log-level", "warning", "--max-batch-size", "4"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:  # a readiness wait on the pipe, not a sleep
            line = proc.stdout.readline()
            if "ready on " in line:
                return proc, line.split("ready on ", 1)[1].split()[0]
    proc.kill()
    raise RuntimeError(f"rollout_server did not start (see {err.name})")


def client(url: str, key: str) -> SGLangClient:
    """A client whose idle connections close after 3 s, before the server's keep-alive (SGLang's and uvicorn's
    5 s) does: reusing a connection the server has just closed fails the request ("Server disconnected"),
    and this benchmark leaves engines idle for seconds between its phases."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3))
    return SGLangClient(url, api_key=key, timeout_s=600, control_timeout_s=600, session=session)


async def close_clients(clients: list[SGLangClient]) -> None:
    for c in clients:
        if c._session is not None:
            await c._session.close()


def start_all(start: Callable[[int], T], stop: Callable[[T], None]) -> list[T]:
    """``ENGINES`` engines started at once (an SGLang start takes ~40-70 s on 2 idle cores); when one fails the
    others are stopped and its error raised."""
    with ThreadPoolExecutor(ENGINES) as pool:
        futs = [pool.submit(start, i) for i in range(ENGINES)]
    errors = [f.exception() for f in futs]
    started = [f.result() for f, e in zip(futs, errors, strict=True) if e is None]
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        for s in started:
            stop(s)
        raise failed
    return started


class RolloutServerEngines:
    """Two ``actors.rollout_server`` engines; bit for bit read from their ``/weights_digest``."""

    kind = "rollout_server"

    def __init__(self, model_dir: Path, log_dir: Path, key: str) -> None:
        def stop(started: tuple[Any, str]) -> None:
            started[0].kill()
            started[0].wait(30)

        started = start_all(lambda i: start_rollout_server(model_dir, log_dir, key), stop)
        self.procs = [p for p, _ in started]
        self.clients = [client(url, key) for _, url in started]

    async def fingerprint(self) -> Any:
        return (await self._digests())[0]

    async def _digests(self) -> list[str]:
        out = []
        for c in self.clients:
            _, body, _ = await c._request("GET", "weights_digest", timeout_s=600)
            out.append(body["sha256"])
        return out

    async def check(self, pushed: Path, disk: Path, version: int) -> tuple[bool, Any]:
        """(every engine serves the bytes of both disk copies, engine 0's served state)."""
        got = await self._digests()
        want = [await asyncio.to_thread(param_digest_of, p) for p in (pushed, disk)]
        return all(g == want[0] for g in got) and want[0] == want[1], got[0]

    async def close(self) -> None:
        await close_clients(self.clients)
        for p in self.procs:
            p.terminate()
            p.wait(30)


class SGLangEngines:
    """Two live SGLang 0.5.23 servers, started as vapo starts them (``ops.sglang_cpu.live``). SGLang has no
    digest (``/get_weights_by_name`` answers 400 for Qwen2), but on one CPU thread it is deterministic: an
    engine serves exactly a disk copy's weights when its greedy log-probs equal, to the bit, those it gives
    after loading that copy through ``/update_weights_from_disk``."""

    kind = "sglang"

    def __init__(self, model_dir: Path, log_dir: Path, key: str) -> None:
        self.servers = start_all(lambda i: LiveSGLang.start(model_dir, log_dir, admin_key=key, name=f"engine{i}",
                                                             overrides=SGLANG_OVERRIDES), LiveSGLang.stop)
        self.clients = [client(s.url, key) for s in self.servers]

    async def fingerprint(self) -> Any:
        return (await self._greedy(self.clients[0])).output_logprobs

    @staticmethod
    async def _greedy(c: SGLangClient) -> GenerateOutput:
        params = {"temperature": 0, "max_new_tokens": PROBE_TOKENS, "ignore_eos": True}
        return (await c.generate(PROBE, params, timeout_s=600))[0]

    async def check(self, pushed: Path, disk: Path, version: int) -> tuple[bool, Any]:
        """(each engine's greedy answer as pushed equals, ids and log-probs, its answer after loading the
        push's durable copy and then the disk path's copy of the version, and the other engine's; engine 0's
        log-probs)."""
        served = [await self._greedy(c) for c in self.clients]
        ok = all(s.weight_version == str(version) for s in served)
        for c, s in zip(self.clients, served, strict=True):
            for path in (pushed, disk):
                await c.update_weights_from_disk(str(path), weight_version=version, timeout_s=600)
                again = await self._greedy(c)
                ok = ok and (again.output_ids, again.output_logprobs) == (s.output_ids, s.output_logprobs)
        first = served[0]
        ok = ok and bool(first.output_logprobs) and all(s.output_logprobs == first.output_logprobs for s in served)
        return ok, first.output_logprobs

    async def close(self) -> None:
        await close_clients(self.clients)
        for s in self.servers:
            s.stop()


def start_engines(kind: str, model_dir: Path, log_dir: Path, key: str) -> RolloutServerEngines | SGLangEngines:
    return (SGLangEngines if kind == "sglang" else RolloutServerEngines)(model_dir, log_dir, key)


RECEIVER = "import json, sys; from ops.bench.weight_sync_parts import raw_receiver; raw_receiver(**json.loads(sys.argv[1]))"


def raw_receiver(port: int, rank: int, world: int, name: str, sizes: list[int], rounds: int, timeout_s: float) -> None:
    """One member of the raw broadcast: every round, each bucket into a fresh buffer (as SGLang allocates one
    per ``/update_weights_from_distributed``), nothing loaded."""
    torch.set_num_threads(1)
    group = new_group("gloo", "127.0.0.1", port, rank, world, name, timeout_s)
    for _ in range(rounds):
        for n in sizes:
            group.broadcast(torch.empty(n, dtype=torch.uint8))
    group.close()


class RawBroadcast:
    """The push's link without the push: a gloo group built as the weight-update group is
    (``common.weight_bucket.new_group``, rank 0 here and one receiver per engine, each its own process on this
    host, over TCP on 127.0.0.1), the same buckets broadcast one after another, each awaited. The receivers
    are plain torch processes: an engine receives only through its update endpoint, which also loads the
    bytes into its model, and that load is what the push is judged to add."""

    def __init__(self, sizes: list[int], receivers: int, rounds: int, timeout_s: float = 300.0) -> None:
        world = 1 + receivers
        store = master_store("127.0.0.1", 0, world, timeout_s)
        name = f"raw_broadcast_{os.getpid()}_{time.monotonic_ns()}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.procs = [subprocess.Popen(
            [sys.executable, "-c", RECEIVER, json.dumps({"port": int(store.port), "rank": r, "world": world,
                                                         "name": name, "sizes": sizes, "rounds": rounds,
                                                         "timeout_s": timeout_s})],
            cwd=REPO, env=env) for r in range(1, world)]
        self.group: Group | None = new_group("gloo", "127.0.0.1", int(store.port), 0, world, name, timeout_s,
                                             store=store)

    def run(self, bufs: list[torch.Tensor]) -> float:
        """Seconds to broadcast ``bufs`` to every receiver."""
        assert self.group is not None
        t0 = time.perf_counter()
        for b in bufs:
            self.group.broadcast(b)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:  # a round left unfinished: the receiver waits for bytes
                p.kill()
                p.wait(30)


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and [min, max] of each timed figure over the rounds, and the judged ratio against the raw
    broadcast (``ops/bench/measure.py``: the verdict from the per-round ratios' interquartile range)."""
    ratios = [r["push_over_raw_broadcast"] for r in rounds if isinstance(r.get("push_over_raw_broadcast"), float | int)]
    judged = measure.summarise(ratios, GOAL_OVER_RAW, higher_is_better=False,
                               name="push_over_raw_broadcast")
    return {**measure.figures(rounds), **judged}


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None

