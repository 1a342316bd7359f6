"""Real processes for actor tests: buffer server, a fake learner's weight sockets, workers, weight dirs.

The fake learner is only the two sockets of the real protocol (PUB WeightUpdate, REP WeightQuery);
everything else (buffer, workers, engines) is the real program in a subprocess. Sockets are ipc:// in a
private directory, engines and metrics take free ports, so tests never collide.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import protocol
from common.checksum import weights_sha256
from tests.sockdirs import socket_dir

REPO = Path(__file__).resolve().parents[2]




def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


class Stack:
    """Addresses and overrides shared by the buffer, the fake learner and the workers of one test."""

    def __init__(self, tmp: Path, model_dir: Path, extra: list[str] | None = None) -> None:
        self.tmp = tmp
        self.sockdir = socket_dir("va")
        self.ingest = f"ipc://{self.sockdir}/ingest"
        self.serve = f"ipc://{self.sockdir}/serve"
        self.publish = f"ipc://{self.sockdir}/pub"
        self.query = f"ipc://{self.sockdir}/query"
        self.run_dir = tmp / "runs" / "t"
        self.overrides = [
            f"run.root={tmp / 'runs'}", "run.name=t", "run.log_level=INFO", f"model.path={model_dir}",
            f"buffer.ingest_addr={self.ingest}", f"buffer.serve_addr={self.serve}", "buffer.metrics_port=0",
            f"learner.publish_addr={self.publish}", f"learner.query_addr={self.query}",
            "learner.batch_groups=1000", "engine.base_port=0", "engine.threads=1", "engine.batch_wait_ms=5",
            "actors.metrics_base_port=0", "task.max_digits=3", "actors.weight_poll_s=1.0",
            # These tests scrape an actor, then stop it: without this it would wait for one more scrape.
            "metrics.final_scrape_wait_s=0",
        ] + list(extra or [])
        self.procs: list[subprocess.Popen] = []

    # ------------------------------------------------------------------ buffer

    def start_buffer(self) -> subprocess.Popen:
        log = open(self.tmp / "buffer.log", "ab")  # the child owns it
        p = subprocess.Popen([sys.executable, "-m", "buffer", *self.overrides], cwd=REPO, env=env(),
                             stdout=subprocess.PIPE, stderr=log)
        log.close()
        self.procs.append(p)
        read_tagged(p, "BUFFER READY", 60, self.tmp / "buffer.log")
        return p

    def groups(self, n: int) -> list[protocol.SampleGroup]:
        """Take ``n`` groups out of the buffer (fails if it holds fewer)."""
        from buffer.client import BatchClient

        with BatchClient(self.serve) as c:
            return c.get_batch(0, n, timeout_s=20).groups

    def drain_until(self, done: Callable[[], bool], timeout_s: float) -> list[protocol.SampleGroup]:
        """Take groups out of the buffer (freeing admission credit, as a learner would) until ``done()``."""
        out: list[protocol.SampleGroup] = []
        deadline = time.monotonic() + timeout_s
        while True:
            finished = done()
            depth = int(self.buffer_stats()["depth_groups"])
            if depth:
                out += self.groups(depth)
            if finished:
                return out
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {timeout_s} s of draining ({len(out)} groups taken)")
            time.sleep(0.1)  # polling the buffer with a deadline

    def buffer_stats(self) -> dict[str, float]:
        from buffer.client import BatchClient

        with BatchClient(self.serve) as c:
            return c.stats()

    # ------------------------------------------------------------------ actors

    def start_actors(self, *args: str, log_name: str = "actors.log") -> subprocess.Popen:
        log = open(self.tmp / log_name, "ab")
        p = subprocess.Popen([sys.executable, "-m", "actors", *self.overrides, *args], cwd=REPO, env=env(),
                             stdout=subprocess.PIPE, stderr=log)
        log.close()
        self.procs.append(p)
        return p

    def worker_state(self, actor_id: int) -> dict[str, Any]:
        path = self.run_dir / "actors" / f"worker-{actor_id}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def cursor(self, actor_id: int) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "actors" / f"cursor-{actor_id}.json").read_text())
        except (OSError, ValueError):
            return {"next": 0, "done": []}

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
            if p.stdout:
                p.stdout.close()
        shutil.rmtree(self.sockdir, ignore_errors=True)


def read_tagged(p: subprocess.Popen, tag: str, timeout_s: float, log: Path | None = None) -> dict[str, Any]:
    """Read stdout lines until one starts with ``tag``; returns its JSON payload."""
    assert p.stdout is not None
    deadline = time.monotonic() + timeout_s
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {tag!r} line within {timeout_s} s; log:\n{_tail(log)}")
        r, _, _ = select.select([p.stdout], [], [], min(left, 1.0))
        if not r:
            if p.poll() is not None:
                raise AssertionError(f"process exited ({p.returncode}) before {tag!r}; log:\n{_tail(log)}")
            continue
        ch = os.read(p.stdout.fileno(), 1)
        if not ch:
            raise AssertionError(f"stdout closed before {tag!r} (rc={p.poll()}); log:\n{_tail(log)}")
        buf += ch
        if ch == b"\n":
            line, buf = buf.decode(), b""
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])


def _tail(log: Path | None) -> str:
    return log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else ""


# ----------------------------------------------------------------------------------- fake learner


def make_weights(base: Path, out: Path, scale: float, version: int) -> Any:
    """A new weight version: the base model's tensors times ``scale``; returns its WeightUpdate."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.suffix == ".safetensors":
            sd = load_file(str(f))
            save_file({k: (v * scale).contiguous() for k, v in sd.items()}, str(out / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, out / f.name)
    del torch
    return protocol.WeightUpdate(version=version, path=str(out), sha256=weights_sha256(out), created_at=time.time())


# ----------------------------------------------------------------------------------- metrics


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels: str) -> float | None:
    """Value of one sample of a Prometheus text exposition (labels must all match)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def terminate(p: subprocess.Popen, timeout_s: float = 60) -> int:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    return p.wait(timeout=timeout_s)
