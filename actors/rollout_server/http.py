"""The HTTP layer of ``actors.rollout_server``: SGLang's native API over a ``Scheduler``.

Endpoints and field names follow SGLang (``python/sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py``; shapes recorded in ``tests/actors/fixtures/sglang_api.json``):
``POST /generate``, ``POST /update_weights_from_disk``, ``POST /pause_generation``,
``POST /continue_generation``, ``POST /init_weights_update_group``, ``POST /update_weights_from_distributed``,
``POST /begin_weight_update``, ``POST /end_weight_update``, ``POST /destroy_weights_update_group`` (``dist_update.py``), ``GET|POST /flush_cache``, ``POST /abort_request``, ``GET /health``,
``GET /health_generate``, ``GET /ping``, ``GET /model_info`` (and its deprecated name ``/get_model_info``),
``GET /get_weight_version``, ``GET /get_server_info`` and ``GET /metrics`` (``vapo_engine_*``). Value errors
answer 400 ``{"error": {"message"}}``, malformed bodies 400 ``{"object": "error", "message", "type": "Bad
Request", "param": null, "code": 400}``, as SGLang does; the server keeps serving.

Hostile input: every sampling parameter is range-checked before use (``top_k <= 2^30``, ``n <= --max-n``,
int32 token counts); integer literals longer than 30 digits, lone surrogates, nesting past the JSON
parser's recursion limit and undecodable Content-Encoding are 400s that name the field; bodies past
``--max-body-bytes`` are 413; a request whose prompts x n x (input + max_new_tokens) would push the waiting
queue past ``--max-queued-tokens`` is refused (400 if it could never fit, 503 while the queue is full)
before any of its sequences exists; text prompts that cannot fit the context are refused before they are
tokenised. A body must arrive within ``--http-read-timeout-s`` (408) and a connection that completes no
request within ``--http-idle-timeout-s`` is closed. Checkpoints are read in a thread of their own within
``--weight-load-timeout-s``. Request bodies: ``body.py``; a /generate body parsed and admitted:
``generate_request.py``; the admin API key and the census of a
``/generate`` body before it is parsed: ``guard.py``;
the control endpoints (weight load from disk, pause, continue, flush, abort): ``control.py``.

``imitate_sglang`` (``--imitate-sglang``): the released SGLang 0.5.23's behaviour where it differs; see the
package docstring. Deviations from SGLang: see the package docstring.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from actors.rollout_server.body import (
    BadRequest,
    error_response,
    errors_middleware,
    json_body,
    validation_error,
    value_error,
)
from actors.rollout_server.control import FLUSH_CACHE_TEXT, FLUSH_REFUSED, ControlEndpoints, _resolve  # noqa: F401 (re-exported)
from actors.rollout_server.dist_update import DistributedUpdates
from actors.rollout_server.generate_request import GenerateParser, GenerateRequest
from actors.rollout_server.guard import admin_auth_middleware, quiet_protocol_errors
from common.generation.sampling import DEFAULT_MAX_N, RequestError, SamplingParams
from common.generation.scheduler import Scheduler, SchedulerBusy, Sequence
from common.metrics import Metrics
from common.sglang_client import gc_paused

log = logging.getLogger("vapo.rollout_server")

HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))  # SGLang's http_server reads the same


class Server(ControlEndpoints):
    """HTTP front end: parses SGLang requests, hands sequences to the scheduler, builds SGLang responses."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any, model_path: str, tokenizer_path: str,
                 metrics: Metrics, *, max_n: int = DEFAULT_MAX_N, weight_load_timeout_s: float = 600.0,
                 imitate_sglang: bool = False, enable_metrics: bool = True, refuse_flush: bool = False,
                 admin_api_key: str = "", max_prompts: int = 0) -> None:
        self.scheduler = scheduler
        self.admin_api_key = admin_api_key
        self.parser = GenerateParser(scheduler, tokenizer, max_n=max_n, max_prompts=max_prompts)
        self.weight_load_timeout_s = weight_load_timeout_s
        # SGLang imitation (tests): real SGLang 0.5.23's behaviours where they differ from this server's.
        self.imitate_sglang = imitate_sglang
        self.enable_metrics = enable_metrics or not imitate_sglang
        self.refuse_flush = refuse_flush
        # SGLang keeps the weight version twice: the scheduler's (stamped on outputs) and the tokenizer
        # manager's (/model_info), and a load whose cache flush is refused moves only the first.
        self.tm_weight_version = scheduler.weight_version
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.metrics = metrics
        self._update_lock = asyncio.Lock()
        self.dist_updates = DistributedUpdates(self)
        self.started = time.time()
        # Finished sequences cross from the scheduler thread to the event loop in batches: one wake-up per
        # scheduler step instead of one per sequence.
        self._done_lock = threading.Lock()
        self._done: list[tuple[asyncio.Future, Sequence]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def _finished(self, fut: asyncio.Future, s: Sequence) -> None:
        """Scheduler thread: queue a finished sequence; schedule one drain if none is pending."""
        with self._done_lock:
            self._done.append((fut, s))
            first = len(self._done) == 1
        if first and self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._done_lock:
            done, self._done = self._done, []
        for fut, s in done:
            _resolve(fut, s)

    # ------------------------------------------------------------------ /generate

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request, check=self.parser.census)
            req = await self.parser.parse(body)
            self.parser.admit(req)
        except BadRequest as e:
            self.metrics.bad_requests.labels(endpoint="generate").inc()
            return validation_error(str(e))
        except RequestError as e:
            self.metrics.bad_requests.labels(endpoint="generate").inc()
            return value_error(str(e))
        except SchedulerBusy as e:
            self.metrics.bad_requests.labels(endpoint="generate").inc()
            return error_response(503, str(e))
        done = await self._run_generate(req)
        if isinstance(done, web.Response):
            return done
        return self._generate_response(req, done)

    async def _run_generate(self, req: GenerateRequest) -> list[Sequence] | web.Response:
        """Submit the request's sequences and wait for all of them: the finished sequences in prompt-major
        order, or the error response when the scheduler refused them or aborted one with a 5xx status."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        futures: list[asyncio.Future] = []
        seqs: list[Sequence] = []
        for i, (ids, params) in enumerate(zip(req.prompts, req.params, strict=True)):
            for j in range(req.n):  # prompt-major expansion of n, as SGLang's tokenizer manager does
                fut = loop.create_future()

                def on_done(s: Sequence, fut: asyncio.Future = fut) -> None:
                    self._finished(fut, s)

                seq_rid = req.rids[i] if req.n == 1 else f"{req.rids[i]}-{j}"
                seqs.append(Sequence(rid=seq_rid, prompt_ids=list(ids), params=params, on_done=on_done))
                futures.append(fut)
        try:
            self.scheduler.submit(seqs)
        except RuntimeError as e:  # SchedulerBusy (a race with another request) or a dead scheduler
            return error_response(503, str(e))
        try:
            done = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # client went away: free the slots
            self.scheduler.abort({s.rid for s in seqs}, "Request is disconnected from the client side.")
            raise
        failed = next((s.finish for s in done if s.finish and s.finish.get("status_code") in (500, 503)), None)
        if failed is not None:  # SGLang turns a scheduler-side abort with a 5xx status into an HTTP error
            body = {"object": "error", "message": failed["message"], "type": str(failed["status_code"]),
                    "param": None, "code": failed["status_code"]}
            return web.json_response(body, status=failed["status_code"])
        return list(done)

    def _generate_response(self, req: GenerateRequest, done: list[Sequence]) -> web.Response:
        """SGLang's /generate answer: one object for a single prompt with n = 1, else a list."""
        return_logprob = [lp for lp in req.return_logprob for _ in range(req.n)]
        with gc_paused():  # thousands of small lists: keep GC passes out of the response path
            texts = (self.tokenizer.batch_decode([s.output_ids for s in done], skip_special_tokens=True)
                     if self.tokenizer is not None else [None] * len(done))
            outs = [self._output(s, lp, req.text_in_logprobs, x) for s, lp, x in zip(done, return_logprob, texts, strict=True)]
            body = _dumps(outs[0] if req.single else outs)
        return web.Response(text=body, content_type="application/json")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _output(self, s: Sequence, return_logprob: bool, text_in_lp: bool, text: str | None) -> dict[str, Any]:
        spans = _spans(s.versions)
        meta: dict[str, Any] = {
            "id": s.rid,
            "finish_reason": s.finish,
            "prompt_tokens": len(s.prompt_ids),
            "weight_version": self.scheduler.weight_version,
            "total_retractions": s.retractions,
        }
        if self.imitate_sglang:
            # SGLang 0.5.23 (utils/weight_versions.py): per-version token ranges, and weight_version is the
            # version of the last range (the scheduler's, which a refused cache flush does not hold back).
            meta["num_retractions"] = meta.pop("total_retractions")
            if spans:
                start = 0
                meta["weight_versions"] = []
                for v, k in spans:
                    meta["weight_versions"].append({"version": v, "start": start, "end": start + k})
                    start += k
                meta["weight_version"] = spans[-1][0]
            else:
                meta["weight_version"] = self.scheduler.weight_version
        else:
            meta["output_weight_version_spans"] = spans
        if return_logprob:
            texts: list[str | None] = ([self._decode([t]) for t in s.output_ids] if text_in_lp and self.tokenizer is not None
                     else [None] * len(s.output_ids))
            meta["input_token_logprobs"] = [(None, s.prompt_ids[-1], None)]
            meta["output_token_logprobs"] = list(zip(s.logprobs, s.output_ids, texts, strict=True))
        meta["completion_tokens"] = len(s.output_ids)
        meta["cached_tokens"] = 0
        meta["e2e_latency"] = s.finished_at - s.created
        out: dict[str, Any] = {"output_ids": s.output_ids, "meta_info": meta}
        if text is not None:
            out = {"text": text, **out}
        return out

    async def health(self, request: web.Request) -> web.Response:
        """200 while generating; 503 while paused (SGLang's /health, a generation, cannot run then and
        fails after SGLANG_HEALTH_CHECK_TIMEOUT; here the 503 is immediate and names the pause)."""
        if self.imitate_sglang:  # SGLang 0.5.23 serves /health with the /health_generate handler
            return await self.health_generate(request)
        if self.scheduler.alive and self.scheduler.paused is not None:
            return web.Response(status=503, text=f"generation paused (mode={self.scheduler.paused})\n")
        return await self.ping(request)

    async def ready(self, request: web.Request) -> web.Response:
        """SGLang's /ready: 200 when the server takes new requests (alive and not paused), else 503."""
        return web.Response(status=200 if self.scheduler.alive and self.scheduler.paused is None else 503)

    async def ping(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.scheduler.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.scheduler.alive:
            return web.Response(status=503)
        if self.imitate_sglang:
            return await self._sglang_health_generate()
        if self.scheduler.running and time.time() - self.scheduler.last_step_at < HEALTH_CHECK_TIMEOUT_S:
            return web.Response(status=200)  # busy and making progress, as SGLang skips the probe
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        rid = f"HEALTH_CHECK_{time.time()}"
        params = SamplingParams(max_new_tokens=1, top_k=1)

        def on_done(s: Sequence) -> None:  # the scheduler's thread: hand the answer to this loop
            loop.call_soon_threadsafe(_resolve, fut, s)

        self.scheduler.submit([Sequence(rid=rid, prompt_ids=[0], params=params, on_done=on_done)])
        try:
            await asyncio.wait_for(fut, HEALTH_CHECK_TIMEOUT_S)
            return web.Response(status=200)
        except TimeoutError:
            self.scheduler.abort({rid})
            return web.Response(status=503)

    async def _sglang_health_generate(self) -> web.Response:
        """SGLang 0.5.23's probe: a one-token generation, checked once a second; 200 as soon as the scheduler
        answered anything, 503 after SGLANG_HEALTH_CHECK_TIMEOUT. While generation is paused or weights are
        loading (the update holds the model lock) the probe request cannot run, so it blocks, then fails."""
        tic = time.time()
        steps_at_tic = self.scheduler.steps
        submitted = False
        rid = f"HEALTH_CHECK_{tic}"
        while time.time() < tic + HEALTH_CHECK_TIMEOUT_S:
            if not submitted and not self.scheduler.paused and not self._update_lock.locked():
                try:
                    self.scheduler.submit([Sequence(rid=rid, prompt_ids=[0],
                                                 params=SamplingParams(max_new_tokens=1, top_k=1), on_done=lambda s: None)])
                except SchedulerBusy:
                    pass  # a full queue: the scheduler is stepping, which is what the probe looks for
                submitted = True
            await asyncio.sleep(1.0)
            if submitted and self.scheduler.steps > steps_at_tic:
                return web.Response(status=200)
        self.scheduler.abort({rid})
        return web.Response(status=503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.tm_weight_version if self.imitate_sglang else self.scheduler.weight_version,
        })

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.scheduler.weight_version})

    async def get_server_info(self, request: web.Request) -> web.Response:
        e = self.scheduler
        return web.json_response({
            "model_path": self.model_path, "weight_version": e.weight_version, "max_running_requests": e.max_batch_size,
            "context_length": e.context_length, "device": str(e.device), "paused": e.paused,
            "running_requests": len(e.running), "waiting_requests": e.num_waiting(), "steps": e.steps,
            "logprobs": "scaled" if e.scaled_logprobs else "original", "engine": "vapo.rollout_server",
        })

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def app(self, max_body_bytes: int = 32 << 20, read_timeout_s: float = 60.0) -> web.Application:
        middlewares: list[Any] = [errors_middleware]
        if self.admin_api_key:
            middlewares.append(admin_auth_middleware(
                self.admin_api_key, lambda r: self._control(r, "no or wrong admin API key", status="unauthorized")))
        quiet_protocol_errors()
        app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
        app["max_body_bytes"] = max_body_bytes
        app["read_timeout_s"] = read_timeout_s
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        self.dist_updates.routes(r)  # /init_weights_update_group, /begin_..., /update_..._from_distributed, /end_...
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/ping", self.ping)
        r.add_get("/ready", self.ready)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)  # SGLang's deprecated name for the same handler
        if not self.imitate_sglang:  # an older SGLang route, gone in 0.5.23
            r.add_get("/get_weight_version", self.get_weight_version)
        r.add_get("/get_server_info", self.get_server_info)
        if self.enable_metrics:  # SGLang serves /metrics only with --enable-metrics
            r.add_get("/metrics", self.metrics_endpoint)
        return app


def _spans(versions: list[str]) -> list[list[Any]]:
    """Run-length form of per-token weight versions: [[version, n_tokens], ...] in token order."""
    out: list[list[Any]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------- CLI
