"""A supervised child of the launcher (``ops/launch.py``): its own process group and log, a lifeline to the
launcher, and for a process behind ssh the link the launcher beats on (``common.remote``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import lifeline
from ops.launch_failure import OutputTail

ROOT = Path(__file__).resolve().parents[1]
# Slurm's task variables too: a learner rank derives its rank from them when RANK is unset, and in the batch
# script's environment they describe the batch step, not the child.
_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@dataclass
class Child:
    """One supervised process (its own process group, so its engine children stop with it)."""

    name: str
    cmd: list[str]
    log_path: Path
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    via: str = ""  # "ssh": its stdin is the ssh link the launcher beats on; "pdsh": a local guard's stdin (common.remote)
    host: str = ""
    stop_signal: int = signal.SIGTERM  # "" and srun: how it is asked to stop (srun'd: common.remote.SRUN_STOP)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    output: OutputTail | None = None  # its output on the way to its log, the last lines kept in memory

    def start(self) -> None:
        self.end_group()  # a restart: what the last process left behind goes first
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.log_path, "ab") as log:
                log.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(self.cmd)}\n".encode())
        except OSError:
            pass  # a full disk: the child may still run, and its output is kept in memory (OutputTail)
        # A parent that ran torch.distributed leaves rendezvous variables behind; a child learner would try
        # to reuse that (taken) MASTER_PORT. Each child sets up its own.
        env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS_VARS}
        env.update(self.env)
        # lifeline: the child (and, transitively, its own children) dies with this launcher, even on SIGKILL.
        kw = lifeline.popen_kwargs(env)
        if self.via == "pdsh":
            # A guard (common.remote) around DeepSpeed's runner: it must outlive this launcher long enough to
            # stop the runner's process group, pdsh and its ssh clients included, when our end of its stdin
            # closes; killed with us by the parent-death signal it could not.
            kw.pop("preexec_fn", None)
        # Through a pipe the launcher reads: a child whose log write fails on a full disk still has its last
        # lines (the error saying so included) in the launcher's memory for the failure message.
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     stdin=subprocess.PIPE if self.via in ("ssh", "pdsh") else None, **kw)
        assert self.proc.stdout is not None
        self.output = OutputTail(self.proc.stdout, self.log_path)
        self.started_at = time.time()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def end_group(self) -> None:
        """SIGKILL what is left of the last process's group once that process has exited. An SGLang server
        killed during its start leaves its spawned scheduler and detokenizer (and their resource tracker) behind:
        they set their parent-death signal only after their imports, and live on as orphans in its group; the
        end of the run kills only the current process's group."""
        if self.proc is not None and self.proc.poll() is not None:
            self.signal(signal.SIGKILL)

    def ask_to_stop(self) -> None:
        """The orderly stop: end of its ssh link (or the pdsh guard's stdin), else its stop signal."""
        if self.via in ("ssh", "pdsh"):
            self.hang_up()
        else:
            self.signal(self.stop_signal)

    def beat(self) -> None:
        """One heartbeat byte down the ssh link (the remote guard stops its process without them)."""
        try:
            if self.proc is not None and self.proc.stdin is not None and self.alive():
                self.proc.stdin.write(b"\n")
                self.proc.stdin.flush()
        except (OSError, ValueError):  # the link is gone or closed: supervision sees the exit
            pass

    def hang_up(self) -> None:
        """End of file on the ssh link: the remote guard stops its process (SIGTERM, then SIGKILL)."""
        try:
            if self.proc is not None and self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass

    def tail(self, lines: int = 15) -> str:
        """Its last output lines: from memory (complete even when the log could not be written)."""
        if self.output is not None:
            if self.returncode is not None:
                self.output.wait()
            text = self.output.tail(lines)
        else:
            try:
                text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                return ""
        return "\n".join("    " + line for line in text)


class LaunchError(RuntimeError):
    """A stop of the run. ``lost``: the stop of a lost process or host, which ``--resume`` (and the automatic
    resume, ``ops.launch_resume``) recovers from; ``hosts``: the hosts to wait for before that."""

    def __init__(self, component: str, message: str, *, lost: bool = False, hosts: tuple[str, ...] = ()) -> None:
        super().__init__(f"{component}: {message}")
        self.component = component
        self.lost = lost
        self.hosts = hosts
