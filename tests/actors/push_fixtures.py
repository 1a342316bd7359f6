"""A worker's side of the distributed weight push, for tests: an ``EngineLink`` to a real rollout_server
reached as an external engine (as a worker holds it), the weights a push should leave an engine serving,
an asynchronous poll with a deadline, and a disk load that survives SGLang's refused flush (no tests here)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from actors.engine_link import EngineLink
from actors.rollout_server.dist_update import param_digest
from actors.weight_watcher import WeightWatcher
from common.config import Config, load_config
from common.generation.weights import read_state_dict
from common.metrics import Metrics
from common.modeling import load_model
from common.sglang_client import SGLangClient, SGLangError, cache_flush_refused
from learner.weights import write_version
from tests.sockdirs import socket_dir


class Owner:
    """The worker's side of a link: nothing to record, never stopping."""

    def engine_changed(self) -> None:
        pass

    def stopping(self) -> bool:
        return False


def member_config(model_dir: Path, urls: list[str], *extra: str) -> Config:
    """Workers of engines at ``urls`` (``engine.kind=external``, actor ``i`` on ``urls[i]``) in a distributed run."""
    return load_config(None, [f"model.path={model_dir}", "engine.kind=external", f"engine.urls=[{','.join(urls)}]",
                              "metrics.prometheus=false", "learner.weight_transport=distributed", *extra])


async def connected_link(cfg: Config, actor_id: int) -> EngineLink:
    """Actor ``actor_id``'s link, connected to its engine with its gate open (as the worker leaves it). Its
    watcher hears only ``offer()`` (no learner at its sockets)."""
    sockets = socket_dir("vp")
    watcher = WeightWatcher(f"ipc://{sockets}/pub", f"ipc://{sockets}/query", query_timeout_s=0.2)
    link = EngineLink(cfg, actor_id, watcher, Owner(), Metrics("actor"), generate_timeout_s=60.0)
    await link.connect()
    link.gate.set()
    return link


async def until(cond: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition") -> Any:
    """Poll ``cond()`` on the event loop until it is truthy and return it; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (v := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.02)  # the poll interval, not synchronisation: cond() decides
    return v


async def load_from_disk(c: SGLangClient, path: str | Path, version: int, timeout_s: float = 60.0) -> None:
    """``update_weights_from_disk``, flushed. SGLang counts a request that has just answered as running until
    its scheduler's next step, so a load posted right after a generation can answer 400 "cache was not
    flushed" with the weights installed; the flush is then asked for again until the engine takes it."""
    try:
        await c.update_weights_from_disk(str(path), weight_version=version)
    except SGLangError as e:
        if not cache_flush_refused(e):
            raise
        deadline = time.monotonic() + timeout_s
        while not await c.flush_cache():
            assert time.monotonic() < deadline, f"{c.base_url}: cache flush refused for {timeout_s} s after a load"


def perturbed(model_dir: Path, delta: float) -> torch.nn.Module:
    """The base model with every parameter moved by ``delta``: weights no engine serves yet."""
    model = load_model(model_dir).eval()
    bump(model, delta)
    return model


def bump(model: torch.nn.Module, delta: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)


def served_digest(model: torch.nn.Module, root: Path, version: int) -> str:
    """The ``/weights_digest`` an engine reports once it serves ``model`` (through its disk export)."""
    update = write_version(root, version, model, None)
    return param_digest(read_state_dict(update.path).items())


async def engine_digest(c: SGLangClient) -> tuple[str, str]:
    """(sha256 of the served parameters, served weight version) of a rollout_server."""
    _, body, _ = await c._request("GET", "weights_digest", timeout_s=60)
    return body["sha256"], body["weight_version"]


async def distributed_updates(c: SGLangClient) -> int:
    """``/update_weights_from_distributed`` calls a rollout_server took (its control-request counter)."""
    _, _, text = await c._request("GET", "metrics", timeout_s=30)
    m = re.search(r'vapo_engine_control_requests_total\{endpoint="update_weights_from_distributed",status="ok"\} '
                  r"([0-9.e+]+)", text)
    return int(float(m.group(1))) if m else 0
