"""A worker's own ``actors.rollout_server`` child process: command line, start, readiness, stop.

Not a CLI; ``actors.engine_supervisor.LocalSupervisor`` uses it when ``engine.kind = rollout_server`` (the CPU
default). The engine of actor ``i`` listens on ``engine.host:engine.base_port + i`` (``engine.base_port = 0``: any free port, read
from the server's ready line). It is started with the newest verified weights (``--model-path`` = the
weights directory, ``--weight-version`` = its version) or the base model as version 0, without a tokenizer
(the worker tokenises and detokenises itself). Its stderr goes to ``<run dir>/logs/engine-<i>.log``.

The child stays in the worker's process group (a launcher that signals the group stops both) and is
spawned through ``common.lifeline``: it gets SIGKILL when the worker dies, however the worker dies, so a
killed worker never leaves an engine holding its port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from common import lifeline
from common.config import Config
from common.sglang_client import SGLangClient

log = logging.getLogger("vapo.actors.engine")
REPO = Path(__file__).resolve().parents[2]


ADMIN_KEY_ENV = "VAPO_ENGINE_ADMIN_API_KEY"  # rollout_server's --admin-api-key when the flag is not given


class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy within ``engine.startup_timeout_s``."""


def rollout_server_command(cfg: Config, actor_id: int, model_path: str, weight_version: int,
                           seed: int | None = None) -> list[str]:
    """The ``python -m actors.rollout_server`` command line for actor ``actor_id``."""
    e = cfg.engine
    port = e.base_port + actor_id if e.base_port > 0 else 0
    return [
        sys.executable, "-m", "actors.rollout_server",
        "--model-path", str(model_path),
        "--skip-tokenizer-init",
        "--host", e.host,
        "--port", str(port),
        "--device", cfg.run.device,
        "--dtype", cfg.model.dtype,
        "--max-batch-size", str(e.max_batch_size),
        "--context-length", str(e.context_length),
        "--batch-wait-ms", str(e.batch_wait_ms),
        "--threads", str(e.threads),
        "--weight-version", str(weight_version),
        "--random-seed", str(cfg.run.seed * 1000 + actor_id if seed is None else seed),
        "--logprobs", e.logprobs,
        "--weight-load-timeout-s", str(e.weight_load_timeout_s),
        "--log-level", "warning",
    ] + (["--bind-protection", e.bind_protection] if e.bind_protection else []) + (
        ["--imitate-sglang", "--enable-metrics"] if e.imitate_sglang else [])


class RolloutServerProcess:
    """Start / watch / stop one rollout_server child."""

    def __init__(self, cfg: Config, actor_id: int, log_path: Path) -> None:
        self.cfg, self.actor_id, self.log_path = cfg, actor_id, log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.starts = 0
        self._drain: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, model_path: str, weight_version: int, api_key: str = "") -> str:
        """Start the engine and wait for its ready line and ``/health``; returns its base URL. ``api_key``
        reaches the child in its environment (``VAPO_ENGINE_ADMIN_API_KEY``): a command line is readable by every
        user of the machine, a process environment only by its owner."""
        await self.stop()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = rollout_server_command(self.cfg, self.actor_id, model_path, weight_version,
                                     seed=self.cfg.run.seed * 1000 + self.actor_id + 100 * self.starts)
        self.starts += 1
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               ADMIN_KEY_ENV: api_key}
        with open(self.log_path, "ab") as errf:
            errf.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(cmd)}\n".encode())
            errf.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *cmd, cwd=str(REPO), stdout=asyncio.subprocess.PIPE, stderr=errf, **lifeline.popen_kwargs(env))
        timeout = self.cfg.engine.startup_timeout_s
        try:
            self.url = await asyncio.wait_for(self._ready_url(), timeout)
        except TimeoutError:
            await self.stop()
            raise EngineStartError(f"rollout_server not ready after {timeout} s (log: {self.log_path})") from None
        self._drain = asyncio.get_running_loop().create_task(self._drain_stdout())
        async with SGLangClient(self.url) as client:
            await client.wait_healthy(timeout)
        log.info("engine %d up at %s (pid %s, model %s, version %s)", self.actor_id, self.url, self.pid,
                 model_path, weight_version)
        return self.url

    async def _ready_url(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                rc = await self.proc.wait()
                tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
                raise EngineStartError(f"rollout_server exited with code {rc} while starting:\n{tail}")
            text = line.decode(errors="replace")
            if "ready on " in text:
                return text.split("ready on ", 1)[1].split()[0]

    async def _drain_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while await self.proc.stdout.readline():
            pass

    async def wait(self) -> int:
        """Wait for the engine to exit; returns its exit code."""
        assert self.proc is not None
        return await self.proc.wait()

    def kill(self) -> None:
        """SIGKILL a hung engine (one that stopped answering may not honour SIGTERM); ``wait`` then returns."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    async def stop(self, grace_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
        if proc is None or proc.returncode is not None:
            return
        try:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        except ProcessLookupError:
            pass


__all__ = ["ADMIN_KEY_ENV", "EngineStartError", "RolloutServerProcess", "rollout_server_command"]
