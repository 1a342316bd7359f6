"""The launcher's supervision loop (``ops/launch.py`` ``Launcher``): the learner's end, lost links, restarts,
and the elastic engines of ``launch_elastic`` (an engine host lost or an engine given up costs its share of
generation while ``placement.min_engines`` hold; a lost host is probed and its engines restarted on return).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from buffer.client import BatchClient
from common import remote
from common.placement import LEARNER_DONE_FILE
from common.security import client_curve_keys
from ops.launch_child import Child, LaunchError
from ops.launch_elastic import (
    GIVE_UP,
    HOST_LOST,
    RESTART,
    STOP,
    UNIT_ROLES,
    HostWatch,
    ReleasedCredit,
    Units,
    decide,
    minimum,
    probe_argv,
    resume_hint,
)
from ops.launch_progress import Progress, say

STATS_EVERY_S = 2.0  # buffer stats polled for the credit a lost host's actors held


class Supervision:
    """Mixed into ``Launcher``: needs ``cfg``, ``plan``, ``children``, ``metrics``, ``run_dir``, ``t0``,
    ``stopping`` and ``start(child)``."""

    cfg: Any
    plan: Any
    children: dict[str, Child]
    metrics: Any
    run_dir: Any
    t0: float
    stopping: bool
    progress: Progress

    def start(self, c: Child) -> None:  # pragma: no cover - Launcher's
        raise NotImplementedError

    def init_supervision(self) -> None:
        self.units = Units.of(self.plan.procs)
        self.roles = {p.name: p.role for p in self.plan.procs}
        self.lost: dict[str, HostWatch] = {}
        self.below_since: float | None = None
        self.released = ReleasedCredit(remote.lost_after_s(self.cfg) + 2 * STATS_EVERY_S)
        self._released_lock = threading.Lock()
        self._pdsh_offset = 0  # learner log bytes already read for pdsh's reports
        self.after_poll: Callable[[list[dict[str, Any]]], None] | None = None  # the auto-resume's lost-time clock
        self.metrics.engines_planned.set(len(self.units.members))
        self.metrics.engines_alive.set(len(self.units.members))

    def resume_note(self) -> str:
        progress = getattr(self, "progress", None)
        return resume_hint(self.run_dir, progress.records if progress is not None else [])

    def check_links(self) -> None:
        """A lost learner host stops the run: pdsh's report of a non-zero ssh exit for learner ranks (their
        peers would otherwise wait for the collective timeout), and ssh's exit 255 of any child that is not an
        engine or actor (an engine host's loss is ``decide``'s HOST_LOST)."""
        for c in self.children.values():
            if c.via == "ssh" and c.returncode == remote.SSH_LOST and self.roles.get(c.name) not in UNIT_ROLES:
                raise LaunchError(c.name, f"lost host {c.host}: ssh exited with code 255 (no answer for "
                                  f"{remote.lost_after_s(self.cfg)} s, or no connection); stopping the run "
                                  f"({self.resume_note()})\n{c.tail()}", lost=True, hosts=(c.host,))
        learner = self.children.get("learner")
        if learner is None or learner.via != "pdsh":
            return
        try:
            with open(learner.log_path, "rb") as f:
                f.seek(self._pdsh_offset)
                data = f.read()
        except OSError:
            return
        cut = data.rfind(b"\n") + 1  # whole lines only
        self._pdsh_offset += cut
        for host, code in remote.pdsh_failures(data[:cut].decode(errors="replace")).items():
            gone = code == remote.SSH_LOST
            why = "host lost (ssh exit 255)" if gone else f"its ssh exited with code {code}"
            # ssh passes on 128 + N for a remote rank killed by signal N: lost like its host, not its own error
            raise LaunchError("learner", f"learner ranks on {host} ended: {why}; stopping the run "
                              f"({self.resume_note()})\n{learner.tail()}", lost=gone or code > 128,
                              hosts=(host,) if gone else ())

    # --- one tick
    def supervise(self) -> None:
        # A resumed launch keeps the stopped one's Progress: the steps already printed are not printed again.
        progress = getattr(self, "progress", None) or Progress(self.run_dir / "metrics.jsonl", self.cfg.learner.total_steps)
        self.progress = progress
        if self.units.members and any(c.name in self.roles and self.roles[c.name] in UNIT_ROLES for c in self.children.values()):
            threading.Thread(target=self._watch_released, name="released-credit", daemon=True).start()
        while True:
            progress.poll()
            if self.after_poll is not None:
                self.after_poll(progress.records)
            if self._learner_done():
                return
            self.check_links()
            self.tend_children()
            if self.cfg.run.max_wall_seconds and time.time() - self.t0 > self.cfg.run.max_wall_seconds + 600:
                raise LaunchError("learner", "run.max_wall_seconds exceeded by more than 10 minutes")
            time.sleep(0.5)  # supervision tick

    def _learner_done(self) -> bool:
        learner = self.children["learner"]
        if learner.alive():
            return False
        self.progress.poll()
        if learner.returncode == 0 and (self.run_dir / LEARNER_DONE_FILE).exists():
            say("learner finished")
            return True
        if learner.via == "pdsh":
            # A lost rank's host is named by pdsh; the runner may exit (rank 0's collective failing, code 1)
            # before the supervision tick read that report: read the rest of the log first, so the stop is
            # told, and resumed, as the lost host it is.
            if learner.output is not None:
                learner.output.wait(2.0)
            self.check_links()
        if learner.returncode == 0:
            raise LaunchError("learner", f"exited with code 0 but never wrote {LEARNER_DONE_FILE}: a rank, or the "
                              f"pdsh/srun that carried it, was killed part-way ({self.resume_note()})\n"
                              f"{learner.tail()}", lost=True)
        if (learner.returncode or 0) < 0:  # killed by a signal (SIGKILL: the OOM killer, an operator, a lost host's stand-in)
            raise LaunchError("learner", f"exited with code {learner.returncode} (killed by a signal); stopping the "
                              f"run ({self.resume_note()})\n{learner.tail()}", lost=True)
        raise LaunchError("learner", f"exited with code {learner.returncode}\n{learner.tail()}")

    def tend_children(self, now: float | None = None) -> None:
        """Restart, give up or mark lost every exited child; probe lost hosts; stop below the minimum."""
        now = time.time() if now is None else now
        for c in list(self.children.values()):
            if c.name == "learner" or c.alive() or c.name in self.units.given_up or self._waits_for_host(c):
                continue
            role = self.roles.get(c.name, "")
            action = decide(role, c.returncode, c.via, c.restarts, c.max_restarts)
            if action == STOP:
                why = "and was restarted" if c.returncode != remote.SSH_LOST else "(its host is lost); restarted"
                gone = c.returncode == remote.SSH_LOST and c.via == "ssh"
                raise LaunchError(c.name, f"exited with code {c.returncode} {why} {c.restarts} times; stopping the "
                                  f"run ({self.resume_note()})\n{c.tail()}", lost=gone or (c.returncode or 0) < 0,
                                  hosts=(c.host,) if gone else ())
            if action == HOST_LOST:
                self.lose_host(c, now)
            elif action == GIVE_UP:
                self.give_up(c)
            elif action == RESTART:
                c.restarts += 1
                self.metrics.component_restarts.labels(component=c.name).inc()
                say(f"{c.name} exited with code {c.returncode}; restarting ({c.restarts}/{c.max_restarts})")
                self.start(c)
        for host, watch in list(self.lost.items()):
            if watch.answered(now):
                self.rejoin(host, now)
        self.check_minimum(now)

    def _waits_for_host(self, c: Child) -> bool:
        return self.roles.get(c.name) in UNIT_ROLES and c.host in self.lost

    # --- the elastic part
    def unit_children(self, host: str) -> list[Child]:
        return [c for c in self.children.values() if self.roles.get(c.name) in UNIT_ROLES and c.host == host]

    def lose_host(self, c: Child, now: float) -> None:
        host = c.host
        self.lost[host] = HostWatch(host, now, probe_argv(self.cfg, host))
        self.metrics.hosts_lost.labels(host=host).inc()
        for other in self.unit_children(host):
            self.metrics.components_up.labels(component=other.name).set(0)
            if other.alive():
                other.hang_up()  # its guard stops it, if the host still runs it
        with self._released_lock:
            dropped = self.released.host_lost(now)
        self.metrics.groups_dropped_lost_host.inc(dropped)
        alive, _ = self.units.counts(set(self.lost))
        names = ", ".join(o.name for o in self.unit_children(host))
        say(f"LOST ENGINE HOST {host}: ssh exited with code 255 (no answer for {remote.lost_after_s(self.cfg)} s, or "
            f"no connection); {names} down, the run goes on on {alive}/{len(self.units.members)} engine(s); probing "
            f"{host} with backoff to restart them when it answers\n{c.tail(5)}")

    def rejoin(self, host: str, now: float) -> None:
        watch = self.lost.pop(host)
        with self._released_lock:
            self.released.host_back(now)
        self.metrics.hosts_rejoined.labels(host=host).inc()
        restart = [c for c in self.unit_children(host) if c.name not in self.units.given_up]
        dropped = self.metrics.registry.get_sample_value("vapo_launcher_groups_dropped_lost_host_total") or 0
        say(f"engine host {host} answers again after {now - watch.lost_at:.0f} s ({watch.probes} probe(s)): "
            f"restarting {', '.join(c.name for c in restart) or 'nothing (all given up)'}; groups dropped with "
            f"lost hosts so far: {dropped:.0f} (granted to their actors, never delivered)")
        for c in restart:
            if c.alive():  # a link that has not ended yet: its guard stops the old process
                c.hang_up()
                c.signal(signal.SIGKILL)
            self.start(c)  # not counted as a restart: the host failed, not the process

    def give_up(self, c: Child) -> None:
        self.units.given_up.add(c.name)
        self.metrics.components_given_up.labels(component=c.name).inc()
        self.metrics.components_up.labels(component=c.name).set(0)
        unit = int(c.name.rsplit("-", 1)[1])
        for name in self.units.members.get(unit, []):  # an engine without its actor (or the reverse) is no use
            other = self.children.get(name)
            if other is not None and other is not c and other.alive():
                self.units.given_up.add(name)
                other.ask_to_stop()
        alive, _ = self.units.counts(set(self.lost))
        say(f"GIVING UP {c.name}: exited with code {c.returncode} after {c.restarts} restart(s) "
            f"(engine.max_restarts={c.max_restarts}); the run goes on on {alive}/{len(self.units.members)} engine(s)"
            f"\n{c.tail()}")

    def check_minimum(self, now: float) -> None:
        if not self.units.members or not any(n in self.children for ns in self.units.members.values() for n in ns):
            return  # --no-actors: the engines are not this launcher's
        alive, returning = self.units.counts(set(self.lost))
        self.metrics.engines_alive.set(alive)
        if hasattr(self, "progress"):
            self.progress.engines = (alive, len(self.units.members))
        pl = self.cfg.placement
        verdict, self.below_since = minimum(alive, returning, pl.min_engines, self.below_since, now,
                                            pl.min_engines_grace_s)
        if verdict == STOP:
            lost = f"; lost host(s) {', '.join(sorted(self.lost))}" if self.lost else ""
            raise LaunchError("engines", f"{alive} of {len(self.units.members)} engine(s) alive, below "
                              f"placement.min_engines={pl.min_engines} for {now - (self.below_since or now):.0f} s "
                              f"(placement.min_engines_grace_s={pl.min_engines_grace_s:g}){lost}; stopping the run "
                              f"({self.resume_note()})", lost=True, hosts=tuple(sorted(self.lost)))

    def _watch_released(self) -> None:
        """Samples the buffer's released credit (a thread: a slow answer never delays supervision)."""

        try:
            client = BatchClient(self.cfg.buffer.serve_addr, curve=client_curve_keys(self.cfg.buffer.curve, "monitor"),
                                 request_timeout_s=STATS_EVERY_S, ctx=zmq.Context.instance())
        except Exception:  # the count is best effort; the health probe reports a bad key
            return
        try:
            while not self.stopping:
                try:
                    released = client.stats(retries=0).get("credit_released", 0.0)
                except Exception:  # no answer this time (a busy or restarting buffer)
                    released = None
                if released is not None:
                    with self._released_lock:
                        n = self.released.sample(time.time(), released, bool(self.lost))
                    if n:
                        self.metrics.groups_dropped_lost_host.inc(n)
                time.sleep(STATS_EVERY_S)  # the sampling period
        finally:
            client.close()

    def cancel_probes(self) -> None:
        for watch in self.lost.values():
            watch.cancel()
