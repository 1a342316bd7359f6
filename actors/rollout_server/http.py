"""rollout_server: a small real inference engine that serves SGLang's native HTTP API (CPU, or CUDA).

    python -m actors.rollout_server --model-path runs/_base/addition-tiny --port 30000 [--device cpu]

Endpoints and field names follow SGLang (``python/sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py``; shapes recorded in ``tests/actors/fixtures/sglang_api.json``):
``POST /generate``, ``POST /update_weights_from_disk``, ``POST /pause_generation``,
``POST /continue_generation``, ``GET|POST /flush_cache``, ``POST /abort_request``, ``GET /health``,
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
``--weight-load-timeout-s``, and only regular files are opened. If the engine thread dies, the process exits
with code 1 (its supervisor restarts it) instead of answering 503 forever. A non-loopback ``--host``
needs ``--bind-protection`` (``engine.bind_protection``): the control API has no authentication.

``--imitate-sglang`` (test mode, ``engine.imitate_sglang``): behave as the released SGLang 0.5.23 does where
it differs: ``/health`` is ``/health_generate`` (a one-token generation polled once a second, 503 after
SGLANG_HEALTH_CHECK_TIMEOUT, blocked while paused or loading weights); after a completed load the cache
flush is refused while requests run or wait (always with ``--refuse-flush``) and the update answers 400
with the new weights live and ``/model_info``'s version unmoved; outputs carry ``meta_info.weight_versions``
(``[{"version", "start", "end"}]``); ``/metrics`` only with ``--enable-metrics``; no ``/get_weight_version``.

The engine (``actors/engine.py``) batches concurrently arriving requests continuously with a KV cache.

Deviations from SGLang, on purpose:
- Output logprobs default to log_softmax(logits) at temperature 1 (``--logprobs original``), what the
  learner recomputes; SGLang returns that only with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` and otherwise the
  temperature-scaled log_softmax(logits / T) (``--logprobs scaled``). At temperature 1 both agree.
- ``meta_info.output_weight_version_spans`` (extension, ``[[version, n_tokens], ...]`` in token order) says
  which weights produced each output token, so a request that straddled an in-place weight update can be
  stamped with the oldest version;
  ``meta_info.weight_version`` keeps SGLang's meaning (the version served when the response was built).
- No streaming, no stop strings, no penalties, no prefix cache; those requests get a 400.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from actors.engine import (
    DEFAULT_MAX_N,
    PAUSE_MODES,
    Engine,
    EngineBusy,
    RequestError,
    SamplingParams,
    Sequence,
    _short,
    new_rid,
)
from actors.sglang_client import gc_paused
from common.config import EngineConfig
from common.metrics import Metrics
from common.security import is_loopback_host

log = logging.getLogger("vapo.rollout_server")

HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))  # SGLang's http_server reads the same
MAX_INT_DIGITS = 30  # no field takes an integer this long; longer ones are parsed as _HugeInt, never int()
BIND_PROTECTIONS = ("firewall", "private_network", "auth_proxy")
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")  # SGLang's weight_updater message
FLUSH_CACHE_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                    "waiting requests, the operation will not be performed.)\n")


class BadRequest(Exception):
    """Request body that does not validate (SGLang: pydantic RequestValidationError)."""


class HttpError(Exception):
    """A request refused before it is parsed: body too large (413), too slow (408), undecodable (400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _HugeInt:
    """An integer literal too long to be any field's value; converting it would cost quadratic time (or hit
    Python's 4300-digit limit). Field checks see a non-int and name the field."""

    def __init__(self, digits: str) -> None:
        self.n_digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<integer of {self.n_digits} digits>"


def _parse_int(digits: str) -> int | _HugeInt:
    return int(digits) if len(digits) <= MAX_INT_DIGITS else _HugeInt(digits)


def _error(status: int, message: str) -> web.Response:
    """SGLang's ErrorResponse shape for HTTPExceptions (type = the status code as a string)."""
    body = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
    return web.json_response(body, status=status)


def _validation_error(message: str) -> web.Response:
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(body, status=400)


def _value_error(message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=400)


async def _read_body(request: web.Request) -> bytes:
    """The request body within the size limit (413) and read deadline (408); undecodable
    Content-Encoding (a bad gzip stream) is a 400."""
    limit = request.app["max_body_bytes"]
    if request.content_length is not None and request.content_length > limit:
        raise HttpError(413, f"request body: {request.content_length} bytes is more than the server accepts "
                             f"({limit}, --max-body-bytes)")
    try:
        return await asyncio.wait_for(request.read(), request.app["read_timeout_s"])
    except TimeoutError:
        raise HttpError(408, f"request body: not received within {request.app['read_timeout_s']} s "
                             "(--http-read-timeout-s)") from None
    except web.HTTPRequestEntityTooLarge:
        raise HttpError(413, f"request body: more than the server accepts ({limit} bytes, --max-body-bytes)") from None
    except (RequestPayloadError, HttpProcessingError, zlib.error, EOFError, OSError, ValueError) as e:
        raise HttpError(400, f"request body: cannot decode it (Content-Encoding "
                             f"{request.headers.get('Content-Encoding', 'identity')!r}): {_short(str(e), 200)}") from None


async def _json_body(request: web.Request, required: bool = True) -> dict[str, Any]:
    raw = await _read_body(request)
    if not raw.strip():
        if required:
            raise BadRequest("Field required: request body is empty")
        return {}
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        raise BadRequest("JSON decode error: the body is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"JSON decode error: {_short(str(e), 200)}") from None
    except ValueError as e:  # e.g. an exponent float past the float range
        raise BadRequest(f"JSON decode error: {_short(str(e), 200)}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"Input should be a JSON object, got {type(body).__name__}")
    return body


def _check_text(value: Any, field: str) -> None:
    """A client string must be valid Unicode: a lone surrogate ("\\ud800") passes json.loads but no
    tokenizer or encoder accepts it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{field}: Input should be a valid string (lone surrogate at position "
                         f"{_first_surrogate(value)})") from None


def _first_surrogate(s: str) -> int:
    return next((i for i, c in enumerate(s) if 0xD800 <= ord(c) <= 0xDFFF), -1)


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class Server:
    """HTTP front end: parses SGLang requests, hands sequences to the engine, builds SGLang responses."""

    def __init__(self, engine: Engine, tokenizer: Any, model_path: str, tokenizer_path: str,
                 metrics: Metrics, *, max_n: int = DEFAULT_MAX_N, weight_load_timeout_s: float = 600.0,
                 imitate_sglang: bool = False, enable_metrics: bool = True, refuse_flush: bool = False) -> None:
        self.engine = engine
        self.max_n = max_n
        self.weight_load_timeout_s = weight_load_timeout_s
        # SGLang imitation (tests): real SGLang 0.5.23's behaviours where they differ from this server's.
        self.imitate_sglang = imitate_sglang
        self.enable_metrics = enable_metrics or not imitate_sglang
        self.refuse_flush = refuse_flush
        # SGLang keeps the weight version twice: the scheduler's (stamped on outputs) and the tokenizer
        # manager's (/model_info), and a load whose cache flush is refused moves only the first.
        self.tm_weight_version = engine.weight_version
        # Longest token in characters: a text prompt longer than context_length x this cannot fit, and is
        # refused before it is tokenised.
        self.max_token_chars = _max_token_chars(tokenizer)
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.metrics = metrics
        self._update_lock = asyncio.Lock()
        self.started = time.time()
        # Finished sequences cross from the engine thread to the event loop in batches: one wake-up per
        # engine step instead of one per sequence.
        self._done_lock = threading.Lock()
        self._done: list[tuple[asyncio.Future, Sequence]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def _finished(self, fut: asyncio.Future, s: Sequence) -> None:
        """Engine thread: queue a finished sequence; schedule one drain if none is pending."""
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

    async def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        text, ids = body.get("text"), body.get("input_ids")
        if body.get("input_embeds") is not None:
            raise RequestError("input_embeds is not supported by rollout_server")
        if (text is None) == (ids is None):
            raise RequestError("Either text, input_ids or input_embeds should be provided.")
        if ids is not None:
            if not isinstance(ids, list):
                raise BadRequest("input_ids: Input should be a valid list")
            if len(ids) == 0:
                raise RequestError("input_ids cannot be empty.")
            if _is_int_list(ids):
                return [ids], True
            if all(_is_int_list(x) for x in ids):
                return ids, False
            raise BadRequest("input_ids: Input should be a list of integers or a list of lists of integers")
        if self.tokenizer is None:
            raise RequestError("text input needs a tokenizer; the server runs with --skip-tokenizer-init")
        single = isinstance(text, str)
        texts = [text] if single else text
        if not (isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
            raise BadRequest("text: Input should be a valid string or list of strings")
        limit = self.engine.context_length * self.max_token_chars
        for t in texts:
            _check_text(t, "text")
            if len(t) > limit:
                raise RequestError(f"text: {len(t)} characters cannot fit the model's context length "
                                   f"({self.engine.context_length} tokens).")
        # Off the event loop: a long batch takes a while to tokenise, and /health must keep answering.
        ids_list = await asyncio.to_thread(lambda: [self.tokenizer(t)["input_ids"] for t in texts])
        return ids_list, single

    @staticmethod
    def _per_item(value: Any, n: int, name: str, default: Any) -> list[Any]:
        if value is None:
            return [default] * n
        if isinstance(value, list):
            if len(value) != n:
                raise RequestError(f"The length of {name} should be equal to the batch size ({n}), got {len(value)}.")
            return [default if v is None else v for v in value]
        return [value] * n

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            if body.get("stream"):
                raise RequestError("stream=true is not supported by rollout_server")
            prompts, is_single = await self._prompts(body)
            b = len(prompts)
            sp_raw = body.get("sampling_params")
            if sp_raw is not None and not isinstance(sp_raw, dict | list):
                raise BadRequest("sampling_params: Input should be a valid dictionary or list")
            sps = self._per_item(sp_raw, b, "sampling_params", {})
            if not all(isinstance(s, dict) for s in sps):
                raise BadRequest("sampling_params: each item should be a valid dictionary")
            params = [SamplingParams.from_dict(s, self.engine.vocab_size, self.max_n) for s in sps]
            n = params[0].n
            if any(p.n != n for p in params):
                raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
            if n > 1:
                is_single = False
            ret_lp = self._per_item(body.get("return_logprob"), b, "return_logprob", False)
            if not all(isinstance(x, bool) for x in ret_lp):
                raise BadRequest("return_logprob: Input should be a valid boolean")
            for key in ("logprob_start_len", "top_logprobs_num"):
                vals = self._per_item(body.get(key), b, key, -1 if key == "logprob_start_len" else 0)
                if any(v not in (-1, 0) or isinstance(v, bool) for v in vals) and key == "top_logprobs_num":
                    raise RequestError("top_logprobs_num > 0 is not supported by rollout_server")
                if key == "logprob_start_len" and any(v != -1 for v in vals):
                    raise RequestError("logprob_start_len other than -1 is not supported by rollout_server")
            if body.get("token_ids_logprob"):
                raise RequestError("token_ids_logprob is not supported by rollout_server")
            text_in_lp = body.get("return_text_in_logprobs", False)
            if not isinstance(text_in_lp, bool):
                raise BadRequest("return_text_in_logprobs: Input should be a valid boolean")
            rid = body.get("rid")
            if isinstance(rid, str) or isinstance(rid, list) and all(isinstance(r, str) for r in rid):
                for r in [rid] if isinstance(rid, str) else rid:
                    _check_text(r, "rid")
            if rid is None:
                rids = [new_rid() for _ in range(b)]
            elif isinstance(rid, str):
                rids = [rid] if is_single and n == 1 else [f"{rid}_{i}" for i in range(b)]
            elif isinstance(rid, list) and len(rid) == b and all(isinstance(r, str) for r in rid):
                rids = rid
            else:
                raise RequestError("The rid should be a string or a list of strings of the batch size.")
            for ids, p in zip(prompts, params, strict=True):
                self.engine.validate_prompt(ids, p)
            # What the request would queue, checked before a single Sequence exists.
            self.engine.admissible(n * sum(len(ids) + p.max_new_tokens for ids, p in zip(prompts, params, strict=True)))
        except BadRequest as e:
            self.metrics.bad_requests.labels(endpoint="generate").inc()
            return _validation_error(str(e))
        except RequestError as e:
            self.metrics.bad_requests.labels(endpoint="generate").inc()
            return _value_error(str(e))
        except EngineBusy as e:
            self.metrics.bad_requests.labels(endpoint="generate").inc()
            return _error(503, str(e))

        loop = asyncio.get_running_loop()
        self._loop = loop
        futures: list[asyncio.Future] = []
        seqs: list[Sequence] = []
        items: list[tuple[int, bool]] = []
        for i in range(b):  # prompt-major expansion of n, as SGLang's tokenizer manager does
            for j in range(n):
                fut = loop.create_future()

                def on_done(s: Sequence, fut: asyncio.Future = fut) -> None:
                    self._finished(fut, s)

                seq_rid = rids[i] if n == 1 else f"{rids[i]}-{j}"
                seqs.append(Sequence(rid=seq_rid, prompt_ids=list(prompts[i]), params=params[i], on_done=on_done))
                futures.append(fut)
                items.append((i, ret_lp[i]))
        try:
            self.engine.submit(seqs)
        except RuntimeError as e:  # EngineBusy (a race with another request) or a dead engine
            return _error(503, str(e))
        try:
            done = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # client went away: free the slots
            self.engine.abort({s.rid for s in seqs}, "Request is disconnected from the client side.")
            raise
        failed = next((s.finish for s in done if s.finish and s.finish.get("status_code") in (500, 503)), None)
        if failed is not None:  # SGLang turns an engine-side abort with a 5xx status into an HTTP error
            body = {"object": "error", "message": failed["message"], "type": str(failed["status_code"]),
                    "param": None, "code": failed["status_code"]}
            return web.json_response(body, status=failed["status_code"])
        with gc_paused():  # thousands of small lists: keep GC passes out of the response path
            texts = (self.tokenizer.batch_decode([s.output_ids for s in done], skip_special_tokens=True)
                     if self.tokenizer is not None else [None] * len(done))
            outs = [self._output(s, lp, text_in_lp, x) for s, (_, lp), x in zip(done, items, texts, strict=True)]
            body = _dumps(outs[0] if is_single else outs)
        return web.Response(text=body, content_type="application/json")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _output(self, s: Sequence, return_logprob: bool, text_in_lp: bool, text: str | None) -> dict[str, Any]:
        spans = _spans(s.versions)
        meta: dict[str, Any] = {
            "id": s.rid,
            "finish_reason": s.finish,
            "prompt_tokens": len(s.prompt_ids),
            "weight_version": self.engine.weight_version,
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
                meta["weight_version"] = self.engine.weight_version
        else:
            meta["output_weight_version_spans"] = spans
        if return_logprob:
            texts = ([self._decode([t]) for t in s.output_ids] if text_in_lp and self.tokenizer is not None
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

    # ------------------------------------------------------------------ control endpoints

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise BadRequest("model_path: Field required (a non-empty string)")
            _check_text(path, "model_path")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str | int) or isinstance(version, bool):
                raise BadRequest("weight_version: Input should be a valid string")
            if isinstance(version, str):
                _check_text(version, "weight_version")
            abort_all = body.get("abort_all_requests", False)
            if not isinstance(abort_all, bool):
                raise BadRequest("abort_all_requests: Input should be a valid boolean")
            load_format = body.get("load_format")
            if load_format is not None and not isinstance(load_format, str):
                raise BadRequest("load_format: Input should be a valid string")
        except BadRequest as e:
            self.metrics.bad_requests.labels(endpoint="update_weights_from_disk").inc()
            return _validation_error(str(e))
        version = None if version is None else str(version)
        async with self._update_lock:
            if load_format not in (None, "auto", "safetensors"):
                ok, msg = False, f"Failed to update weights: load_format {load_format!r} is not supported (auto | safetensors)."
            else:
                if abort_all:
                    await asyncio.wrap_future(self.engine.abort(None, "Aborted for a weight update."))
                ok, msg = await self._load(path, version)
                if ok and (self.refuse_flush or self.imitate_sglang and not await asyncio.wrap_future(self.engine.flush_cache())):
                    # SGLang flushes its radix cache after a load and answers 400 when the flush is refused,
                    # with the new weights (and the scheduler's version) already live.
                    self.metrics.weight_updates.labels(status="ok").inc()
                    log.warning("update_weights_from_disk %s: loaded, but %s", path, FLUSH_REFUSED)
                    return web.json_response({"success": False, "message": FLUSH_REFUSED, "num_paused_requests": 0},
                                             status=400)
            if ok:
                self.model_path = path
                self.tm_weight_version = self.engine.weight_version
                if version is not None:
                    msg += f" Weight version updated to {version}."
        self.metrics.weight_updates.labels(status="ok" if ok else "failed").inc()
        (log.info if ok else log.warning)("update_weights_from_disk %s: %s", path, msg)
        return web.json_response({"success": ok, "message": msg, "num_paused_requests": 0},
                                 status=200 if ok else 400)

    async def _load(self, path: str, version: str | None) -> tuple[bool, str]:
        """Read and validate the checkpoint in a thread of its own, within ``weight_load_timeout_s``, then
        let the engine apply it between steps. A read that hangs (a stalled network file system) is
        abandoned: its daemon thread cannot keep the server from answering or from exiting on SIGTERM."""
        loop = asyncio.get_running_loop()
        staged: asyncio.Future = loop.create_future()

        def read() -> None:
            try:
                result: Any = self.engine.read_weights(path)
            except BaseException as e:  # reported to the waiting handler, never lost in a thread
                result = e
            loop.call_soon_threadsafe(_resolve, staged, result)

        threading.Thread(target=read, name="weight-load", daemon=True).start()
        try:
            # shield: on timeout the late result is dropped, never applied behind the caller's back
            sd = await asyncio.wait_for(asyncio.shield(staged), self.weight_load_timeout_s)
        except TimeoutError:
            return False, (f"Failed to update weights: reading {path} did not finish within "
                           f"{self.weight_load_timeout_s} s (--weight-load-timeout-s).")
        if isinstance(sd, BaseException):
            return False, f"Failed to update weights: {sd}."
        return await asyncio.wrap_future(self.engine.apply_weights(sd, version))

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request, required=False)
            mode = body.get("mode", "abort")
            if mode not in PAUSE_MODES:
                raise BadRequest(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        except BadRequest as e:
            self.metrics.bad_requests.labels(endpoint="pause_generation").inc()
            return _validation_error(str(e))
        await asyncio.wrap_future(self.engine.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await asyncio.wrap_future(self.engine.resume())
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await asyncio.wrap_future(self.engine.flush_cache())
        return web.Response(text=FLUSH_CACHE_TEXT, status=200 if ok else 400)

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
        except BadRequest as e:
            return _validation_error(str(e))
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))
        if abort_all:
            await asyncio.wrap_future(self.engine.abort(None, "Aborted by abort_request."))
        elif isinstance(rid, str) and rid:
            # SGLang matches by prefix so that a batch rid aborts all of its items.
            await asyncio.wrap_future(self.engine.abort(None, "Aborted by abort_request.", prefix=rid))
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        if self.imitate_sglang:  # SGLang 0.5.23 serves /health with the /health_generate handler
            return await self.health_generate(request)
        return await self.ping(request)

    async def ping(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.engine.alive:
            return web.Response(status=503)
        if self.imitate_sglang:
            return await self._sglang_health_generate()
        if self.engine.running and time.time() - self.engine.last_step_at < HEALTH_CHECK_TIMEOUT_S:
            return web.Response(status=200)  # busy and making progress, as SGLang skips the probe
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        rid = f"HEALTH_CHECK_{time.time()}"
        params = SamplingParams(max_new_tokens=1, top_k=1)
        self.engine.submit([Sequence(rid=rid, prompt_ids=[0], params=params,
                                     on_done=lambda s: loop.call_soon_threadsafe(_resolve, fut, s))])
        try:
            await asyncio.wait_for(fut, HEALTH_CHECK_TIMEOUT_S)
            return web.Response(status=200)
        except TimeoutError:
            self.engine.abort({rid})
            return web.Response(status=503)

    async def _sglang_health_generate(self) -> web.Response:
        """SGLang 0.5.23's probe: a one-token generation, checked once a second; 200 as soon as the engine
        answered anything, 503 after SGLANG_HEALTH_CHECK_TIMEOUT. While generation is paused or weights are
        loading (the update holds the model lock) the probe request cannot run, so it blocks, then fails."""
        tic = time.time()
        steps_at_tic = self.engine.steps
        submitted = False
        rid = f"HEALTH_CHECK_{tic}"
        while time.time() < tic + HEALTH_CHECK_TIMEOUT_S:
            if not submitted and not self.engine.paused and not self._update_lock.locked():
                try:
                    self.engine.submit([Sequence(rid=rid, prompt_ids=[0],
                                                 params=SamplingParams(max_new_tokens=1, top_k=1), on_done=lambda s: None)])
                except EngineBusy:
                    pass  # a full queue: the engine is stepping, which is what the probe looks for
                submitted = True
            await asyncio.sleep(1.0)
            if submitted and self.engine.steps > steps_at_tic:
                return web.Response(status=200)
        self.engine.abort({rid})
        return web.Response(status=503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.tm_weight_version if self.imitate_sglang else self.engine.weight_version,
        })

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def get_server_info(self, request: web.Request) -> web.Response:
        e = self.engine
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
        app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors_middleware])
        app["max_body_bytes"] = max_body_bytes
        app["read_timeout_s"] = read_timeout_s
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/ping", self.ping)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)  # SGLang's deprecated name for the same handler
        if not self.imitate_sglang:  # an older SGLang route, gone in 0.5.23
            r.add_get("/get_weight_version", self.get_weight_version)
        r.add_get("/get_server_info", self.get_server_info)
        if self.enable_metrics:  # SGLang serves /metrics only with --enable-metrics
            r.add_get("/metrics", self.metrics_endpoint)
        return app


@web.middleware
async def _errors_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """HttpError -> its status with SGLang's error body; any other exception -> a logged 500 that names it
    (no traceback to the client), and the server keeps serving."""
    try:
        return await handler(request)
    except HttpError as e:
        return _error(e.status, str(e))
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"internal error: {type(e).__name__}")


def _max_token_chars(tokenizer: Any) -> int:
    """Characters in the tokenizer's longest token (at least 1; 64 when the vocabulary cannot be read)."""
    if tokenizer is None:
        return 64
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:  # tokenizers without get_vocab
        return 64


def _spans(versions: list[str]) -> list[list[Any]]:
    """Run-length form of per-token weight versions: [[version, n_tokens], ...] in token order."""
    out: list[list[Any]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    p = argparse.ArgumentParser(
        prog="python -m actors.rollout_server",
        description="Serve an HF causal LM through SGLang's native HTTP API (/generate, /update_weights_from_disk, "
                    "/pause_generation, ...) with continuous batching on CPU or CUDA. Flags are named like "
                    "sglang.launch_server's.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-path", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: --model-path)")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="no tokenizer: input_ids only, no 'text' in outputs")
    p.add_argument("--host", default=d.host, help="bind address")
    p.add_argument("--port", type=int, default=d.base_port, help="port (0 = pick a free one; printed on the ready line)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="compute device")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="parameter dtype")
    p.add_argument("--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int,
                   default=d.max_batch_size, help="most sequences decoded together (KV-cache slots)")
    p.add_argument("--context-length", type=int, default=d.context_length,
                   help="longest prompt + response (0 = the model's max_position_embeddings)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="most prompt tokens in one batched prefill")
    p.add_argument("--batch-wait-ms", type=float, default=d.batch_wait_ms,
                   help="when idle, wait this long for concurrent requests to share the first prefill")
    p.add_argument("--threads", type=int, default=d.threads, help="torch intra-op threads (CPU)")
    p.add_argument("--weight-version", default="default", help="initial weight version (SGLang's --weight-version)")
    p.add_argument("--random-seed", type=int, default=0, help="sampling RNG seed")
    p.add_argument("--logprobs", default=d.logprobs, choices=("original", "scaled"),
                   help="original: log_softmax(logits) (what the learner recomputes; SGLang with "
                        "SGLANG_RETURN_ORIGINAL_LOGPROB=1); scaled: log_softmax(logits / temperature) (SGLang default)")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="largest sampling_params.n (400 above)")
    p.add_argument("--max-queued-tokens", type=int, default=0,
                   help="most prompt + max_new_tokens tokens waiting for a slot; a request past it gets 503 "
                        "(0 = 16 x --max-batch-size x context length)")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="largest request body (413 above)")
    p.add_argument("--http-read-timeout-s", type=float, default=60.0,
                   help="a request body must arrive within this (408 otherwise)")
    p.add_argument("--http-idle-timeout-s", type=float, default=75.0,
                   help="close a connection that sends no complete request for this long (slow clients included)")
    p.add_argument("--weight-load-timeout-s", type=float, default=d.weight_load_timeout_s,
                   help="/update_weights_from_disk: reading and checking the checkpoint must finish within this")
    p.add_argument("--bind-protection", default="", choices=("", *BIND_PROTECTIONS),
                   help="required when --host is not a loopback address: how the port is protected "
                        "(the control API has no authentication), as engine.bind_protection")
    p.add_argument("--imitate-sglang", action="store_true",
                   help="test mode: behave as real SGLang 0.5.23 does where it differs (slow /health that blocks "
                        "while paused or loading, 400 after a load whose cache flush is refused, meta_info."
                        "weight_versions, /metrics only with --enable-metrics, no /get_weight_version)")
    p.add_argument("--enable-metrics", action="store_true", help="--imitate-sglang: serve /metrics (as SGLang's flag)")
    p.add_argument("--refuse-flush", action="store_true",
                   help="test mode: every post-load cache flush is refused (SGLang answers 400 with the new weights live)")
    p.add_argument("--log-level", default="info", help="logging level")
    return p


async def _serve(args: argparse.Namespace) -> None:
    import torch

    from common.modeling import load_model, load_tokenizer

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    torch.set_num_threads(max(1, args.threads))
    t0 = time.time()
    log.info("loading %s (%s, %s)", args.model_path, args.device, args.dtype)
    model = load_model(args.model_path, dtype=args.dtype, device=args.device)
    tok_path = args.tokenizer_path or args.model_path
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(tok_path)
    eos: set[int] = set()
    for src in (model.config, getattr(model, "generation_config", None)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        eos.update([e] if isinstance(e, int) else list(e or []))
    metrics = Metrics("engine")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_death(e: BaseException) -> None:  # engine thread: a dead engine must not serve 503 forever
        loop.call_soon_threadsafe(stop.set)

    engine = Engine(model, max_batch_size=args.max_batch_size, context_length=args.context_length,
                    weight_version=args.weight_version, eos_token_ids=eos, seed=args.random_seed,
                    scaled_logprobs=args.logprobs == "scaled", batch_wait_ms=args.batch_wait_ms,
                    metrics=metrics, max_prefill_tokens=args.max_prefill_tokens,
                    max_queued_tokens=args.max_queued_tokens, on_death=on_death)
    server = Server(engine, tokenizer, args.model_path, tok_path, metrics, max_n=args.max_n,
                    weight_load_timeout_s=args.weight_load_timeout_s, imitate_sglang=args.imitate_sglang,
                    enable_metrics=args.enable_metrics, refuse_flush=args.refuse_flush)
    gc.freeze()  # the model, tokenizer and imports never become garbage: keep them out of every GC pass
    # handler_cancellation: a client that disconnects (or times out) cancels its handler, which aborts its
    # sequences so they stop holding KV-cache slots. keepalive_timeout also closes a connection that never
    # completes a request (aiohttp arms it at connect), which is what ends a slow-loris client.
    runner = web.AppRunner(server.app(args.max_body_bytes, args.http_read_timeout_s), access_log=None,
                           handler_cancellation=True, keepalive_timeout=args.http_idle_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"rollout_server ready on http://{args.host}:{port} model={args.model_path} params={n_params} "
          f"device={args.device} slots={args.max_batch_size} context={engine.context_length} "
          f"weight_version={engine.weight_version} load_s={time.time() - t0:.1f}", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(runner.cleanup(), 10.0)
    engine.shutdown()
    if engine.error is not None:
        raise EngineDied(f"engine thread died: {type(engine.error).__name__}: {engine.error}")


class EngineDied(RuntimeError):
    pass


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not is_loopback_host(args.host) and not args.bind_protection:
        raise SystemExit(f"rollout_server: --host {args.host} is not a loopback address and the engine's control API "
                         f"(/update_weights_from_disk, /pause_generation, ...) has no authentication; bind 127.0.0.1, "
                         f"or state how the port is protected with --bind-protection "
                         f"{{{','.join(BIND_PROTECTIONS)}}} (config key engine.bind_protection)")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.max_batch_size < 1:
        raise SystemExit("--max-batch-size must be >= 1")
    for flag, path in (("--model-path", args.model_path), ("--tokenizer-path", args.tokenizer_path)):
        if path is not None and not (Path(path) / "config.json" if flag == "--model-path" else Path(path)).exists():
            raise SystemExit(f"rollout_server: {flag} {path!r} is not an HF model directory (no config.json); "
                             f"build the embedded base with `python -m learner.sft` or pass an existing checkpoint")
    try:
        asyncio.run(_serve(args))
    except (OSError, RuntimeError, ValueError) as e:
        raise SystemExit(f"rollout_server: {e}") from e
    finally:
        # A weight read stuck in a daemon thread (or in the kernel) must not hold the exit: interpreter
        # shutdown would wait on nothing else, but flush what the logs hold first.
        logging.shutdown()


if __name__ == "__main__":
    main()
