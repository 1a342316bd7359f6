"""A run's process tree read from /proc: which component each process is, who is alive, which ports are free.

Not a CLI; used by ``ops.chaos.nemesis`` (to find a fault's target) and ``ops.bench.chaos`` (nothing left
behind). Linux only, and only the caller's own processes are ever signalled.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

# (text in the command line, component), first match wins: an actor's rollout_server runs `-m actors.rollout_server`.
# An SGLang engine (the launcher's child) is its HTTP server process, `-m sglang.launch_server`: its scheduler and
# detokenizer are spawned (`sglang::scheduler` once titled) and die with it once their imports have set their
# parent-death signal (before that, the launcher ends them: ops.launch_child, ops.launch_engines).
KINDS = (("actors.rollout_server", "engine"), ("-m sglang.launch_server", "engine"), ("-m buffer ", "buffer"),
         ("learner.sft", "bootstrap"), ("-m learner", "learner"), ("-m actors ", "actor"), ("deepspeed", "learner"))


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0], int(fields[1])


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T stopped, Z zombie, ...), None when it is gone."""
    s = _stat(pid)
    return None if s is None else s[0]


def alive(pid: int) -> bool:
    """Running or stopped (a zombie nobody has reaped yet holds no port and runs nothing)."""
    s = _stat(pid)
    return s is not None and s[0] not in "ZX"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (s := _stat(int(name))) is not None and s[0] not in "ZX":
            children.setdefault(s[1], []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kind(pid: int) -> str:
    cmd = cmdline(pid) + " "
    return next((k for needle, k in KINDS if needle in cmd), "other")


def components(launcher: int) -> dict[str, list[int]]:
    """The launcher's descendants by component (engine, buffer, learner, actor, bootstrap, other)."""
    out: dict[str, list[int]] = {}
    for pid in descendants(launcher):
        out.setdefault(kind(pid), []).append(pid)
    return out


def environment(pid: int) -> bytes:
    """The process's environment as /proc holds it (NUL-separated), empty when it is gone or not ours to read."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def listening(pid: int) -> bool:
    """Whether the process holds a listening TCP socket (an engine's HTTP server bound: it has started), read
    from its own network namespace's table."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    inodes = set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        # Columns: sl local_address rem_address st ... inode (10th); st 0A is LISTEN.
        if any(len(f := row.split()) > 9 and f[3] == "0A" and f[9] in inodes for row in rows):
            return True
    return False


def mentioning(text: str) -> list[str]:
    """Live processes (other than this one) whose command line or environment contains ``text``: a run's
    leftovers. The environment catches what names the run only there: an SGLang engine's spawned scheduler
    and detokenizer carry the run's ``TMPDIR`` (``tmp/vapo-engine-<i>``), not its path on their command line."""
    needle = text.encode()
    return [f"{p}: {cmdline(int(p))}" for p in os.listdir("/proc")
            if p.isdigit() and int(p) != os.getpid() and alive(int(p))
            and (text in cmdline(int(p)) or needle in environment(int(p)))]


def port_free(port: int) -> bool:
    """Bindable the way the servers bind (SO_REUSEADDR, as ZeroMQ and the HTTP servers set it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
