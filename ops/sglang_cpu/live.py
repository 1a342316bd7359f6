"""The real SGLang server on this CPU, started as vapo starts a CPU engine and stopped by its process group:
for tests marked ``sglang``, the contract capture (``contract.py``) and the engine benchmark.

    server = LiveSGLang.start(model_dir, log_dir, admin_key="k")   # waits for /health (SGLang: ~40-70 s)
    ... server.url ...
    server.stop()

``skip_reason()`` is None where SGLang can run here (``ops/setup.sh --sglang`` installed it on a Linux x86_64
CPU torch) and a one-line reason otherwise; ``tests/conftest.py`` skips ``sglang`` tests with it, or fails
them when ``VAPO_REQUIRE_SGLANG=1`` (CI, which installs SGLang, must never skip them silently).
The command is ``common.sglang_args.sglang_command`` for a CPU run: the tests check what vapo launches.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import Config, load_config
from common.ports import free_port
from common.sglang_args import private_tmp_env, sglang_command

REPO = Path(__file__).resolve().parents[2]

START_TIMEOUT_S = 300.0  # ~40 s on 2 idle cores; several times that on a loaded CI machine


def skip_reason() -> str | None:
    """Why the real SGLang server cannot run here (None: it can)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return f"SGLang's CPU engine needs Linux on x86_64/arm64, not {platform.system()} {platform.machine()}"
    for mod in ("sglang", "sgl_kernel"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (run ops/setup.sh --sglang)"
    return None


def cpu_config(model_dir: Path, port: int, *overrides: str) -> Config:
    """The config of a one-engine CPU run with real SGLang at ``port`` (``key=value`` overrides last)."""
    return load_config(None, ["run.device=cpu", "engine.kind=sglang", f"model.path={model_dir}", "model.dtype=float32",
                              "engine.host=127.0.0.1", f"engine.base_port={port}", *overrides])


@dataclass
class LiveSGLang:
    """One running ``sglang.launch_server`` (its own process group: the scheduler and detokenizer are children),
    with a TMPDIR of its own that goes with it (``common.sglang_args.private_tmp_env``)."""

    proc: subprocess.Popen
    url: str
    log_path: Path
    admin_key: str | None
    tmp_dir: Path

    @classmethod
    def start(cls, model_dir: Path, log_dir: Path, *, admin_key: str | None = None, name: str = "sglang",
              overrides: tuple[str, ...] = (), port: int = 0) -> LiveSGLang:
        port = port or free_port()
        cmd, extra_env = sglang_command(cpu_config(model_dir, port, *overrides), 0)
        if admin_key:  # vapo passes it through a --config file; on the command line here (a test key)
            cmd += ["--admin-api-key", admin_key]
        log_path = log_dir / f"{name}-{port}.log"
        tmp_dir = Path(tempfile.mkdtemp(prefix=f"vapo-{name}-"))
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               **extra_env, **private_tmp_env(tmp_dir)}
        try:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        server = cls(proc, f"http://127.0.0.1:{port}", log_path, admin_key, tmp_dir)
        try:
            server.wait_healthy(START_TIMEOUT_S)
        except BaseException:
            server.stop()
            raise
        return server

    def wait_healthy(self, timeout_s: float) -> None:
        """Until /health answers 200; RuntimeError when the server exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang at {self.url} not healthy after {timeout_s} s: {self.log_tail()}")
            time.sleep(0.5)  # the poll interval; healthy() decides

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"SGLang exited with {self.proc.returncode}: {self.log_tail()}")
        return self.request("GET", "/health", timeout_s=10)[0] == 200

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def request(self, method: str, path: str, body: Any = None, *, key: str | None = "admin",
                timeout_s: float = 120.0) -> tuple[int, Any]:
        """``(status, parsed JSON body or text)``; ``key="admin"`` sends the server's admin key, None none."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        token = self.admin_key if key == "admin" else key
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return -1, None
        text = raw.decode(errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def kill(self) -> None:
        """SIGKILL the whole server (a crashed engine host)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(ProcessLookupError):  # children that outlived the main process
            os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
