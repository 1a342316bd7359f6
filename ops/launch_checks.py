"""What a launch checks before it starts or writes anything, every problem at once (``ops/launch.py``).

    problems, skipped = launch_problems(cfg, plan, root)        # [] when the run can start
    ops/launch.sh CONFIG --dry-run                              # prints the plan, then every problem, exit 2

A run that would fail names all its problems in one go, each led by its config key: the files the config
names (``common.preflight``), the programs that start processes on other hosts (pdsh from the plan, ssh,
srun), the rows of a data set, and SGLang's install where the plan starts SGLang here. A newcomer without
pdsh or Slurm reads the whole list, not the first problem only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from common.config import Config
from common.placement import Plan
from common.preflight import check_dataset, missing_files
from ops.launch_engines import sglang_install_problem

# The program each ``via`` of a process starts it with on another host (pdsh: build_plan checks it).
REMOTE_PROGRAMS = {"ssh": "ssh (Debian/Ubuntu: apt-get install openssh-client)",
                   "srun": "srun (Slurm; placement.remote=srun runs inside a Slurm allocation)"}


def tool_problems(plan: Plan, environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per program the plan starts other hosts' processes with that is not on PATH."""
    path = (os.environ if environ is None else environ).get("PATH")
    out = []
    for via in sorted({p.via for p in plan.procs if p.via in REMOTE_PROGRAMS}):
        if shutil.which(via, path=path) is None:
            who = sorted(p.name for p in plan.procs if p.via == via)
            out.append(f"placement.remote: {', '.join(who)} start(s) with {via}, which is not on PATH: "
                       f"install {REMOTE_PROGRAMS[via]}")
    return out


def launch_problems(cfg: Config, plan: Plan, root: Path, sglang: bool = True,
                    environ: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """(every problem a launch of ``plan`` would refuse for, the data set's bad-row report). ``plan`` comes
    from ``build_plan(..., dry_run=True)``, which lists a missing pdsh instead of raising; ``sglang``: check
    SGLang's install (not with ``--no-actors``)."""
    data_problems, skipped = check_dataset(cfg, root)
    problems = [*missing_files(cfg, root), *plan.problems, *tool_problems(plan, environ), *data_problems]
    if sglang and (problem := sglang_install_problem(cfg, plan)):
        problems.append(problem)
    return problems, skipped
