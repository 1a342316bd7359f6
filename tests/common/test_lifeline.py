"""common.lifeline: children die with a SIGKILLed parent (parent-death signal) or ancestor (watchdog)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common import lifeline
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]

# A process that starts one child with the given spawn mode, prints the pids below it and sleeps. The child
# runs the same script (its text travels in CHAIN_SCRIPT) one level less deep: depth 2 gives
# top -> child -> grandchild.
CHAIN = """
import os, subprocess, sys, time
from common import lifeline
depth, mode = int(sys.argv[1]), sys.argv[2]
pids = []
if depth > 0:
    kw = lifeline.popen_kwargs() if mode == "lifeline" else {}
    c = subprocess.Popen([sys.executable, "-c", os.environ["CHAIN_SCRIPT"], str(depth - 1), mode],
                         stdout=subprocess.PIPE, start_new_session=True, text=True, **kw)
    pids = [str(c.pid), *c.stdout.readline().split()]
print(" ".join(pids), flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    """Exited (absent, or a zombie nobody reaped: it holds no port and runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


def start_chain(mode: str, depth: int) -> tuple[subprocess.Popen, list[int]]:
    env = {**os.environ, "CHAIN_SCRIPT": CHAIN}
    top = subprocess.Popen([sys.executable, "-c", CHAIN, str(depth), mode], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                           env=env, start_new_session=True)
    assert top.stdout is not None
    descendants = [int(p) for p in top.stdout.readline().split()]
    assert len(descendants) == depth
    return top, descendants


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("mode", ["lifeline", "plain"])
def test_descendants_die_with_a_sigkilled_parent(mode: str) -> None:
    top, descendants = start_chain(mode, depth=2)
    try:
        assert not any(gone(p) for p in descendants)
        top.kill()
        top.wait(timeout=10)
        if mode == "lifeline":
            wait_for(lambda: all(gone(p) for p in descendants), 10, "child and grandchild to die with the parent")
        else:  # the control: without the lifeline the same chain is orphaned (what the launcher used to do).
            # A parent-death signal is sent while the parent exits, before it can be reaped: none came.
            assert not any(gone(p) for p in descendants)
    finally:
        for p in descendants:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_popen_kwargs_names_this_process_in_the_child_environment() -> None:
    kw = lifeline.popen_kwargs({"A": "1"})
    assert kw["env"]["A"] == "1" and "PATH" not in kw["env"]  # the given environment, not os.environ
    pid, started, where = kw["env"][lifeline.ENV_VAR].split(":", 2)
    assert int(pid) == os.getpid() and int(started) == lifeline.start_time(os.getpid()) > 0
    assert where == lifeline.scope() and where != "unknown"


def test_watch_ancestor_kills_a_process_when_its_ancestor_exits() -> None:
    ancestor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    code = ("from common import lifeline; import time\n"
            "assert lifeline.watch_ancestor() is not None\nprint('armed', flush=True)\ntime.sleep(120)")
    env = {**os.environ, lifeline.ENV_VAR: lifeline.token(ancestor.pid)}
    # Not a child of the ancestor (as a DeepSpeed rank is not the launcher's child): only the watchdog acts.
    ward = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert ward.stdout is not None and ward.stdout.readline().strip() == "armed"
        assert ward.poll() is None
        ancestor.kill()
        ancestor.wait(timeout=10)
        assert ward.wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (ancestor, ward):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_watch_ancestor_treats_a_reused_pid_as_a_dead_ancestor() -> None:
    died = threading.Event()
    # The parent's pid with a start time it does not have: the process that pid once named is gone.
    assert lifeline.watch_ancestor(f"{os.getppid()}:1:{lifeline.scope()}", on_death=died.set) is None
    assert died.is_set()


def test_watch_ancestor_is_a_no_op_without_a_valid_token() -> None:
    died = threading.Event()
    assert lifeline.watch_ancestor(lifeline.token(), on_death=died.set) is None  # this process itself
    assert lifeline.watch_ancestor("not-a-token", on_death=died.set) is None
    # A token from another host (forwarded over ssh/srun) names no process here, even if its pid is free.
    assert lifeline.watch_ancestor(f"{2**22 + 7}:1:another-boot/pid:[1]", on_death=died.set) is None
    assert not died.is_set()


# A stand-in for ops/launch.py (spawns with a lifeline) over a stand-in for DeepSpeed's launcher (spawns a
# learner rank with plain Popen, as DeepSpeed does): only the rank's own watchdog can stop it.
TOP = """
import os, subprocess, sys
from common import lifeline
mid = subprocess.Popen([sys.executable, "-c", os.environ["MID_SCRIPT"], *sys.argv[1:]], **lifeline.popen_kwargs())
print("mid", mid.pid, flush=True)
mid.wait()
"""
MID = """
import subprocess, sys
rank = subprocess.Popen([sys.executable, "-m", "learner", *sys.argv[1:]])
print("rank", rank.pid, flush=True)
rank.wait()
"""


def test_a_learner_rank_under_a_foreign_launcher_dies_with_the_vapo_launcher(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.learner.synth import child_env
    from tests.ports import port_overrides

    run_dir = tmp_path / "r"
    args = ["ops/configs/smoke.yaml", f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
            "metrics.prometheus=false", *port_overrides()]  # no buffer listens: the rank waits for data
    env = child_env(MID_SCRIPT=MID)
    top = subprocess.Popen([sys.executable, "-c", TOP, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    pids: dict[str, int] = {}
    try:
        assert top.stdout is not None
        for _ in range(2):
            who, pid = top.stdout.readline().split()
            pids[who] = int(pid)
        # The rank writes its config after arming the watchdog (first thing after parsing the config).
        wait_for(lambda: (run_dir / "learner_config.yaml").exists(), 120, "the learner rank to start")
        assert not gone(pids["rank"])
        top.kill()
        top.wait(timeout=10)
        wait_for(lambda: gone(pids["mid"]), 10, "the stand-in DeepSpeed launcher to die (parent-death signal)")
        wait_for(lambda: gone(pids["rank"]), 10, "the learner rank to die (its lifeline watchdog)")
    finally:
        for p in [top.pid, *pids.values()]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
