"""An engine link on its own, for the tests of it and of its parts: the worker's side of it (``Owner``, which
counts the changes it is told about), a config reaching one engine as ``engine.kind=external``, the link with
a watcher that hears only ``offer()``, its metric samples, a wait on its change notices, and a version only
the engine's own load refuses. No tests here."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file

from actors.engine_link import EngineLink
from actors.weight_watcher import WeightWatcher
from common.checksum import weights_sha256
from common.config import Config, load_config
from common.metrics import Metrics
from common.protocol import WeightUpdate
from tests.sockdirs import socket_dir


class Owner:
    """The worker's side of the link: counts the changes it is told about."""

    def __init__(self) -> None:
        self.changes = 0
        self.stop = False

    def engine_changed(self) -> None:
        self.changes += 1

    def stopping(self) -> bool:
        return self.stop


def link_config(model_dir: Path, url: str, *extra: str) -> Config:
    """One actor reaching the engine at ``url`` as ``engine.kind=external``, without /metrics."""
    return load_config(None, [f"model.path={model_dir}", "engine.kind=external", f"engine.urls=[{url}]",
                              "metrics.prometheus=false", *extra])


def make_link(cfg: Config, owner: Owner) -> tuple[EngineLink, WeightWatcher]:
    """Actor 0's link (not connected) and its watcher, which hears only ``offer()`` (no learner)."""
    sockets = socket_dir("vl")  # no learner there: the watcher only hears offer()
    watcher = WeightWatcher(f"ipc://{sockets}/pub", f"ipc://{sockets}/query", query_timeout_s=0.2)
    return EngineLink(cfg, 0, watcher, owner, Metrics("actor"), generate_timeout_s=30.0), watcher


def sample(link: EngineLink, name: str, **labels: str) -> float | None:
    """The link's series ``vapo_actor_<name>`` for actor 0."""
    return link.metrics.registry.get_sample_value(f"vapo_actor_{name}", {"actor": "0", **labels})


async def until_changed(done: Callable[[], bool], link: EngineLink, timeout_s: float) -> None:
    """Wait (on the link's change notices) until ``done()``; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        left = deadline - time.monotonic()
        assert left > 0, "the link did not get there in time"
        await link.wait_changed(min(left, 1.0))


def misshapen_weights(base: Path, out: Path, version: int) -> WeightUpdate:
    """A version whose checksum is right but one of whose matrices lost a row: only the engine's load fails."""
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            name = next(k for k, v in tensors.items() if v.dim() == 2)
            tensors[name] = tensors[name][:-1].contiguous()
            save_file(tensors, str(out / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, out / f.name)
    return WeightUpdate(version=version, path=str(out), sha256=weights_sha256(out), created_at=time.time())
