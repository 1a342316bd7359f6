"""ops/bench/sglang_radix.py's engine CPU figure: ``group_cpu_s`` adds up the CPU time of every process in the
engine's process group (the server, its scheduler and detokenizer children) and of nothing outside it. The
benchmark itself needs the real SGLang server (``ops/setup.sh --sglang``) and is run by hand."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ops.bench.sglang_radix import group_cpu_s
from tests.polling import wait_for

# Burns 0.5 s of its own CPU, says so in a file, then idles until killed.
BURN = ("import sys, time\n"
        "while time.process_time() < 0.5:\n"
        "    pass\n"
        "open(sys.argv[1], 'w').close()\n"
        "time.sleep(600)\n")


def test_group_cpu_counts_every_process_of_the_group_and_no_other(tmp_path: Path) -> None:
    # A leader and its child in one new process group (as the engine's server and its workers), each burning 0.5 s.
    leader = ("import subprocess, sys\n"
              f"subprocess.Popen([sys.executable, '-c', {BURN!r}, sys.argv[1] + '.child'])\n"
              f"exec({BURN!r})\n")
    group = subprocess.Popen([sys.executable, "-c", leader, str(tmp_path / "burnt")], start_new_session=True)
    idle = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        wait_for(lambda: (tmp_path / "burnt").exists() and (tmp_path / "burnt.child").exists(), 60, "both burns")
        burnt = group_cpu_s(group.pid)
        # 2 x 0.5 s burnt, plus two interpreters' start-up (well under 0.5 s each), nothing of this test's process;
        # /proc counts whole clock ticks (1/100 s), each of user and system time rounded down per process
        assert 0.95 <= burnt < 2.0, burnt
        assert group_cpu_s(idle.pid) < 0.05
    finally:
        for p in (group, idle):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
