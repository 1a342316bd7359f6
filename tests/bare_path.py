"""A PATH as on a bare machine: every program of this one's PATH except those of the system packages CI
installs (openssh-server, pdsh, Slurm, munge, Prometheus), so a test sees what a newcomer's clone sees
without uninstalling anything.

    env = {**os.environ, "PATH": bare_path(tmp_path)}
    PATH="$(python -m tests.bare_path DIR)" ops/test.sh ...   # .ci/run's bare-machine step
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The programs of Debian's pdsh, openssh-server, slurm-wlm / slurm-client, munge and prometheus packages.
HIDDEN = frozenset({"pdsh", "pdsh.bin", "pdcp", "rpdcp", "dshbak", "sshd", "srun", "sbatch", "salloc", "sattach",
                    "sbcast", "scancel", "scontrol", "sinfo", "squeue", "sacct", "sacctmgr", "sdiag", "sprio",
                    "sreport", "sshare", "sstat", "strigger", "sview", "munge", "unmunge", "remunge", "mungekey",
                    "munged", "prometheus", "promtool"})
HIDDEN_PREFIXES = ("slurm", "munge", "pdsh")


def hidden(name: str) -> bool:
    return name in HIDDEN or name.startswith(HIDDEN_PREFIXES)


def bare_path(tmp: Path, path: str | None = None) -> str:
    """A directory under ``tmp`` of links to every program on ``path`` (default: this process's PATH) but the
    hidden ones, first found first as PATH would; its path, to use as PATH."""
    d = tmp / "bare-bin"
    d.mkdir(parents=True, exist_ok=True)
    for entry in (path if path is not None else os.environ.get("PATH", "")).split(os.pathsep):
        if not entry or not Path(entry).is_dir():
            continue
        for prog in sorted(Path(entry).iterdir()):
            link = d / prog.name
            if not hidden(prog.name) and not link.exists() and not link.is_symlink():
                link.symlink_to(prog)
    return str(d)


if __name__ == "__main__":
    print(bare_path(Path(sys.argv[1])))
