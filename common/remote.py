"""Processes on other hosts: the ssh options, the command that starts them, and their lifeline.

    wrap_remote(cfg, host, argv, env, root, py)   # the ssh or srun command the plan gives a remote process
    ssh_options(cfg, environ)                     # options of every ssh the launcher (and pdsh) runs
    python -m common.remote --timeout S -- ARGV   # on the remote host: ARGV, which dies with its ssh link
    python -m common.remote --no-link [--private-tmp PREFIX] -- ARGV   # srun'd: stops on SIGUSR1 (SRUN_STOP)
    pdsh_failures(text)                           # hosts whose pdsh'd ssh (learner ranks) exited non-zero

A process started over ssh runs under a guard (``main`` here) that watches its stdin, which is the ssh
channel: the launcher writes a heartbeat byte every ``placement.ssh_alive_interval_s`` and closes it to stop
the process. The guard stops its process (SIGTERM, SIGKILL after ``GRACE_S``) on end of file (the launcher
stopped, died, or its ssh client was killed) or when no byte came for ``interval × ssh_alive_count_max``
seconds (the link is gone, however the remote sshd is configured). Once its process has ended, however it
ended, the guard also stops what is left of that process's group: a DeepSpeed runner killed outright leaves its
pdsh, whose ssh sessions would keep the remote learner ranks, and their ports, alive. On the launcher's side ssh's own
keep-alive (ServerAliveInterval × ServerAliveCountMax) ends the ssh client with exit code 255 within the
same bound, which the launcher reads as a lost host. Learner ranks on other hosts start through DeepSpeed's
pdsh launcher, which gives them no stdin: their ssh gets a terminal (``-tt``), so the kernel sends them
SIGHUP when the session closes, and pdsh reports a lost host as ``<host>: ssh exited with exit code 255``.
An srun'd process has no link either (srun hands the step the launcher's stdin, which may be closed): it
runs under the guard with ``--no-link`` and is asked to stop with ``SRUN_STOP`` (SIGUSR1): srun passes
SIGUSR1 and SIGUSR2 to its step as they are, but turns SIGTERM, SIGHUP and a second SIGINT within a second
into SIGKILL for the whole step. Slurm delivers it to every process of the step, so the guard starts its command with the signal
ignored (an ignored signal stays ignored across exec) and stops it with SIGTERM, as over ssh. The learner's
srun step (all its ranks) has no guard: stopped, it is killed, which its checkpoints are written to survive.

An SGLang engine on another host runs under the guard with ``--private-tmp vapo-engine-<i>-``: the guard
makes a directory in that host's temporary directory, runs the engine with it as ``TMPDIR``
(``common.sglang_args.private_tmp_env``: SGLang's ipc socket files and its Prometheus directory go there,
never removed by SGLang) and removes it once the engine has stopped, however it stopped, unless the guard
itself is killed (SIGKILL, the host lost), whose directory stays.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from common import lifeline
from common.config import Config
from common.sglang_args import private_tmp_env

SSH_ARGS_ENV = "VAPO_SSH_ARGS"  # extra ssh options from the environment, after placement.ssh_args
SSH_LOST = 255  # ssh's exit code when the connection fails or is lost (a remote command's own codes pass through)
GRACE_S = 4.0  # SIGTERM → SIGKILL on the remote host; below the launcher's own stop grace (6 s)
SRUN_STOP = signal.SIGUSR1  # the launcher's stop for an srun'd process: srun forwards it unchanged
# Variables of the launcher's environment that every process on another host needs as well: socket
# interfaces and rendezvous tuning (gloo otherwise binds the address its hostname resolves to, which
# Debian's /etc/hosts makes 127.0.1.1: unreachable from the other ranks), and the run-time settings
# ops/launch.sh exports (offline Hugging Face, the torch extensions cache, passive OpenMP waits).
FORWARD_PREFIXES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_IB_", "NCCL_DEBUG",
                    "TORCH_NCCL_", "TORCH_DISTRIBUTED_DEBUG", "HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE",
                    "TOKENIZERS_PARALLELISM", "TORCH_EXTENSIONS_DIR", "OMP_WAIT_POLICY")
_PDSH_EXIT = re.compile(r"^pdsh@[^:]+: ([^:\s]+): ssh exited with exit code (\d+)", re.MULTILINE)


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``FORWARD_PREFIXES`` set in ``environ`` (default: this process's)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(FORWARD_PREFIXES)}


def user_ssh_args(cfg: Config, environ: Mapping[str, str] | None = None) -> list[str]:
    """``placement.ssh_args`` then ``$VAPO_SSH_ARGS`` (e.g. ``-F cluster_ssh_config``), split like a shell."""
    environ = os.environ if environ is None else environ
    return shlex.split(cfg.placement.ssh_args) + shlex.split(environ.get(SSH_ARGS_ENV, ""))


def ssh_options(cfg: Config, environ: Mapping[str, str] | None = None) -> list[str]:
    """Options of every ssh to another host. The user's come first: ssh keeps the first value of an option."""
    pl = cfg.placement
    return [*user_ssh_args(cfg, environ), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={pl.ssh_connect_timeout_s}",
            "-o", f"ServerAliveInterval={pl.ssh_alive_interval_s}", "-o", f"ServerAliveCountMax={pl.ssh_alive_count_max}"]


def lost_after_s(cfg: Config) -> int:
    """Seconds after which a silent ssh link counts as lost, on both ends."""
    return cfg.placement.ssh_alive_interval_s * cfg.placement.ssh_alive_count_max


def pdsh_ssh_args(cfg: Config, environ: Mapping[str, str] | None = None) -> str:
    """``PDSH_SSH_ARGS_APPEND`` for DeepSpeed's pdsh launcher: one already in the environment first, then
    ours (pdsh splits it on blanks, so no quoting)."""
    environ = os.environ if environ is None else environ
    inherited = environ.get("PDSH_SSH_ARGS_APPEND", "").split()
    return " ".join([*inherited, *ssh_options(cfg, environ), "-tt"])


def srun_cpus(cfg: Config, environ: Mapping[str, str] | None = None) -> int:
    """CPUs of an srun'd engine/actor step: ``placement.srun_cpus_per_task``, or when 0 the CPUs Slurm gave
    this (host 0's) allocation, ``$SLURM_CPUS_ON_NODE``; 0 = leave srun's default."""
    environ = os.environ if environ is None else environ
    if cfg.placement.srun_cpus_per_task:
        return int(cfg.placement.srun_cpus_per_task)
    try:
        return int(environ.get("SLURM_CPUS_ON_NODE", "0"))
    except ValueError:
        return 0


def wrap_remote(cfg: Config, host: str, argv: list[str], env: dict[str, str], root: Path, py: str,
                environ: Mapping[str, str] | None = None, private_tmp: str = "") -> list[str]:
    """``argv`` with ``env`` run on ``host`` from the same repository path (a shared filesystem); with
    ``private_tmp`` (a name prefix) in a temporary directory of its own on that host (module docstring)."""
    inner = ["env", *(f"{k}={v}" for k, v in sorted(env.items()))]
    tmp = ["--private-tmp", private_tmp] if private_tmp else []
    if cfg.placement.remote == "srun":
        # --overlap: the step shares the allocation's nodes with the others (engines, learner). Without
        # --cpus-per-task a step gets one CPU, and an engine or actor confined to it crawls.
        cpus = srun_cpus(cfg, environ)
        # srun forwards the launcher's stdin, which may be closed: the guard must not read it as a lost link.
        # It is there to turn the launcher's SRUN_STOP into a SIGTERM for the process (module docstring).
        guarded = [py, "-m", "common.remote", "--no-link", *tmp, "--"]
        return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap",
                *([f"--cpus-per-task={cpus}"] if cpus else []), f"--chdir={root}", *inner, *guarded, *argv]
    guarded = [*inner, py, "-m", "common.remote", "--timeout", str(lost_after_s(cfg)), *tmp, "--", *argv]
    return ["ssh", *ssh_options(cfg, environ), host, f"cd {shlex.quote(str(root))} && exec {shlex.join(guarded)}"]


def pdsh_failures(text: str) -> dict[str, int]:
    """``{host: exit code}`` of every ``pdsh@here: host: ssh exited with exit code N`` line in ``text``."""
    return {m.group(1): int(m.group(2)) for m in _PDSH_EXIT.finditer(text)}


# ------------------------------------------------------------------------------------ the remote guard


def _stop(child: subprocess.Popen, grace_s: float) -> int:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            rc = _code(child.wait(timeout=grace_s))
        except subprocess.TimeoutExpired:
            continue
        _end_group(child.pid, grace_s)  # a member slower than the child to take the SIGTERM
        return rc
    return _code(child.wait())


def _end_group(pgid: int, grace_s: float) -> None:
    """Stop what is left of the child's process group once the child has exited (SIGTERM, then SIGKILL after
    ``grace_s``): a killed DeepSpeed runner leaves its pdsh, whose ssh sessions keep the remote ranks alive
    until their collectives time out, holding their ports (and GPUs) from the next start."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return  # the group is empty
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)  # polling for the group to empty, with a deadline


def _deaf_to_srun_stop(kw: dict[str, Any]) -> dict[str, Any]:
    """Popen arguments whose child starts with ``SRUN_STOP`` ignored: Slurm signals every process of a step,
    and the command must stop on the guard's SIGTERM, not die by SIGUSR1's default action."""
    inner = kw.get("preexec_fn")

    def preexec() -> None:
        signal.signal(SRUN_STOP, signal.SIG_IGN)
        if inner is not None:
            inner()

    return {**kw, "preexec_fn": preexec}


def _code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N: 128 + N, as a shell reports it


def guard(argv: list[str], timeout_s: float, grace_s: float = GRACE_S, stdin_fd: int | None = 0,
          env: Mapping[str, str] | None = None) -> int:
    """Run ``argv`` (with ``env``, default this process's) until it exits, ``stdin_fd`` reaches end of file, no
    byte arrives on it for ``timeout_s``, or this process is asked to stop. ``stdin_fd=None``: no link to watch."""
    stop = threading.Event()  # before the child starts: a stop asked meanwhile still stops it
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, SRUN_STOP):
        signal.signal(sig, lambda *_: stop.set())
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True,
                             **_deaf_to_srun_stop(lifeline.popen_kwargs(env)))
    last = [time.monotonic()]
    eof = threading.Event()

    def read() -> None:
        assert stdin_fd is not None
        while True:
            try:
                data = os.read(stdin_fd, 4096)
            except OSError:
                data = b""
            if not data:
                eof.set()
                return
            last[0] = time.monotonic()

    if stdin_fd is not None:
        threading.Thread(target=read, name="ssh-link", daemon=True).start()
    while child.poll() is None:
        if eof.is_set() or stop.is_set():
            return _stop(child, grace_s)
        if stdin_fd is not None and timeout_s > 0 and time.monotonic() - last[0] > timeout_s:
            print(f"common.remote: no heartbeat from the launcher for {timeout_s:g} s; stopping {argv[0]}",
                  file=sys.stderr, flush=True)
            return _stop(child, grace_s)
        eof.wait(0.2)  # wakes at once on end of file; otherwise re-checks the child and the deadline
    _end_group(child.pid, grace_s)  # the child is gone, its group may not be: nothing outlives the guard
    return _code(child.returncode)


@contextlib.contextmanager
def private_tmp(prefix: str) -> Iterator[dict[str, str]]:
    """The environment of a command with a temporary directory of its own (``prefix``*, in this host's
    temporary directory; ``common.sglang_args.private_tmp_env``), the directory removed on leaving."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield {**os.environ, **private_tmp_env(tmp)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.remote",
                                 description="Run a command on this host for as long as the ssh link to the launcher "
                                 "lives: stop it on end of stdin or when no heartbeat byte came for --timeout seconds.")
    ap.add_argument("--timeout", type=float, default=0.0,
                    help="seconds without a heartbeat byte before stopping (0: only end of stdin stops it)")
    ap.add_argument("--no-link", action="store_true",
                    help="no link to watch (srun): stop only when asked (SIGUSR1, which srun forwards; SIGTERM, SIGHUP, "
                    "SIGINT) or the command exits")
    ap.add_argument("--private-tmp", default="", metavar="PREFIX",
                    help="run the command with a TMPDIR of its own (PREFIX*, in this host's temporary directory), "
                    "removed once it has stopped")
    ap.add_argument("--grace", type=float, default=GRACE_S, help="SIGTERM to SIGKILL seconds")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given")
    stdin_fd = None if args.no_link else 0
    if not args.private_tmp:
        return guard(cmd, args.timeout, args.grace, stdin_fd)
    with private_tmp(args.private_tmp) as env:
        return guard(cmd, args.timeout, args.grace, stdin_fd, env)


if __name__ == "__main__":
    sys.exit(main())
