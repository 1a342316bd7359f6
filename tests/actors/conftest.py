"""Fixtures for actor tests: a real ``actors.rollout_server`` subprocess on a free port (tests/actors/servers.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.actors.servers import ServerProc, start_rollout_server


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProc]]:
    started: list[ServerProc] = []
    log_dir = tmp_path_factory.mktemp("server_logs")

    def make(model_dir: Path, *extra: str) -> ServerProc:
        s = start_rollout_server(model_dir, log_dir, *extra)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
