"""Weight updates over a process group: SGLang 0.5.23's ``/init_weights_update_group``,
``/begin_weight_update``, ``/update_weights_from_distributed``, ``/end_weight_update`` and
``/destroy_weights_update_group``, over gloo on CPU.

Fields, defaults and answers follow SGLang's ``io_struct.py`` (``InitWeightsUpdateGroupReqInput``:
``master_address, master_port, rank_offset, world_size, group_name="weight_update_group",
backend="nccl"``; ``UpdateWeightsFromDistributedReqInput``: ``names, dtypes, shapes, group_name,
flush_cache=True, abort_all_requests=False, weight_version=None, load_format=None``) and its
``http_server.py`` (200 ``{"success": true, "message"}``, 400 with ``success: false``). This engine is one
rank (SGLang's ``rank_offset + tp_rank`` with tp 1); ``backend`` ``nccl`` is taken as gloo on a CPU engine.
``load_format`` ``None`` receives one broadcast per tensor, ``"flattened_bucket"`` one broadcast of the
whole bucket (``common.weight_bucket`` has the layout).

Sessions, as SGLang's ``weight_updater.py``: ``/update_weights_from_distributed`` runs only between
``/begin_weight_update`` and ``/end_weight_update`` (outside one: 400 ``NOT_IN_SESSION`` and no receive is
posted, so a sender's broadcast is left unmatched until its group times out); a second begin answers 400
``SESSION_ALREADY_OPEN``, an end without a session 400 ``NO_SESSION``; generation keeps running inside a
session. Begin and end take the same lock as an update (with ``--imitate-sglang`` they also wait for the
running requests while generation is not paused: SGLang's model-update writer lock).

Order of events per call, as in SGLang: ``abort_all_requests``, then the session check, then the tensors
are received (always, once the group exists, so that the sender's collective is never left unmatched by a
later refusal), checked against the served model (shapes, finite values; a name the model does not have is
skipped with a log line and the call still succeeds, as SGLang's loader does) and installed between two
decode steps; ``weight_version``, when given, moves with them. With ``flush_cache`` the cache flush follows
(``--imitate-sglang``: refused while requests run or wait; always with ``--refuse-flush``): refused, the
call answers 400 ``FLUSH_REFUSED`` with the weights and the scheduler's version installed and
``/model_info``'s version unmoved, as the disk load does. Locking: while generation is paused (``in_place`` or ``retract``) the bucket applies at
once and the paused requests continue on it; otherwise it waits for the running requests to finish on the
old weights (new ones wait behind it). SGLang takes that wait *before* it receives (its model-update
writer lock), so a non-paused engine blocks the sender until it drains; the SGLang imitation mode does the
same, while this server by default receives at once and drains afterwards, never holding up the sender.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from typing import Any

import torch
from aiohttp import web

from actors.rollout_server.body import BadRequest, check_text, json_body, validation_error
from actors.rollout_server.control import FLUSH_REFUSED, ControlEndpoints
from common.weight_bucket import (
    DEFAULT_GROUP,
    FLATTENED_BUCKET,
    Group,
    all_finite,
    empty_bucket,
    new_group,
    parse_dtype,
    unflatten,
)

log = logging.getLogger("vapo.rollout_server")

MAX_TENSORS = 1 << 20  # names in one update request
GROUP_TIMEOUT_S = 600.0  # SGLang uses torch's default; bounded here so a dead sender frees the engine
# SGLang 0.5.23's answers, word for word (scheduler_components/weight_updater.py).
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
NOT_IN_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
SELECTORS = ("target", "draft", "all")  # BeginWeightUpdateReqInput.selector; one model here, all the same


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise BadRequest(f"{key}: Input should be a valid boolean")
    return v


def _str(body: dict[str, Any], key: str, default: str | None) -> str | None:
    v = body.get(key, default)
    if v is not None and not isinstance(v, str):
        raise BadRequest(f"{key}: Input should be a valid string")
    if isinstance(v, str):
        check_text(v, key)
    return v


def _int(body: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = body.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key}: Field required (an integer)")
    if not lo <= v <= hi:
        raise BadRequest(f"{key}: {v} is outside [{lo}, {hi}]")
    return v


def parse_update(body: dict[str, Any]) -> dict[str, Any]:
    """The fields of an ``/update_weights_from_distributed`` body, type-checked; BadRequest otherwise."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    for key, v in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(v, list):
            raise BadRequest(f"{key}: Field required (a list)")
        if len(v) > MAX_TENSORS:
            raise BadRequest(f"{key}: more than {MAX_TENSORS} entries")
    assert isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
    if not len(names) == len(dtypes) == len(shapes) or not names:
        raise BadRequest("names, dtypes and shapes must be non-empty lists of one length")
    if not all(isinstance(n, str) for n in names):
        raise BadRequest("names: Input should be a list of strings")
    for d in dtypes:
        try:
            parse_dtype(d)
        except ValueError as e:
            raise BadRequest(f"dtypes: {e}") from None
    if not all(isinstance(s, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 40
                                           for x in s) for s in shapes):
        raise BadRequest("shapes: Input should be a list of lists of non-negative integers")
    version = body.get("weight_version")
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    body = {**body, "weight_version": version}
    load_format = _str(body, "load_format", None)
    if load_format not in (None, FLATTENED_BUCKET):
        raise BadRequest(f"load_format: {load_format!r} is not supported (None | {FLATTENED_BUCKET})")
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "load_format": load_format,
            "group_name": _str(body, "group_name", DEFAULT_GROUP), "weight_version": _str(body, "weight_version", None),
            "flush_cache": _bool(body, "flush_cache", True), "abort_all_requests": _bool(body, "abort_all_requests", False)}


class DistributedUpdates:
    """The engine's weight-update groups and the three endpoints that use them."""

    def __init__(self, server: ControlEndpoints) -> None:
        # The server's control half (``http.Server`` mixes it in) declares all this reads: typing against
        # it, not against ``http.Server``, keeps this module from importing http back.
        self.server = server
        self.groups: dict[str, Group] = {}
        self._lock = threading.Lock()
        self.session: str | None = None  # the open weight-update session's selector

    def routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/init_weights_update_group", self.init_group)
        router.add_post("/begin_weight_update", self.begin_session)
        router.add_post("/end_weight_update", self.end_session)
        router.add_post("/update_weights_from_distributed", self.update)
        router.add_post("/destroy_weights_update_group", self.destroy_group)
        router.add_get("/weights_digest", self.digest)

    def _answer(self, endpoint: str, ok: bool, msg: str) -> web.Response:
        (log.info if ok else log.warning)("%s: %s", endpoint, msg)
        return web.json_response({"success": ok, "message": msg}, status=200 if ok else 400)

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request)
            addr = _str(body, "master_address", None)
            if not addr:
                raise BadRequest("master_address: Field required")
            port = _int(body, "master_port", 1, 65535)
            world = _int(body, "world_size", 2, 1 << 16)
            rank = _int(body, "rank_offset", 1, world - 1)  # rank 0 is the sender's
            name = _str(body, "group_name", DEFAULT_GROUP) or ""
            if not name:
                raise BadRequest("group_name: Group name cannot be empty")
            backend = _str(body, "backend", "nccl")
            if backend not in ("nccl", "gloo"):
                raise BadRequest(f"backend: {backend!r} (nccl | gloo)")
        except BadRequest as e:
            self.server.metrics.bad_requests.labels(endpoint="init_weights_update_group").inc()
            return validation_error(str(e))
        self.server._control(request, f"{addr}:{port} rank {rank}/{world} group {name}")
        self._drop(name)  # a rebuilt group (after a member restarted) replaces the old one

        def join() -> Group:
            return new_group("gloo", addr, port, rank, world, name, GROUP_TIMEOUT_S)

        try:
            group = await asyncio.to_thread(join)
        except Exception as e:
            return self._answer("init_weights_update_group", False, f"Failed to initialize custom process group: {e}.")
        with self._lock:
            self.groups[name] = group
        return self._answer("init_weights_update_group", True, "Succeeded to initialize custom process group.")

    def _drop(self, name: str) -> bool:
        with self._lock:
            group = self.groups.pop(name, None)
        if group is not None:
            group.close()
        return group is not None

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request, required=False)
            name = _str(body, "group_name", DEFAULT_GROUP) or ""
        except BadRequest as e:
            return validation_error(str(e))
        self.server._control(request, f"group {name}")
        if not self._drop(name):
            return self._answer("destroy_weights_update_group", False, f"Group {name} not in {sorted(self.groups)}.")
        return self._answer("destroy_weights_update_group", True, "Succeeded to destroy custom process group.")

    async def _writer_wait(self) -> None:
        """SGLang's model-update writer lock (imitation only): while generation is not paused, nothing of a
        weight update starts before the running requests have finished."""
        srv = self.server
        if srv.imitate_sglang and srv.scheduler.paused is None:
            await asyncio.wrap_future(srv.scheduler.apply_weights({}, None))

    async def begin_session(self, request: web.Request) -> web.Response:
        try:
            body = await json_body(request, required=False)
            selector = _str(body, "selector", "all")
            if selector not in SELECTORS:
                raise BadRequest(f"selector: Input should be 'target', 'draft' or 'all', got {selector!r}")
        except BadRequest as e:
            self.server.metrics.bad_requests.labels(endpoint="begin_weight_update").inc()
            return validation_error(str(e))
        self.server._control(request, f"selector={selector}")
        async with self.server._update_lock:
            await self._writer_wait()
            if self.session is not None:
                return self._answer("begin_weight_update", False, SESSION_ALREADY_OPEN)
            self.session = selector
        return self._answer("begin_weight_update", True, "Success")

    async def end_session(self, request: web.Request) -> web.Response:
        try:
            await json_body(request, required=False)
        except BadRequest as e:
            self.server.metrics.bad_requests.labels(endpoint="end_weight_update").inc()
            return validation_error(str(e))
        self.server._control(request)
        async with self.server._update_lock:
            await self._writer_wait()
            if self.session is None:
                return self._answer("end_weight_update", False, NO_SESSION)
            self.session = None
        return self._answer("end_weight_update", True, "Success")

    async def update(self, request: web.Request) -> web.Response:
        srv = self.server
        try:
            req = parse_update(await json_body(request))
        except BadRequest as e:
            srv.metrics.bad_requests.labels(endpoint="update_weights_from_distributed").inc()
            return validation_error(str(e))
        srv._control(request, f"{len(req['names'])} tensors, version {req['weight_version']}")
        if req["abort_all_requests"]:  # SGLang's tokenizer manager aborts before anything else
            await asyncio.wrap_future(srv.scheduler.abort(None, "Aborted for a weight update."))
        t0 = time.perf_counter()
        async with srv._update_lock:
            await self._writer_wait()  # no receive before the running requests have finished (imitation)
            if self.session is None:  # no receive posted: the sender's broadcast stays unmatched
                return self._answer("update_weights_from_distributed", False, NOT_IN_SESSION)
            group = self.groups.get(req["group_name"])
            if group is None:
                return self._answer("update_weights_from_distributed", False,
                                    f"Group {req['group_name']} not in {sorted(self.groups)}. "
                                    "Please call `init_weights_update_group` first.")
            try:
                named = await asyncio.to_thread(self._receive, group, req)
            except Exception as e:  # the group is unusable after a failed collective
                self._drop(req["group_name"])
                srv.metrics.weight_updates.labels(status="failed").inc()
                return self._answer("update_weights_from_distributed", False,
                                    f"Failed to receive weights from the group: {e}. The group is destroyed.")
            ok, msg, named = self._check(named)
            if ok:
                ok, msg = await asyncio.wrap_future(srv.scheduler.apply_weights(dict(named), req["weight_version"]))
            if ok and req["flush_cache"] and not await self._flushed():
                # SGLang: installed (weights and the scheduler's version), but the call fails; /model_info's
                # version stays where it was.
                srv.metrics.weight_updates.labels(status="ok").inc()
                return self._answer("update_weights_from_distributed", False, FLUSH_REFUSED)
            if ok and req["weight_version"] is not None:
                srv.tm_weight_version = srv.scheduler.weight_version
                msg += f" Weight version updated to {req['weight_version']}."
        srv.metrics.weight_updates.labels(status="ok" if ok else "failed").inc()
        log.debug("update_weights_from_distributed: %d tensors in %.3f s", len(named), time.perf_counter() - t0)
        return self._answer("update_weights_from_distributed", ok, msg)

    async def _flushed(self) -> bool:
        """The cache flush after an update: refused with ``--refuse-flush``, and with ``--imitate-sglang``
        while requests run or wait (there is no prefix cache here otherwise, so nothing to flush)."""
        srv = self.server
        return not (srv.refuse_flush or srv.imitate_sglang and not await asyncio.wrap_future(srv.scheduler.flush_cache()))

    @staticmethod
    def _receive(group: Group, req: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        if req["load_format"] == FLATTENED_BUCKET:
            buf = empty_bucket(req["dtypes"], req["shapes"])
            group.broadcast(buf)
            return unflatten(buf, req["names"], req["dtypes"], req["shapes"])
        out = []
        for name, dt, shape in zip(req["names"], req["dtypes"], req["shapes"], strict=True):
            t = torch.empty(shape, dtype=parse_dtype(dt))
            group.broadcast(t)
            out.append((name, t))
        return out

    def _check(self, named: list[tuple[str, torch.Tensor]]) -> tuple[bool, str, list[tuple[str, torch.Tensor]]]:
        """(ok, message, the tensors to install). A name the served model does not have is skipped with one
        log line, as SGLang's loader does (the call succeeds and the version moves: the sender must check
        its names). SGLang raises on a shape it cannot copy and then reports the model partially updated;
        here nothing is installed unless every known tensor fits and is finite."""
        live = self.server.scheduler.weights.params
        unknown = [name for name, _ in named if name not in live]
        if unknown:
            log.warning("update_weights_from_distributed: %d names the served model does not have, skipped: %s",
                        len(unknown), unknown[:5])
        known = [(name, t) for name, t in named if name in live]
        for name, t in known:
            p = live[name]
            if tuple(t.shape) != tuple(p.shape):
                return False, f"Failed to update parameter online: shape of {name} is {tuple(t.shape)}, served {tuple(p.shape)}.", []
            if not all_finite(t):
                return False, f"Failed to update parameter online: {name} holds NaN or Inf values.", []
        return True, "Succeeded to update parameter online.", known

    async def digest(self, request: web.Request) -> web.Response:
        """Extension (not in SGLang): sha256 over the served parameters, in sorted name order (name, NUL,
        raw bytes), computed between two decode steps; benchmarks and tests compare it with the same digest
        of a published version (``param_digest``) to show an update landed byte for byte."""
        sched = self.server.scheduler
        digest = await asyncio.wrap_future(sched.call(lambda: param_digest(
            dict(sched.model.named_parameters()).items())))
        return web.json_response({"sha256": digest, "weight_version": sched.weight_version})

    def close(self) -> None:
        for name in list(self.groups):
            self._drop(name)


def param_digest(named: Any) -> str:
    """sha256 over ``(name, tensor)`` pairs in sorted name order: name, NUL, the tensor's raw bytes."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(b"\0")
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


__all__ = ["DistributedUpdates", "param_digest", "parse_update"]
