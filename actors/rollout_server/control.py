"""Control endpoints of ``actors.rollout_server``: ``/update_weights_from_disk``, ``/pause_generation``,
``/continue_generation``, ``/flush_cache`` and ``/abort_request``, as SGLang 0.5.23 answers them.

These are the requests that change what every client gets (weights, pauses, aborts, the cache), so each
one is logged with its peer and counted in ``control_requests`` (``_control``; ``dist_update.py`` uses it
too). ``ControlEndpoints`` is a mixin of ``http.Server``: the handlers read the server's scheduler,
metrics and update lock, and ``Server.app`` routes them. Checkpoints are read in a thread of their own
within ``--weight-load-timeout-s`` so that a stalled file system never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from aiohttp import web

from actors.rollout_server.body import BadRequest, check_text, json_body, validation_error
from common.generation.sampling import short_repr
from common.generation.scheduler import PAUSE_MODES, Scheduler
from common.metrics import Metrics

log = logging.getLogger("vapo.rollout_server")

FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")  # SGLang's weight_updater message
FLUSH_CACHE_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                    "waiting requests, the operation will not be performed.)\n")


class ControlEndpoints:
    """Weight load, pause, continue, cache flush and abort handlers; mixed into ``http.Server``."""

    # Set by ``http.Server.__init__``; declared (not assigned) here so the handlers type-check on their own.
    scheduler: Scheduler
    metrics: Metrics
    model_path: str
    tm_weight_version: Any
    weight_load_timeout_s: float
    imitate_sglang: bool
    refuse_flush: bool
    _update_lock: asyncio.Lock

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise BadRequest("model_path: Field required (a non-empty string)")
            check_text(path, "model_path")
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str | int) or isinstance(version, bool):
                raise BadRequest("weight_version: Input should be a valid string")
            if isinstance(version, str):
                check_text(version, "weight_version")
            abort_all = body.get("abort_all_requests", False)
            if not isinstance(abort_all, bool):
                raise BadRequest("abort_all_requests: Input should be a valid boolean")
            load_format = body.get("load_format")
            if load_format is not None and not isinstance(load_format, str):
                raise BadRequest("load_format: Input should be a valid string")
        except BadRequest as e:
            self.metrics.bad_requests.labels(endpoint="update_weights_from_disk").inc()
            return validation_error(str(e))
        version = None if version is None else str(version)
        self._control(request, f"model_path={short_repr(path, 200)}")
        async with self._update_lock:
            if load_format not in (None, "auto", "safetensors"):
                ok, msg = False, f"Failed to update weights: load_format {load_format!r} is not supported (auto | safetensors)."
            else:
                if abort_all:
                    await asyncio.wrap_future(self.scheduler.abort(None, "Aborted for a weight update."))
                ok, msg = await self._load(path, version)
                if ok and (self.refuse_flush or self.imitate_sglang and not await asyncio.wrap_future(self.scheduler.flush_cache())):
                    # SGLang flushes its radix cache after a load and answers 400 when the flush is refused,
                    # with the new weights (and the scheduler's version) already live.
                    self.metrics.weight_updates.labels(status="ok").inc()
                    log.warning("update_weights_from_disk %s: loaded, but %s", path, FLUSH_REFUSED)
                    return web.json_response({"success": False, "message": FLUSH_REFUSED, "num_paused_requests": 0},
                                             status=400)
            if ok:
                self.model_path = path
                self.tm_weight_version = self.scheduler.weight_version
                if version is not None:
                    msg += f" Weight version updated to {version}."
        self.metrics.weight_updates.labels(status="ok" if ok else "failed").inc()
        (log.info if ok else log.warning)("update_weights_from_disk %s: %s", path, msg)
        return web.json_response({"success": ok, "message": msg, "num_paused_requests": 0},
                                 status=200 if ok else 400)

    async def _load(self, path: str, version: str | None) -> tuple[bool, str]:
        """Read and validate the checkpoint in a thread of its own, within ``weight_load_timeout_s``, then
        let the scheduler apply it between steps. A read that hangs (a stalled network file system) is
        abandoned: its daemon thread cannot keep the server from answering or from exiting on SIGTERM."""
        loop = asyncio.get_running_loop()
        staged: asyncio.Future = loop.create_future()

        def read() -> None:
            try:
                result: Any = self.scheduler.read_weights(path)
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
        return await asyncio.wrap_future(self.scheduler.apply_weights(sd, version))

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request, required=False)
            mode = body.get("mode", "abort")
            if mode not in PAUSE_MODES:
                raise BadRequest(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        except BadRequest as e:
            self.metrics.bad_requests.labels(endpoint="pause_generation").inc()
            return validation_error(str(e))
        self._control(request, f"mode={mode}")
        await asyncio.wrap_future(self.scheduler.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self._control(request)
        await asyncio.wrap_future(self.scheduler.resume())
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _control(self, request: web.Request, what: str = "", status: str = "ok") -> None:
        """Pauses and aborts change what every client gets: each one is logged with its peer and counted."""
        self.metrics.control_requests.labels(endpoint=request.path.lstrip("/"), status=status).inc()
        (log.info if status == "ok" else log.warning)("%s %s from %s%s", request.path, status, request.remote,
                                                      f" ({what})" if what else "")

    async def flush_cache(self, request: web.Request) -> web.Response:
        self._control(request)
        ok = await asyncio.wrap_future(self.scheduler.flush_cache())
        return web.Response(text=FLUSH_CACHE_TEXT, status=200 if ok else 400)

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
        except BadRequest as e:
            return validation_error(str(e))
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))
        self._control(request, "abort_all" if abort_all else f"rid={short_repr(rid, 80)}")
        if abort_all:
            await asyncio.wrap_future(self.scheduler.abort(None, "Aborted by abort_request."))
        elif isinstance(rid, str) and rid:
            # SGLang matches by prefix so that a batch rid aborts all of its items.
            await asyncio.wrap_future(self.scheduler.abort(None, "Aborted by abort_request.", prefix=rid))
        return web.Response(status=200)


def _resolve(fut: asyncio.Future, value: Any) -> None:
    """Set a future's result unless it is already done (a timed-out or cancelled waiter)."""
    if not fut.done():
        fut.set_result(value)
