"""Launched smoke runs whose learner is SIGKILLed (the local stand-in for a lost learner host): under
``--auto-resume 2`` the run resumes by itself and finishes with rc 0, its summary counting one resume and the
time it lost; under ``--auto-resume 1`` a second kill stops it at once, naming the spent resumes; under
``--auto-resume 0`` it stops as before, printing the ``--resume`` hint. Real launcher, buffer, learner, actor
and engine processes, 30-60 s each on two cores; the one that runs to the end is ``slow``. The launcher runs as ``ops/launch.sh`` execs it
(``python -m ops.launch``), in the test's interpreter: the script's venv set-up is not what is tested here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common import lifeline
from tests.polling import wait_for
from tests.ports import port_overrides

ROOT = Path(__file__).resolve().parents[2]
STEP_WAIT_S = 600.0  # a learner step or a restart on two shared cores
STOP_WAIT_S = 90.0  # "at once": the stop of every child (its grace) and the summary, not another run



class Launch:
    """One ``ops/launch.sh`` process, its output read by a thread so that waits can look at it."""

    def __init__(self, run_root: Path, *args: str) -> None:
        self.run_dir = run_root / "resume"
        argv = [sys.executable, "-m", "ops.launch", "ops/configs/smoke.yaml", f"run.root={run_root}", "run.name=resume",
                "learner.checkpoint_every=2", *port_overrides(), *args]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, **lifeline.popen_kwargs(env))
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def saw(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def out(self) -> str:
        return "".join(self.lines)[-6000:]

    def learner_pid(self) -> int:
        def find() -> int | None:
            for pid in _descendants(self.proc.pid):
                if " -m learner " in _cmdline(pid) + " ":
                    return pid
            return None
        return wait_for(find, STEP_WAIT_S, "the learner process", interval_s=0.2)

    def checkpoint(self, version: int) -> None:
        wait_for(lambda: (self.run_dir / "checkpoints" / f"v{version}" / "COMPLETE").is_file(), STEP_WAIT_S,
                 f"checkpoint v{version}", interval_s=0.2)

    def rc(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def kill_now(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[0] not in "ZX":
                kids.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.mark.slow  # 35-60 s here, the whole run to its end
def test_a_killed_learner_is_resumed_and_the_run_finishes(tmp_path: Path) -> None:
    launch = Launch(tmp_path, "--auto-resume", "2", "learner.total_steps=6")
    try:
        launch.checkpoint(2)
        os.kill(launch.learner_pid(), signal.SIGKILL)
        rc = launch.rc(1200)
        assert rc == 0, launch.out()
        assert launch.saw("AUTO-RESUME 1/2: after 'learner: exited with code -9"), launch.out()
        summary = json.loads((launch.run_dir / "summary.json").read_text())
        assert summary["auto_resumes"] == 1 and summary["resume_lost_seconds"] > 0, summary
        (resume,) = summary["auto_resume_events"]
        assert resume["checkpoint"] is not None and resume["checkpoint"] >= 2 and resume["down_s"] > 0, resume
        assert summary["steps"] >= 6, summary
        assert launch.saw("automatic resumes"), launch.out()  # the end table
        assert len((launch.run_dir / "resumes.jsonl").read_text().splitlines()) == 1
        print("RESUME " + json.dumps(resume), flush=True)  # the figures (-s)
    finally:
        launch.kill_now()


@pytest.mark.slow  # a launched run killed twice (~27 s); test_without_auto_resume_the_stop_is_as_before stays in the default suite
def test_a_second_kill_past_the_resumes_stops_at_once(tmp_path: Path) -> None:
    launch = Launch(tmp_path, "--auto-resume", "1", "learner.total_steps=40")
    try:
        launch.checkpoint(2)
        first = launch.learner_pid()
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: launch.saw("the learner steps again"), STEP_WAIT_S, "the resumed learner's first step",
                 interval_s=0.2)
        second = launch.learner_pid()
        assert second != first
        os.kill(second, signal.SIGKILL)
        rc = launch.rc(STOP_WAIT_S)
        assert rc == 1, launch.out()
        assert launch.saw("STOPPED — not resumed automatically: run.max_resumes=1 resume(s) already spent"), launch.out()
        assert not (launch.run_dir / "summary.json").exists()
    finally:
        launch.kill_now()


def test_without_auto_resume_the_stop_is_as_before(tmp_path: Path) -> None:
    launch = Launch(tmp_path, "--auto-resume", "0", "learner.total_steps=40")
    try:
        launch.checkpoint(2)
        os.kill(launch.learner_pid(), signal.SIGKILL)
        rc = launch.rc(STOP_WAIT_S)
        assert rc == 1, launch.out()
        assert launch.saw("FAILED — learner: exited with code -9"), launch.out()
        assert launch.saw("--resume continues it from its checkpoint v"), launch.out()
        assert not launch.saw("AUTO-RESUME") and not launch.saw("STOPPED")
    finally:
        launch.kill_now()
