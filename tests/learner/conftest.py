"""Fixtures shared by the learner's test modules."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.learner.synth import child_env
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[list[str]]:
    """Two real ``actors.rollout_server`` engines serving the tiny base at version 0 (one pair per test module)."""
    procs, urls = [], []
    try:
        for _ in range(2):
            port = free_port()
            p = subprocess.Popen(
                [sys.executable, "-m", "actors.rollout_server", "--model-path", str(tiny_model_dir),
                 "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port), "--weight-version", "0",
                 "--threads", "1"], cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True)
            procs.append(p)
            urls.append(f"http://127.0.0.1:{port}")
        for p in procs:
            ready = p.stdout.readline()  # type: ignore[union-attr]  # blocks until the ready line (or EOF)
            assert "ready" in ready, (ready, p.poll())
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
