"""Asyncio client for SGLang's native HTTP API: the only code in vapo that knows the endpoints.

Used unchanged against real SGLang servers (``python -m sglang.launch_server``) and against
``python -m actors.rollout_server``:

    async with SGLangClient("http://127.0.0.1:30000") as c:
        outs = await c.generate([[5, 6, 7]], {"temperature": 1.0, "max_new_tokens": 64, "n": 8})
        await c.update_weights_from_disk("runs/x/weights/v3", weight_version=3)

Field names follow SGLang's ``io_struct.py`` / ``http_server.py`` (shapes in
``tests/actors/fixtures/sglang_api.json``). Errors raise ``SGLangError`` carrying the HTTP status and the
server's own message, whichever of SGLang's two error shapes it used.

Weight versions: SGLang's ``weight_version`` is a string; vapo sends ``str(int)`` and parses it back
(``common.sglang_output``, which reads a /generate answer into ``GenerateOutput``; re-exported here).

Real SGLang 0.5.23 behaviours this client allows for (read in its ``entrypoints/http_server.py``,
``managers/tokenizer_manager.py`` and ``scheduler_components/weight_updater.py``):
- ``/health`` and ``/health_generate`` are one handler: a one-token generation polled once a second, 200
  after >= 1 s, 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s); while generation is paused or weights load,
  the probe cannot run and fails. ``health()`` therefore waits ``timeout_s`` (30 s by default) and callers
  do not probe an engine they have paused themselves.
- ``/update_weights_from_disk`` answers 400 when the cache flush after a completed load is refused: the
  new weights and the scheduler's version are live, while ``/model_info``'s ``weight_version`` (the
  tokenizer manager's) is not moved. ``served_weight_version()`` asks the scheduler (a one-token
  generation's ``meta_info.weight_version``), which is what the worker checks after such a 400.
- ``/get_model_info`` is deprecated for ``/model_info``; there is no ``/get_weight_version``.
- ``/update_weights_from_distributed`` (and ``/update_weights_from_tensor``) run only inside a weight-update
  session: ``begin_weight_update()`` first, ``end_weight_update()`` after the last one. Outside it the
  update answers 400 (``NOT_IN_SESSION``) and posts no receive, so a sender's broadcast would block until
  its group times out. A second begin answers 400 (``SESSION_ALREADY_OPEN``), an end without one 400
  (``NO_SESSION``). Generation keeps running inside a session; ``/update_weights_from_disk`` needs none.
- An update whose cache flush is refused (requests running or queued, e.g. paused ``in_place``) answers
  400 with ``FLUSH_REFUSED`` although its weights *and* its ``weight_version`` were installed
  (``cache_flush_refused``).
- Names an update does not know are accepted (200, one server log line, the version moves anyway): the
  caller must check the names it sends against the served model.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp

from common.sglang_output import GenerateOutput, as_int, as_version, parse_generate_response, parse_output

# SGLang 0.5.23's own answers (scheduler_components/weight_updater.py), matched by these prefixes.
SESSION_ALREADY_OPEN = "a weight-update session is already open"
NO_SESSION = "no weight-update session is open"
NOT_IN_SESSION = "must run between begin_weight_update() and end_weight_update()"
FLUSH_REFUSED = "Weights were updated, but the cache was not flushed"

KEEPALIVE_S = 3.0  # under SGLang's uvicorn keep-alive of 5 s


class SGLangError(RuntimeError):
    """An SGLang endpoint answered with an error (or not at all)."""

    def __init__(self, endpoint: str, status: int | None, message: str, body: Any = None) -> None:
        super().__init__(f"{endpoint}: HTTP {status}: {message}" if status is not None else f"{endpoint}: {message}")
        self.endpoint = endpoint
        self.status = status
        self.message = message
        self.body = body


def cache_flush_refused(e: SGLangError) -> bool:
    """The update behind ``e`` installed its weights and version; only the cache flush after it was refused."""
    return e.status == 400 and FLUSH_REFUSED in e.message


def session_already_open(e: SGLangError) -> bool:
    """``begin_weight_update`` was refused because a session is open already."""
    return e.status == 400 and SESSION_ALREADY_OPEN in e.message


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building/parsing large JSON: json allocates no cycles, and with many live
    objects in the process each collection pass would cost more than the parse itself (20x on 1.6 MB)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def error_message(body: Any, text: str = "") -> str:
    """The message of either SGLang error shape ({"error": {"message"}} or ErrorResponse{"message"})."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return text.strip() or "(empty response)"


class SGLangClient:
    """One engine's native API. Safe to share between tasks of one event loop."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 session: aiohttp.ClientSession | None = None, control_timeout_s: float = 60.0,
                 api_key: str | None = None) -> None:
        """``timeout_s``: deadline of /generate and weight updates; ``control_timeout_s``: of every other
        request (pause, continue, abort, flush, model info). No request goes without one: an engine that
        stops answering (SIGSTOPped, a hung HTTP loop) must fail its caller, never hold it forever.
        ``api_key``: sent as ``Authorization: Bearer`` on every request (SGLang's ``--api-key`` or
        ``--admin-api-key``; endpoints that need none ignore it)."""
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection cap: many concurrent /generate calls are how the engine's batches stay full.
            # Idle connections are let go before SGLang's own keep-alive (5 s, SGLANG_TIMEOUT_KEEP_ALIVE) closes
            # them: a request sent on one the server just closed fails with "Server disconnected".
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S), timeout=self.timeout)
            self._own_session = True
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None and not self._session.closed:
            await self._session.close()

    async def _request(self, method: str, endpoint: str, payload: Any = None,
                       timeout_s: float | None = None, ok_statuses: tuple[int, ...] = (200,)) -> tuple[int, Any, str]:
        url = f"{self.base_url}/{endpoint}"
        # aiohttp reads timeout=None as "no deadline at all": an absent timeout_s means the client's own.
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, self.connect_timeout_s))
        try:
            async with self._sess().request(method, url, json=payload, timeout=timeout, headers=self.headers) as resp:
                raw = await resp.read()
                text = raw.decode("utf-8", errors="replace")
                try:
                    with gc_paused():
                        body = json.loads(raw) if text.strip() else None
                except ValueError:
                    body = None
                if resp.status not in ok_statuses:
                    raise SGLangError(endpoint, resp.status, error_message(body, text), body)
                return resp.status, body, text
        except TimeoutError as e:
            raise SGLangError(endpoint, None, f"timed out after {timeout_s} s") from e
        except aiohttp.ClientError as e:
            raise SGLangError(endpoint, None, f"cannot reach {url}: {e}") from e

    # ------------------------------------------------------------------ generation

    async def generate(self, input_ids: list[list[int]] | list[int], sampling_params: dict[str, Any] | list[dict[str, Any]],
                       return_logprob: bool = True, rid: str | list[str] | None = None,
                       timeout_s: float | None = None) -> list[GenerateOutput]:
        """Generate for one prompt or a batch; with ``n`` in sampling_params, n samples per prompt, prompt-major."""
        if not input_ids:
            raise ValueError("input_ids is empty")
        payload: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params,
                                   "return_logprob": return_logprob}
        if rid is not None:
            payload["rid"] = rid
        _, body, _ = await self._request("POST", "generate", payload, timeout_s)
        try:
            with gc_paused():
                outs = parse_generate_response(body)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise SGLangError("generate", 200, f"unexpected response shape: {e}", body) from e
        n = (sampling_params.get("n") or 1) if isinstance(sampling_params, dict) else (sampling_params[0].get("n") or 1)
        expected = (1 if isinstance(input_ids[0], int) else len(input_ids)) * n
        if len(outs) != expected:
            raise SGLangError("generate", 200, f"expected {expected} outputs, got {len(outs)}", body)
        return outs

    # ------------------------------------------------------------------ weights and control

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,
                                       abort_all_requests: bool = False, load_format: str | None = None,
                                       timeout_s: float | None = None) -> str:
        """Load new weights; returns the server's message, raises SGLangError (with it) on failure."""
        payload: dict[str, Any] = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)  # SGLang's field is Optional[str]
        if load_format is not None:
            payload["load_format"] = load_format
        status, body, text = await self._request("POST", "update_weights_from_disk", payload, timeout_s,
                                                 ok_statuses=(200, 400))
        if not isinstance(body, dict) or not body.get("success"):
            raise SGLangError("update_weights_from_disk", status, error_message(body, text), body)
        return str(body.get("message", ""))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl", timeout_s: float | None = None) -> str:
        """Join the learner's weight-update process group (blocks until every member has joined)."""
        return await self._success("init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}, timeout_s)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              weight_version: int | str | None = None, flush_cache: bool = True,
                                              abort_all_requests: bool = False,
                                              load_format: str | None = "flattened_bucket",
                                              group_name: str = "weight_update_group",
                                              timeout_s: float | None = None) -> str:
        """Receive one broadcast from the group's rank 0 (a flattened bucket by default) and load it; only
        inside a weight-update session (``begin_weight_update``). A 400 that ``cache_flush_refused`` says the
        weights and ``weight_version`` were installed all the same."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
                                   "load_format": load_format}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._success("update_weights_from_distributed", payload, timeout_s)

    async def begin_weight_update(self, timeout_s: float | None = None) -> str:
        """Open the engine's weight-update session (``{}`` = SGLang's ``selector: "all"``); returns its message.

        SGLangError with status 400 and ``SESSION_ALREADY_OPEN`` when one is open. While generation is not
        paused SGLang first waits for the running requests (its model-update writer lock), so the default
        deadline is the client's ``timeout_s`` (a generation's), not the control deadline."""
        return await self._success("begin_weight_update", {}, timeout_s)

    async def end_weight_update(self, timeout_s: float | None = None) -> str:
        """Close the weight-update session (SGLang then finalises the loaded weights); returns its message.
        SGLangError with status 400 and ``NO_SESSION`` when none is open. Deadline as ``begin_weight_update``."""
        return await self._success("end_weight_update", {}, timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> str:
        return await self._success("destroy_weights_update_group", {"group_name": group_name}, self.control_timeout_s)

    async def _success(self, endpoint: str, payload: dict[str, Any], timeout_s: float | None) -> str:
        status, body, text = await self._request("POST", endpoint, payload, timeout_s, ok_statuses=(200, 400))
        if not isinstance(body, dict) or not body.get("success"):
            raise SGLangError(endpoint, status, error_message(body, text), body)
        return str(body.get("message", ""))

    async def pause_generation(self, mode: str = "abort") -> None:
        """SGLang modes: abort (abort in-flight requests), retract, in_place (keep them, KV cache kept)."""
        await self._request("POST", "pause_generation", {"mode": mode}, self.control_timeout_s)

    async def continue_generation(self) -> None:
        await self._request("POST", "continue_generation", {}, self.control_timeout_s)

    async def flush_cache(self) -> bool:
        """True when flushed; False when the server refused because requests are running or waiting."""
        status, _, _ = await self._request("POST", "flush_cache", None, self.control_timeout_s, ok_statuses=(200, 400))
        return status == 200

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._request("POST", "abort_request", {"rid": rid, "abort_all": abort_all}, self.control_timeout_s)

    # ------------------------------------------------------------------ introspection

    async def health(self, timeout_s: float = 30.0) -> bool:
        try:
            await self._request("GET", "health", timeout_s=timeout_s)
            return True
        except SGLangError:
            return False

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            await self._request("GET", "health_generate", timeout_s=timeout_s)
            return True
        except SGLangError:
            return False

    async def model_info(self, timeout_s: float | None = None) -> dict[str, Any]:
        """``/model_info``; ``/get_model_info`` (its deprecated name) only on a server without it."""
        timeout_s = self.control_timeout_s if timeout_s is None else timeout_s
        try:
            _, body, _ = await self._request("GET", "model_info", timeout_s=timeout_s)
        except SGLangError as e:
            if e.status != 404:
                raise
            _, body, _ = await self._request("GET", "get_model_info", timeout_s=timeout_s)
        if not isinstance(body, dict):
            raise SGLangError("model_info", 200, f"not a JSON object: {str(body)[:200]}", body)
        return body

    get_model_info = model_info

    async def get_weight_version(self) -> str | None:
        """The tokenizer manager's weight version (``/model_info``): the one set by the last successful update."""
        v = (await self.model_info()).get("weight_version")
        return None if v is None else str(v)

    async def get_weight_version_route(self, timeout_s: float | None = None) -> str | None:
        """``/get_weight_version``: the scheduler's version, where the server has the route (rollout_server,
        SGLang before 0.5.23; 0.5.23 answers 404)."""
        timeout_s = self.control_timeout_s if timeout_s is None else timeout_s
        _, body, _ = await self._request("GET", "get_weight_version", timeout_s=timeout_s)
        v = body.get("weight_version") if isinstance(body, dict) else None
        return None if v is None else str(v)

    async def served_weight_version(self, timeout_s: float | None = 60.0) -> str | None:
        """The version the scheduler generates with: one greedy token, its ``meta_info.weight_version``.
        After an update that answered 400 this is the truth, not ``/model_info``."""
        outs = await self.generate([0], {"max_new_tokens": 1, "temperature": 0.0}, return_logprob=False,
                                   timeout_s=timeout_s)
        return outs[0].weight_version

    async def wait_healthy(self, timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        """Poll /health until it answers 200; SGLangError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if await self.health(timeout_s=min(30.0, max(0.1, deadline - time.monotonic()))):
                return
            if time.monotonic() >= deadline:
                raise SGLangError("health", None, f"{self.base_url} not healthy after {timeout_s} s")
            await asyncio.sleep(poll_s)


__all__ = [
    "FLUSH_REFUSED", "KEEPALIVE_S", "NOT_IN_SESSION", "NO_SESSION", "SESSION_ALREADY_OPEN", "GenerateOutput",
    "SGLangClient", "SGLangError", "as_int", "as_version", "cache_flush_refused", "error_message", "gc_paused",
    "parse_generate_response", "parse_output", "session_already_open",
]
