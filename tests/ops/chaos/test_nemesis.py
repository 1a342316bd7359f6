"""The nemesis against a fake run: real processes whose command lines name the components, below a stand-in
launcher; what it hits, what it records, and that a stopped engine is continued when the nemesis stops."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.chaos.nemesis import Nemesis, Target
from ops.chaos.procs import alive, components, state
from tests.polling import wait_for

SLEEP = f"{sys.executable} -c 'import time; time.sleep(120)'"
# An engine that serves: its HTTP port bound and listening (a starting one is no fault's target).
SERVE = (f"{sys.executable} -c 'import socket, time; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); s.listen(); "
         "time.sleep(120)'")


@contextlib.contextmanager
def _stand_in(run_dir: Path, engine: str) -> Iterator[subprocess.Popen[bytes]]:
    """A shell standing in for the launcher, with a buffer, learner and actor that only sleep, and ``engine``."""
    children = " & ".join(f"{SLEEP} {args}" for args in ("-m buffer x", "-m learner x", "-m actors x"))
    launcher = subprocess.Popen(["bash", "-c", f"{children} & {engine} & wait"], start_new_session=True)
    (run_dir / "weights" / "v1").mkdir(parents=True)
    (run_dir / "weights" / "v1" / "STABLE").write_text("")  # a published version: the nemesis may start
    try:
        wait_for(lambda: len(components(launcher.pid)) == 4, 20, "the fake components")
        yield launcher
    finally:
        for pids in components(launcher.pid).values():
            for p in pids:
                subprocess.run(["kill", "-9", str(p)], check=False)
        launcher.kill()
        launcher.wait()


@pytest.fixture
def fake_run(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """The stand-in with an engine that serves."""
    with _stand_in(tmp_path, f"{SERVE} -m actors.rollout_server x") as launcher:
        wait_for(lambda: Target(launcher.pid, tmp_path, []).components()["engine"], 20, "the engine to listen")
        yield launcher, tmp_path


def _nemesis(kind: str, launcher: int, run_dir: Path, *more: str) -> tuple[Nemesis, threading.Thread]:
    now = time.time()
    n = Nemesis(seed=0, interval_s=0.05, t0=now, until=now + 60, kinds=(kind, *more))
    n.target = Target(launcher, run_dir, [])
    thread = threading.Thread(target=n.run, daemon=True)
    thread.start()
    return n, thread


def test_a_kill_hits_its_component_and_is_recorded(fake_run: tuple[subprocess.Popen[bytes], Path]) -> None:
    launcher, run_dir = fake_run
    (buffer,) = components(launcher.pid)["buffer"]
    n, thread = _nemesis("kill_buffer", launcher.pid, run_dir)
    wait_for(lambda: n.faults, 20, "a fault")
    n.stop.set()
    thread.join(10)
    assert n.faults[0]["kind"] == "kill_buffer" and n.faults[0]["pid"] == buffer
    wait_for(lambda: not alive(buffer), 10, "the buffer to die")
    assert all(alive(p) for k, ps in components(launcher.pid).items() for p in ps if k != "buffer")


def test_an_engine_still_starting_is_no_target(tmp_path: Path) -> None:
    """A live SGLang server takes ~40-70 s to bind its port here: until it listens no engine fault hits it."""
    with _stand_in(tmp_path, f"{SLEEP} -m sglang.launch_server --port 1") as launcher:
        (engine,) = components(launcher.pid)["engine"]
        assert Target(launcher.pid, tmp_path, []).components()["engine"] == []
        # Seed 0 picks the second of two kinds: without the gate the engine would be hit first.
        n, thread = _nemesis("kill_actor", launcher.pid, tmp_path, "kill_engine")
        wait_for(lambda: n.faults, 20, "a fault")  # the one it can pick: the actor
        n.stop.set()
        thread.join(10)
        assert n.faults[0]["kind"] == "kill_actor" and alive(engine)


def test_no_learner_kill_before_a_checkpoint(fake_run: tuple[subprocess.Popen[bytes], Path]) -> None:
    launcher, run_dir = fake_run
    n, thread = _nemesis("kill_learner", launcher.pid, run_dir)
    time.sleep(0.5)  # several turns of the nemesis: it must pick nothing (a negative: nothing to poll for)
    assert n.faults == []
    (run_dir / "checkpoints" / "v1").mkdir(parents=True)
    (run_dir / "checkpoints" / "v1" / "COMPLETE").write_text("")
    wait_for(lambda: n.faults, 20, "the learner kill once a checkpoint exists")
    n.stop.set()
    thread.join(10)
    assert n.faults[0]["kind"] == "kill_learner"


def test_a_stopped_engine_is_continued_when_the_nemesis_stops(fake_run: tuple[subprocess.Popen[bytes], Path]) -> None:
    launcher, run_dir = fake_run
    (engine,) = components(launcher.pid)["engine"]
    n, thread = _nemesis("stop_engine", launcher.pid, run_dir)
    # The nemesis records a fault after applying it: the engine may be seen stopped a moment before.
    wait_for(lambda: state(engine) == "T" and bool(n.faults), 20, "the engine stopped and the fault recorded")
    assert n.faults[0]["kind"] == "stop_engine" and 3 <= n.faults[0]["duration_s"] <= 12
    n.stop.set()
    thread.join(10)
    n.wait_undone(10)
    wait_for(lambda: state(engine) != "T", 10, "the engine continued")


def test_the_final_heal_ends_the_faults_and_undoes_those_in_force(fake_run: tuple[subprocess.Popen[bytes], Path]) -> None:
    launcher, run_dir = fake_run
    (engine,) = components(launcher.pid)["engine"]
    now = time.time()
    n = Nemesis(seed=0, interval_s=0.05, t0=now, until=now + 60, kinds=("stop_engine",), heal_at=3)
    n.target = Target(launcher.pid, run_dir, [])
    thread = threading.Thread(target=n.run, daemon=True)
    thread.start()
    wait_for(lambda: state(engine) == "T", 20, "the engine stopped")
    (run_dir / "weights" / "v3").mkdir()
    (run_dir / "weights" / "v3" / "STABLE").write_text("")  # the heal version published
    thread.join(20)
    assert not thread.is_alive() and n.faults[-1]["kind"] == "heal"
    n.wait_undone(10)
    wait_for(lambda: state(engine) != "T", 10, "the engine continued at the heal")
