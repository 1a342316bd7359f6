"""A real ``actors.rollout_server`` subprocess on a free port, for the actor tests (their conftest's
``server_factory`` and tests that start a server with their own flags import it from here)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class ServerProc:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_rollout_server(model_dir: Path, log_dir: Path, *extra: str, timeout_s: float = 90.0) -> ServerProc:
    """Start ``python -m actors.rollout_server`` on port 0 and wait for its ready line."""
    log_path = log_dir / f"rollout_server_{time.monotonic_ns()}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "actors.rollout_server", "--model-path", str(model_dir), "--port", "0",
           "--threads", "1", "--log-level", "warning", *extra]
    with open(log_path, "w") as errf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=errf, text=True)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rollout_server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if "ready on " in line:
                url = line.split("ready on ", 1)[1].split()[0]
                return ServerProc(proc, url, log_path)
    proc.kill()
    raise RuntimeError(f"rollout_server not ready after {timeout_s} s:\n{log_path.read_text()[-3000:]}")
