"""ops/chaos/procs.py: which component a process is, and what a run leaves behind (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.chaos.procs import alive, cmdline, components, kind, listening, mentioning
from tests.polling import wait_for

SLEEP = "import sys, time; sys.stdin.read()"  # lives until the test closes its stdin


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _start(procs: list[subprocess.Popen[bytes]], *argv: str, env: dict[str, str] | None = None) -> int:
    p = subprocess.Popen([sys.executable, "-c", SLEEP, *argv], stdin=subprocess.PIPE,
                         env=None if env is None else dict(os.environ, **env))
    procs.append(p)
    # Between fork and exec /proc shows the parent's command line (pytest's): wait for the child's own.
    wait_for(lambda: SLEEP in cmdline(p.pid), 10, "the child to exec")
    return p.pid


def test_each_engine_kind_is_an_engine_and_the_rest_by_their_module(
        spawn: list[subprocess.Popen[bytes]]) -> None:
    sglang = _start(spawn, "-m", "sglang.launch_server", "--model-path", "m", "--port", "30000")
    rollout = _start(spawn, "-m", "actors.rollout_server", "--port", "30001")
    actor = _start(spawn, "-m", "actors", "run.yaml")
    buffer = _start(spawn, "-m", "buffer", "run.yaml")
    other = _start(spawn, "-m", "multiprocessing.resource_tracker")
    assert [kind(p) for p in (sglang, rollout, actor, buffer, other)] == ["engine", "engine", "actor", "buffer", "other"]
    found = components(os.getpid())
    assert {sglang, rollout} <= set(found["engine"]) and actor in found["actor"] and buffer in found["buffer"]


def test_a_process_naming_the_run_only_in_its_environment_is_left_behind(
        tmp_path: Path, spawn: list[subprocess.Popen[bytes]]) -> None:
    run_dir = tmp_path / "chaos"
    # An SGLang scheduler: spawned, titled "sglang::scheduler", the run only in its TMPDIR.
    pid = _start(spawn, env={"TMPDIR": str(run_dir / "tmp" / "vapo-engine-0")})
    named = _start(spawn, str(run_dir / "config.yaml"))
    _start(spawn, env={"TMPDIR": str(tmp_path / "elsewhere")})
    assert sorted(int(e.split(":")[0]) for e in mentioning(str(run_dir))) == sorted([pid, named])
    spawn[0].kill()
    spawn[0].wait()
    assert not alive(pid) and [int(e.split(":")[0]) for e in mentioning(str(run_dir))] == [named]


def test_a_process_listens_once_its_server_socket_is_bound(spawn: list[subprocess.Popen[bytes]]) -> None:
    """An engine is a fault's target only once it serves: before its bind and listen it is still starting."""
    code = ("import socket, sys\ns = socket.socket()\nprint('up', flush=True)\nsys.stdin.readline()\n"
            "s.bind(('127.0.0.1', 0)); s.listen()\nprint('listening', flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    spawn.append(p)
    assert p.stdout is not None and p.stdin is not None
    assert p.stdout.readline() == b"up\n"
    assert not listening(p.pid)  # a socket, not yet listening
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == b"listening\n"
    assert listening(p.pid)
    assert not listening(2 ** 22 + 1)  # no such process
