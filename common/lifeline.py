"""Child processes that die with the process that started them, however it ends (SIGKILL included).

Not a CLI. Every place that spawns a long-lived vapo process (the launcher's components, an actor's
engine) passes ``**lifeline.popen_kwargs(env)`` to ``subprocess.Popen`` / ``asyncio.create_subprocess_exec``.
Without it a launcher killed with SIGKILL leaves its buffer, actors and engines running under PID 1,
still bound to their ports, so the next launch cannot start.

Two mechanisms, because neither covers every case alone:

- **Parent-death signal** (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set in the child between fork and
  exec): the kernel kills the child when its parent dies. Applied at each level it is transitive
  (launcher → actor → engine). The kernel ties it to the parent *thread* that forked, so spawn from a
  thread that lives as long as the child (the launcher and the actors spawn from their main thread).
  A parent that died between fork and ``prctl`` is caught by comparing ``getppid()`` with the spawner.
- **Ancestor watchdog** (``watch_ancestor()``): ``popen_kwargs`` also puts ``VAPO_LIFELINE=<pid>:<start
  time>:<scope>`` of the spawner into the child's environment. Processes started by a third-party launcher
  in between (learner ranks under ``deepspeed``/``torchrun``, which spawn without our prctl) inherit it
  and call ``watch_ancestor()`` at start: a daemon thread blocks on a pidfd of that ancestor and kills
  its own process when the ancestor exits. The start time guards against a reused pid; the boot id and
  pid namespace in the token make a copy that travelled to another host (ssh, srun) a no-op there.
  Processes on other hosts are tied to their ssh link instead (``common.remote``), or to srun.

SIGKILL, not SIGTERM: the parent that would have run the orderly stop is gone, and a child stuck in a
blocking call could ignore SIGTERM forever. Everything durable in vapo is written to survive SIGKILL
(LMDB commits, checkpoints and weight versions renamed into place when complete).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("vapo.lifeline")

ENV_VAR = "VAPO_LIFELINE"
_PR_SET_PDEATHSIG = 1
_LINUX = sys.platform.startswith("linux")
# Resolved in the parent: the child runs only the call between fork and exec (no dlopen there).
_prctl: Callable[..., int] | None = None
if _LINUX:
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        _prctl = None


def start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot, /proc/<pid>/stat field 22), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: count fields after its last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[19])


def scope() -> str:
    """This machine's boot and pid namespace: a pid means something only where both are the same."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return "unknown"


def token(pid: int | None = None) -> str:
    """``<pid>:<start time>:<scope>`` naming one process unambiguously (a pid alone may be reused, and means
    nothing on another host or in another pid namespace)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid) or 0}:{scope()}"


def _die_with(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:  # runs in the child between fork and exec: no imports, no allocation-heavy work
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def popen_kwargs(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``preexec_fn`` and ``env`` for a child that must not outlive this process.

    ``env`` is the child's environment (default: this process's); the lifeline token is added to it.
    """
    child_env = dict(os.environ if env is None else env)
    child_env[ENV_VAR] = token()
    if not _LINUX:
        return {"env": child_env}
    if threading.current_thread() is not threading.main_thread():
        # The parent-death signal would fire when this thread ends, not when the process does.
        log.debug("lifeline child spawned from thread %s: it dies when that thread exits",
                  threading.current_thread().name)
    return {"preexec_fn": _die_with(os.getpid()), "env": child_env}


def _parse(value: str) -> tuple[int, int, str] | None:
    try:
        pid, started, where = value.split(":", 2)
        return int(pid), int(started), where
    except ValueError:
        return None


def _ancestor_alive(pid: int, started: int) -> bool:
    now = start_time(pid)
    return now is not None and (started == 0 or now == started)


def watch_ancestor(value: str | None = None, on_death: Callable[[], None] | None = None) -> threading.Thread | None:
    """Kill this process when the process named by ``VAPO_LIFELINE`` (or ``value``) exits.

    For processes spawned by a launcher we do not control (DeepSpeed/torchrun ranks). A no-op without the
    variable, and when this process *is* the named one. ``on_death`` replaces the SIGKILL (tests).
    Returns the watchdog thread, or None.
    """
    value = os.environ.get(ENV_VAR) if value is None else value
    parsed = _parse(value) if value else None
    if parsed is None:
        if value:
            log.warning("ignoring malformed %s=%r (expected <pid>:<start time>:<scope>)", ENV_VAR, value)
        return None
    pid, started, where = parsed
    if pid == os.getpid():
        return None
    if where != scope():
        # Inherited across hosts (a launcher that forwards the whole environment over ssh/srun) or pid
        # namespaces: that pid is not our ancestor here, and its absence must not kill this process.
        log.info("lifeline: %s names a process on another host or pid namespace; not watching it", ENV_VAR)
        return None
    die = on_death or (lambda: os.kill(os.getpid(), signal.SIGKILL))
    fd: int | None = None
    try:
        fd = os.pidfd_open(pid)  # readable once the process exits; no polling
    except ProcessLookupError:
        fd = None
    except (OSError, AttributeError):  # kernel < 5.3 or no permission: poll /proc instead
        fd = -1
    if fd is None or not _ancestor_alive(pid, started):
        log.error("lifeline: ancestor %s is gone; exiting", value)
        if fd is not None and fd >= 0:
            os.close(fd)
        die()
        return None

    def watch() -> None:
        if fd >= 0:
            select.select([fd], [], [])
            os.close(fd)
        else:
            while _ancestor_alive(pid, started):
                threading.Event().wait(1.0)  # no pidfd: check the ancestor once a second
        log.error("lifeline: ancestor %s exited; this process stops with it", value)
        die()

    t = threading.Thread(target=watch, name="lifeline", daemon=True)
    t.start()
    return t


__all__ = ["ENV_VAR", "popen_kwargs", "scope", "start_time", "token", "watch_ancestor"]
