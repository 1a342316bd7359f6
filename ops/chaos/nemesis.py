"""The nemesis: picks faults at random (seeded) and applies them to a live run's processes.

Not a CLI; ``ops.bench.chaos`` runs :meth:`Nemesis.run` in a thread beside the launcher. Each fault is
recorded with its time (seconds since the chaos run started), kind and target. What this single machine
can do without root:

- ``kill_buffer``, ``kill_actor``, ``kill_engine``, ``kill_learner``: SIGKILL of that component (the
  launcher restarts the buffer at most 3 times per start, so at most 3 per start here; a learner kill
  stops the run, and the chaos run resumes it with ``--resume``; only after a checkpoint exists);
- ``stop_engine``: SIGSTOP of an engine for a few seconds, then SIGCONT (its actor may find a rollout_server
  unhealthy and restart it meanwhile; an SGLang engine's stopped HTTP server holds its tokenizer manager, so
  its requests wait, and its actor waits for it);
- ``slow_metrics``: for a while, clients that open every ``/metrics`` port and send their request one byte
  a second, and a scraper that reads the answer one byte a second;
- ``disk_full``: the buffer process's soft ``RLIMIT_FSIZE`` lowered to 8 KiB for a while (``prlimit``, no
  root): LMDB's writes past it fail with EFBIG as on a full disk (the buffer reports ``file_too_large``
  storage errors and refuses groups; Python ignores SIGXFSZ), then restored.

- ``host_down``, ``partition`` (a cluster run only, ``ops.chaos.cluster``): every process of a host killed
  and the host back later; a host's link down and up.

Faults with a duration overlap the faults picked after them (one of each kind at a time). With ``heal_at``
the faults end once that version is published (a final heal: those in force are undone at once), so that
"every engine ends on the final version" tests convergence, not a fault that happened to hit the last push.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from learner.checkpoint import complete_checkpoints
from learner.weights import complete_versions
from ops.chaos.procs import alive, components, listening

KINDS = ("kill_buffer", "kill_actor", "kill_engine", "kill_learner", "stop_engine", "slow_metrics", "disk_full")
# How often each kind is picked: a learner kill costs a whole restart, so it comes least often (the cluster's
# host faults, ops.chaos.cluster, are picked only in a cluster run).
WEIGHTS = {"kill_buffer": 2, "kill_actor": 2, "kill_engine": 2, "kill_learner": 1, "stop_engine": 2,
           "slow_metrics": 2, "disk_full": 2, "host_down": 2, "partition": 2}
HOST_FAULTS = ("host_down", "partition")
BUFFER_KILLS_PER_START = 3  # the launcher restarts a dead buffer 3 times per start (common/placement.py)
FSIZE_FULL = 8 << 10  # LMDB's two meta pages: every data page written past them fails


class Hosts(Protocol):
    """A cluster run's hosts as the nemesis uses them (``ops.chaos.cluster.ClusterView``)."""

    def components(self) -> dict[str, list[int]]: ...
    def engine_hosts(self) -> list[str]: ...
    def host_for(self, fault: str, rng: random.Random, checkpointed: bool) -> str | None: ...
    def host_down(self, host: str) -> int: ...
    def host_up(self, host: str) -> None: ...
    def link(self, host: str, up: bool) -> None: ...


@dataclass
class Target:
    """What the nemesis may hit now: the current launcher's pid and the run's /metrics ports."""

    launcher: int
    run_dir: Path
    metrics_ports: list[int]
    buffer_kills: int = 0  # in this launcher start
    cluster: Hosts | None = None  # a cluster run: processes on every host, and host faults

    def components(self) -> dict[str, list[int]]:
        """The run's processes by component; an engine only once it serves (its HTTP port listening): a live
        SGLang server takes ~40-70 s to start here, so faults every 15 s would hit nothing but starts."""
        comps = self.cluster.components() if self.cluster is not None else components(self.launcher)
        if "engine" in comps:
            comps["engine"] = [pid for pid in comps["engine"] if listening(pid)]
        return comps


@dataclass
class Nemesis:
    """Seeded random faults every ``interval_s`` (± half) until ``stop`` is set or ``until`` passes."""

    seed: int
    interval_s: float
    t0: float
    until: float
    kinds: tuple[str, ...] = KINDS
    faults: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    target: Target | None = None  # None while no launcher runs (between a stop and its resume)
    # The final heal (as Jepsen heals before its final reads): once this version is published no fault is
    # picked and those in force are undone, so every engine can take the last versions (None: never).
    heal_at: int | None = None
    _busy: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        rng = random.Random(self.seed)
        while not self.stop.is_set() and time.time() < self.until:
            if self.stop.wait(rng.uniform(0.5, 1.5) * self.interval_s) or time.time() >= self.until:
                break
            target = self.target
            if target is None:
                continue
            if self.heal_at is not None and max(complete_versions(target.run_dir / "weights"), default=0) >= self.heal_at:
                self.record("heal", version=self.heal_at)
                break
            options = [k for k in self.kinds if k not in self._busy and self._possible(k, target)]
            if options:
                fault = rng.choices(options, weights=[WEIGHTS[k] for k in options])[0]
                self._apply(fault, target, rng)
        self.stop.set()

    def _possible(self, fault: str, t: Target) -> bool:
        comps = t.components()
        # Faults hit a running pipeline: a launcher still starting its children (or a learner before its
        # first published version) would fail its start, which tests the start, not the run.
        if not {"buffer", "learner", "actor", "engine"} <= set(comps) or not complete_versions(t.run_dir / "weights"):
            return False
        need = {"kill_buffer": "buffer", "disk_full": "buffer", "kill_actor": "actor", "kill_engine": "engine",
                "stop_engine": "engine", "kill_learner": "learner"}.get(fault)
        if need is not None and not comps.get(need):
            return False
        if fault == "kill_buffer":
            return t.buffer_kills < BUFFER_KILLS_PER_START
        if fault == "kill_learner":
            return bool(complete_checkpoints(t.run_dir / "checkpoints"))
        if fault in HOST_FAULTS:
            return t.cluster is not None and bool(t.cluster.engine_hosts())
        return True

    def record(self, kind: str, **detail: Any) -> dict[str, Any]:
        """Append a fault to the log; returns its entry (a fault's undo may add what it saw)."""
        entry = {"t": round(time.time() - self.t0, 1), "kind": kind, **detail}
        with self._lock:
            self.faults.append(entry)
        return entry

    def _apply(self, fault: str, t: Target, rng: random.Random) -> None:
        if fault in HOST_FAULTS and t.cluster is not None:
            self._host_fault(fault, t, t.cluster, rng)
            return
        comps = t.components()
        need = "engine" if fault == "stop_engine" else "buffer" if fault == "disk_full" else fault.removeprefix("kill_")
        if fault != "slow_metrics" and not comps.get(need):
            return  # gone since it was picked (a restart in progress): pick again next turn
        if fault.startswith("kill_"):
            pid = rng.choice(sorted(comps[fault.removeprefix("kill_")]))
            t.buffer_kills += fault == "kill_buffer"
            _signal(pid, signal.SIGKILL)
            self.record(fault, pid=pid)
            return
        duration = round(rng.uniform(3.0, 12.0), 1)
        if fault == "stop_engine":
            pid = rng.choice(sorted(comps["engine"]))
            _signal(pid, signal.SIGSTOP)
            self._later(fault, duration, lambda: _signal(pid, signal.SIGCONT))
            self.record(fault, pid=pid, duration_s=duration)
        elif fault == "disk_full":
            pid, duration = rng.choice(sorted(comps["buffer"])), round(duration * 2.5, 1)  # long enough for writes
            port = t.metrics_ports[0] if t.metrics_ports else None  # the buffer's (a cluster's is in its namespace)
            old, before = _limit_fsize(pid, FSIZE_FULL), _storage_errors(port)
            entry = self.record(fault, pid=pid, duration_s=duration, fsize_bytes=FSIZE_FULL)

            def undo() -> None:
                _limit_fsize(pid, old)
                # Whether writes came while it was full (ingest and serve count each failed commit).
                entry["storage_errors"] = max(0, _storage_errors(port) - before)
            self._later(fault, duration, undo)
        elif fault == "slow_metrics":
            done = threading.Event()
            for port in t.metrics_ports:
                threading.Thread(target=_slow_client, args=(port, done), daemon=True).start()
            self._later(fault, duration, done.set)
            self.record(fault, ports=len(t.metrics_ports), duration_s=duration)

    def _host_fault(self, fault: str, t: Target, cluster: Hosts, rng: random.Random) -> None:
        """A host down (every process killed) or cut off (its link down) for a while, then back."""
        host = cluster.host_for(fault, rng, checkpointed=bool(complete_checkpoints(t.run_dir / "checkpoints")))
        if host is None:
            return
        if fault == "host_down":
            duration = round(rng.uniform(15.0, 40.0), 1)  # past the launcher's first probes
            killed = cluster.host_down(host)
            self._later(fault, duration, lambda: cluster.host_up(host))
            self.record(fault, host=host, processes=killed, duration_s=duration)
        else:
            duration = round(rng.uniform(5.0, 20.0), 1)
            cluster.link(host, up=False)
            self._later(fault, duration, lambda: cluster.link(host, up=True))
            self.record(fault, host=host, duration_s=duration)

    def _later(self, kind: str, after_s: float, undo: Callable[[], Any]) -> None:
        """Mark ``kind`` busy and undo it after ``after_s`` (or at once when the nemesis stops)."""
        self._busy.add(kind)

        def end() -> None:
            self.stop.wait(after_s)
            try:
                undo()
            finally:
                self._busy.discard(kind)
        threading.Thread(target=end, daemon=True).start()

    def wait_undone(self, timeout_s: float = 30.0) -> None:
        deadline = time.time() + timeout_s
        while self._busy and time.time() < deadline:
            time.sleep(0.1)


def _signal(pid: int, sig: int) -> None:
    if alive(pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _limit_fsize(pid: int, soft: int) -> int:
    """Set ``pid``'s soft RLIMIT_FSIZE (the hard one unchanged); returns the previous soft limit."""
    try:
        old, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (min(soft, hard) if hard != resource.RLIM_INFINITY else soft, hard))
        return old
    except (ProcessLookupError, PermissionError):  # gone (killed or restarted): its successor has no limit
        return resource.RLIM_INFINITY


def _storage_errors(port: int | None) -> int:
    """The buffer's ``vapo_buffer_storage_errors_total`` over every reason (0 when it does not answer)."""
    if port is None:
        return 0
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:  # loopback only
            text = r.read().decode()
    except OSError:
        return 0
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vapo_buffer_storage_errors_total")))


def _slow_client(port: int, done: threading.Event) -> None:
    """One slow-sending and one slow-reading /metrics client on ``port`` until ``done``."""
    request = f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sender, \
                socket.create_connection(("127.0.0.1", port), timeout=5) as reader:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            reader.sendall(request)
            for i in range(len(request)):
                if done.wait(1.0):
                    return
                sender.sendall(request[i:i + 1])
                reader.recv(1)
            while not done.wait(1.0):
                reader.recv(1)
    except OSError:  # the server closed on us (a timeout, a restart): that is its right
        return
