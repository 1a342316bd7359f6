"""Elastic engines: what the launcher (``ops/launch.py``) does when an engine or actor process, or a whole
engine host, fails, so that losing 1 of N engines costs 1/N of the generation, not the run.

An *engine* here is engine i with its actor i (``engine-i`` when the launcher starts SGLang, and ``actor-i``,
which starts a ``rollout_server`` engine itself); both run on one host. The decisions are pure functions:

- ``decide``: a child that exited is restarted while it has restarts left; an engine/actor past them is given
  up (the run goes on on the others), the buffer past them stops the run; ssh's exit 255 (the link to its host
  is lost) stops the run for a learner or buffer host, and for an engine host marks the host lost.
- ``minimum``: the run stops when fewer than ``placement.min_engines`` engines are alive and none could come
  back (all given up), or when they have been too few for longer than ``placement.min_engines_grace_s``.

``HostWatch`` probes a lost host with a cheap ``ssh HOST true`` under exponential backoff (``PROBE_FIRST_S`` to
``PROBE_MAX_S``); when it answers, the launcher starts the host's engines and actors again (not counted
against their restarts: the host failed, not they). A restarted actor asks the learner for the newest version
and loads its disk copy (``actors.weight_follower``); with the distributed push it announces itself and joins
the next push. ``ReleasedCredit`` counts the groups the lost host's actors had been granted and never
delivered: the buffer releases a closed connection's unused credit (``credit_released`` of its stats), and
the release is seen before or after the launcher sees the loss, so releases of the last ``lost_after_s``
seconds before it are counted too. The restarted actor generates those prompts again (its cursor).
"""

from __future__ import annotations

import collections
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import remote

CONTINUE, RESTART, GIVE_UP, HOST_LOST, STOP = "continue", "restart", "give_up", "host_lost", "stop"
UNIT_ROLES = ("engine", "actor")
PROBE_FIRST_S = 2.0  # first probe of a lost host; doubled after each unanswered one
PROBE_MAX_S = 30.0  # a host back up waits at most this long (plus ssh's connect timeout) for its restart
SETTLE_S = 30.0  # credit released this long after a host rejoined still counts as dropped with it


def decide(role: str, returncode: int | None, via: str, restarts: int, max_restarts: int) -> str:
    """What to do about one child (not the learner): CONTINUE (running), RESTART, GIVE_UP (an engine or actor
    past its restarts), HOST_LOST (ssh lost the link to an engine host), STOP (the buffer, or its host)."""
    if returncode is None:
        return CONTINUE
    lost = via == "ssh" and returncode == remote.SSH_LOST
    if role in UNIT_ROLES:
        if lost:
            return HOST_LOST
        return RESTART if restarts < max_restarts else GIVE_UP
    if lost:
        return STOP
    return RESTART if restarts < max_restarts else STOP


def minimum(alive: int, returning: int, needed: int, below_since: float | None, now: float,
            grace_s: float) -> tuple[str, float | None]:
    """(CONTINUE or STOP, the time the run fell below ``needed`` engines or None). ``alive``: engines running
    (or being restarted); ``returning``: engines on lost hosts that a probe may bring back."""
    if alive >= needed:
        return CONTINUE, None
    since = now if below_since is None else below_since
    if alive + returning < needed or now - since > grace_s:
        return STOP, since
    return CONTINUE, since


@dataclass
class HostWatch:
    """A lost engine host, probed with backoff until it answers."""

    host: str
    lost_at: float
    argv: list[str]  # the probe: ssh with the run's options, running ``true``
    next_probe_at: float = 0.0
    backoff_s: float = PROBE_FIRST_S
    probe: subprocess.Popen | None = None
    probes: int = 0

    def __post_init__(self) -> None:
        self.next_probe_at = self.next_probe_at or self.lost_at + self.backoff_s

    def answered(self, now: float) -> bool:
        """Poll the running probe (True: the host answered) or start the next one when it is due."""
        if self.probe is not None:
            rc = self.probe.poll()
            if rc is None:
                return False  # ssh's ConnectTimeout bounds it
            self.probe = None
            if rc == 0:
                return True
            self.next_probe_at = now + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, PROBE_MAX_S)
            return False
        if now >= self.next_probe_at:
            self.probes += 1
            self.probe = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)
        return False

    def cancel(self) -> None:
        if self.probe is not None and self.probe.poll() is None:
            self.probe.kill()
            self.probe.wait()
        self.probe = None


def probe_argv(cfg: Any, host: str) -> list[str]:
    """The cheap probe of a lost host: ssh with the run's options (connect timeout included) running ``true``."""
    return ["ssh", *remote.ssh_options(cfg), host, "true"]


class ReleasedCredit:
    """Groups dropped with lost hosts, from the buffer's ``credit_released`` counter sampled over time.

    An increase is counted while a host is lost or within ``SETTLE_S`` of its return; one seen before the loss
    was noticed is kept for ``window_s`` (the link's loss bound) and counted when it is."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.last: float | None = None
        self.recent: collections.deque[tuple[float, float]] = collections.deque()
        self.open_until = 0.0  # releases up to this time count (a host lost, or just back)

    def sample(self, now: float, released: float, losing: bool) -> int:
        """The buffer's counter now; returns the groups to count as dropped."""
        if self.last is None or released < self.last:  # the first sample, or a restarted buffer
            self.last = released
            return 0
        delta, self.last = released - self.last, released
        while self.recent and self.recent[0][0] < now - self.window_s:
            self.recent.popleft()
        if delta <= 0:
            return 0
        if losing or now <= self.open_until:
            return int(delta)
        self.recent.append((now, delta))
        return 0

    def host_lost(self, now: float) -> int:
        """A host was just seen lost: the releases of the last ``window_s`` were its actors'."""
        n = int(sum(d for t, d in self.recent if t >= now - self.window_s))
        self.recent.clear()
        return n

    def host_back(self, now: float) -> None:
        self.open_until = max(self.open_until, now + SETTLE_S)


@dataclass
class Units:
    """The run's engines: unit i is the plan's ``engine-i`` (if any) and ``actor-i``, on one host."""

    members: dict[int, list[str]] = field(default_factory=dict)  # unit -> child names
    host: dict[int, str] = field(default_factory=dict)
    given_up: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, procs: list[Any]) -> Units:
        u = cls()
        for p in procs:
            if p.role in UNIT_ROLES:
                i = int(p.name.rsplit("-", 1)[1])
                u.members.setdefault(i, []).append(p.name)
                u.host[i] = p.host
        return u

    def counts(self, lost_hosts: set[str]) -> tuple[int, int]:
        """(alive, returning): engines with nothing given up, off lost hosts / on them."""
        ok = [i for i, names in self.members.items() if not self.given_up & set(names)]
        returning = sum(1 for i in ok if self.host[i] in lost_hosts)
        return len(ok) - returning, returning


def resume_hint(run_dir: Path, records: list[dict[str, Any]]) -> str:
    """What ``--resume`` will cost: its newest checkpoint, the steps after it to redo, at this run's pace."""
    # Complete ones only (a v<N>.tmp or one without COMPLETE is never resumed); a damaged newest one can still
    # be named here: --resume verifies and falls back past it (learner.checkpoint), at more steps to redo.
    versions = [int(p.name[1:]) for p in (run_dir / "checkpoints").glob("v[0-9]*")
                if p.name[1:].isdigit() and (p / "COMPLETE").is_file()]
    steps = [r for r in records if r.get("kind") == "learner_step" and isinstance(r.get("time"), int | float)]
    done = int(steps[-1].get("weight_version", steps[-1].get("step", 0))) if steps else 0
    if not versions:
        where = "from the start (no checkpoint yet)"
        redo = done
    else:
        where = f"from its checkpoint v{max(versions)}"
        redo = max(done - max(versions), 0)
    pace = ""
    if len(steps) >= 2 and steps[-1]["time"] > steps[0]["time"]:
        per_step = (steps[-1]["time"] - steps[0]["time"]) / (len(steps) - 1)
        pace = f", ~{redo * per_step:.0f} s at this run's {per_step:.1f} s/step, plus the start"
    return f"--resume continues it {where}: {redo} step(s) to redo{pace}"
