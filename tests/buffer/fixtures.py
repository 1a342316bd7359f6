"""Shared helpers for tests that talk to a buffer: sample groups, a synchronous group sender, a run's keys and
the buffer server as a real subprocess (``BufferProc``). Imported by tests/buffer and by other test packages."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from buffer.client import AsyncGroupSender
from common.protocol import CreditGrant, IngestAck, Sample, SampleGroup
from common.security import ClientKeys, generate_run_keys
from tests.sockdirs import socket_dir

REPO = Path(__file__).resolve().parents[2]


def make_sample(version: int = 0, reward: float = 0.0, length: int = 8, prompt_len: int = 4, seed: int = 0) -> Sample:
    rng = np.random.default_rng(seed)
    return Sample(
        prompt_ids=rng.integers(0, 100, prompt_len).astype(np.int32),
        output_ids=rng.integers(0, 100, length).astype(np.int32),
        output_logprobs=-rng.random(length).astype(np.float32),
        reward=reward, finish_reason="stop", weight_version=version, response_length=length,
    )


def make_group(gid: str | None = None, version: int = 0, g: int = 4, length: int = 8,
               rewards: list[float] | None = None, actor_id: int = 0, seed: int | None = None) -> SampleGroup:
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(g)]
    base = seed if seed is not None else int(uuid.uuid4().int % (1 << 30))
    return SampleGroup(
        group_id=gid or uuid.uuid4().hex, prompt_id=f"p{base}", task="test", actor_id=actor_id,
        samples=[make_sample(version, rewards[i], length, seed=base * 64 + i) for i in range(g)],
        created_at=time.time(),
    )


class SyncSender:
    """The actors' ``AsyncGroupSender`` for synchronous test code: each call runs on a private event loop.

    ``send_many`` sends its groups concurrently, as an actor's generation loops do.
    """

    def __init__(self, addr: str, actor_id: int, *, curve: ClientKeys | None = None, ack_timeout_s: float = 10.0) -> None:
        self._loop = asyncio.new_event_loop()

        async def make() -> AsyncGroupSender:
            return AsyncGroupSender(addr, actor_id, curve=curve, ack_timeout_s=ack_timeout_s)

        self.sender = self._loop.run_until_complete(make())

    def acquire(self, n: int = 1, timeout_s: float | None = None) -> CreditGrant:
        return self._loop.run_until_complete(self.sender.acquire(n, timeout_s))

    def send(self, group: SampleGroup, timeout_s: float | None = None) -> IngestAck:
        return self._loop.run_until_complete(self.sender.send(group, timeout_s))

    def send_many(self, groups: list[SampleGroup], timeout_s: float | None = None) -> list[IngestAck]:
        async def all_of() -> list[IngestAck]:
            return list(await asyncio.gather(*(self.sender.send(g, timeout_s) for g in groups)))

        return self._loop.run_until_complete(all_of())

    @property
    def resent(self) -> int:
        return self.sender.resent

    @property
    def credits(self) -> int:
        return self.sender.credits

    def close(self) -> None:
        self._loop.run_until_complete(self.sender.close())
        self._loop.close()

    def __enter__(self) -> SyncSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_keys(directory: Path) -> tuple[list[str], Path]:
    """A run's CurveZMQ key set (what the launcher writes) and the override that makes every process use it;
    clients take theirs with ``client_curve_keys(CurveConfig(keys_dir=str(d)), role)``."""
    d = generate_run_keys(directory)
    return [f"buffer.curve.keys_dir={d}"], d


class BufferProc:
    """``python -m buffer`` in a subprocess with ipc:// sockets in a short private directory."""

    def __init__(self, workdir: Path, overrides: list[str] | None = None) -> None:
        self.sockdir = socket_dir("vb")
        self.path = workdir / "lmdb"
        self.ingest_addr = f"ipc://{self.sockdir}/ingest"
        self.serve_addr = f"ipc://{self.sockdir}/serve"
        self.overrides = [
            f"buffer.path={self.path}", f"buffer.ingest_addr={self.ingest_addr}",
            f"buffer.serve_addr={self.serve_addr}", "buffer.metrics_port=0", "run.log_level=WARNING",
            # The ingest bounds read the model's vocabulary and context: no model (unless a test names one) and
            # a vocabulary that fits make_sample's ids, whatever runs/_base holds on this machine.
            f"model.path={workdir / 'no-model'}", "buffer.vocab_size=1000",
        ] + list(overrides or [])
        self.log = workdir / "buffer.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    def start(self, timeout_s: float = 30.0) -> BufferProc:
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "buffer", *self.overrides], cwd=REPO, env=env,
                                         stdout=subprocess.PIPE, stderr=log)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise AssertionError(f"buffer did not start: rc={self.proc.poll()} log:\n{self.log.read_text()}")
            r, _, _ = select.select([self.proc.stdout], [], [], left)
            if r:
                ch = os.read(self.proc.stdout.fileno(), 1)
                if not ch:
                    continue
                line += ch
        assert line.startswith(b"BUFFER READY "), line
        self.info = json.loads(line[len(b"BUFFER READY "):])
        return self

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=30)
        if self.proc.stdout:
            self.proc.stdout.close()
        return rc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGTERM)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGKILL)
        elif self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        shutil.rmtree(self.sockdir, ignore_errors=True)


def buffer_config(workdir: Path, overrides: list[str] | None = None) -> Any:
    """A config for a buffer in ``workdir`` (LMDB in ``workdir/lmdb``, ipc sockets in ``workdir/s``), no model."""
    from common.config import load_config

    sock = workdir / "s"
    sock.mkdir(exist_ok=True)
    return load_config(None, [
        f"buffer.path={workdir / 'lmdb'}", f"buffer.ingest_addr=ipc://{sock}/i", f"buffer.serve_addr=ipc://{sock}/s",
        "buffer.metrics_port=0", "metrics.prometheus=false", f"model.path={workdir / 'no-model'}",
        "buffer.vocab_size=1000", *(overrides or []),
    ])
