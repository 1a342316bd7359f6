"""pytest fixtures for buffer tests; the helpers themselves are in ``tests.buffer.fixtures``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.buffer.fixtures import REPO, BufferProc, SyncSender, make_group, make_sample, run_keys

# Older importers of this module (tests/learner) still find the helpers here.
__all__ = ["REPO", "BufferProc", "SyncSender", "buffer_proc", "make_group", "make_sample", "run_keys"]


@pytest.fixture
def buffer_proc(tmp_path: Path) -> Iterator[Any]:
    """Factory: ``buffer_proc(overrides)`` starts a server; every one is killed at teardown."""
    procs: list[BufferProc] = []

    def start(overrides: list[str] | None = None) -> BufferProc:
        p = BufferProc(tmp_path, overrides)
        procs.append(p)
        return p.start()

    yield start
    for p in procs:
        p.cleanup()
