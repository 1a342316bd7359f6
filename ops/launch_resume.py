"""The launcher's automatic resume: ``ops/launch.sh --auto-resume N`` (``run.max_resumes=N``).

A stop that ``--resume`` recovers from (a ``LaunchError`` marked ``lost``: a learner killed by a signal or
part-way, a lost learner or buffer host, too few engines while their hosts are lost, the buffer killed past its
restarts) is followed, at most N times per launch, by the resume a person would type: ``AutoResume.refusal``
first says why it must not be (N spent, a stop of the run's own making, ``learner.resume=never``, a damaged
checkpoint that ``learner.resume_damaged=refuse`` refuses, no intact checkpoint left), then ``wait_for_hosts``
probes every lost host with backoff for at most ``run.resume_wait_s`` (one progress line per probe), then the
launcher starts its stages again with the learner resuming from the newest intact checkpoint. Each resume is
said on one line (cause, checkpoint), counted (``vapo_launcher_auto_resumes_total``), appended to
``<run dir>/resumes.jsonl`` and its lost time (stop to the resumed learner's first step, plus the redone
steps at the run's pace before the stop: ``vapo_launcher_resume_lost_seconds_total``) goes to the summary.
``run_once`` is one pass of the launcher's stages and supervision, ``ops.launch.main`` loops over it.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ops.launch_child import LaunchError
from ops.launch_elastic import PROBE_FIRST_S, PROBE_MAX_S, probe_argv
from ops.launch_failure import failure_notes
from ops.launch_progress import Progress, say

RESUMES_FILE = "resumes.jsonl"


@dataclass
class Resume:
    """One automatic resume, as resumes.jsonl and the summary hold it."""

    n: int
    cause: str  # the stop's first line
    checkpoint: int | None  # the version resumed from (None: from the start, no checkpoint yet)
    stopped_at: float
    steps_before: int  # learner steps the launcher had seen at the stop
    redo_steps: int
    redo_s: float  # what the redone steps had taken, at the run's pace before the stop
    down_s: float | None = None  # stop → the resumed learner's first step (None: it never stepped)

    @property
    def lost_s(self) -> float:
        return round((self.down_s or 0.0) + self.redo_s, 1)


def _steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "learner_step" and isinstance(r.get("time"), int | float)]


def newest_intact_checkpoint(cfg: Any, run_dir: Path) -> tuple[int | None, str | None]:
    """(version the learner will resume from, None) or (None, why it refuses to resume)."""
    # torch comes with it: imported only when a resume is due, not at every launch
    from learner.checkpoint import complete_checkpoints, newest_intact  # noqa: PLC0415 - torch only when resuming

    root = run_dir / "checkpoints"
    if not complete_checkpoints(root):
        return None, None
    chosen, bad = newest_intact(root)
    if chosen is None:
        return None, f"no intact checkpoint under {root} ({'; '.join(e.what for e in bad)})"
    if bad and cfg.learner.resume_damaged == "refuse":
        return None, (f"the checkpoint is refused: {'; '.join(e.what for e in bad)} (learner.resume_damaged=refuse; "
                      f"the newest intact one is v{chosen[0]})")
    return chosen[0], None


class AutoResume:
    """The resumes of one launch: the decision, the wait, the record and the lost-time clock."""

    def __init__(self, cfg: Any, run_dir: Path, metrics: Any) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.metrics = metrics
        self.limit = cfg.run.max_resumes
        self.done: list[Resume] = []
        self.pending: Resume | None = None

    def refusal(self, e: LaunchError) -> str | None:
        """Why this stop is not resumed automatically (None: it is)."""
        if self.limit <= 0:
            return ""  # no auto-resume asked for: the stop is told as before
        if not e.lost:
            return f"not resumed automatically: {e.component} failed of its own accord, not lost; a resume would repeat it"
        if len(self.done) >= self.limit:
            return f"not resumed automatically: run.max_resumes={self.limit} resume(s) already spent in this launch"
        if self.cfg.learner.resume == "never":
            return "not resumed automatically: learner.resume=never would start the run over"
        return None

    def wait_for_hosts(self, hosts: tuple[str, ...]) -> str | None:
        """Probe every lost remote host with backoff until it answers; None when all did, else why not."""
        here = self.cfg.placement.hosts[0]
        remote = [h for h in hosts if h and h != here]
        if not remote or self.cfg.placement.remote != "ssh":  # host 0 is the launcher's; srun's nodes are Slurm's
            return None
        bound = self.cfg.run.resume_wait_s
        t0, backoff = time.time(), PROBE_FIRST_S
        waiting = list(remote)
        while waiting:
            for host in list(waiting):
                # ssh's ConnectTimeout bounds one probe
                rc = subprocess.call(probe_argv(self.cfg, host), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
                if rc == 0:
                    waiting.remove(host)
                    say(f"auto-resume: host {host} answers again after {time.time() - t0:.0f} s")
            if not waiting:
                return None
            if time.time() - t0 + backoff > bound:
                return (f"not resumed automatically: host(s) {', '.join(waiting)} did not answer within "
                        f"run.resume_wait_s={bound:g} s")
            say(f"auto-resume: waiting for host(s) {', '.join(waiting)} ({time.time() - t0:.0f}/{bound:g} s; "
                f"next probe in {backoff:.0f} s)")
            time.sleep(backoff)  # the probe's backoff
            backoff = min(backoff * 2, PROBE_MAX_S)
        return None

    def begin(self, e: LaunchError, records: list[dict[str, Any]], checkpoint: int | None) -> Resume:
        """Record the resume about to start, and say it."""
        steps = _steps(records)
        done = int(steps[-1].get("weight_version", steps[-1].get("step", 0))) if steps else 0
        redo = max(done - (checkpoint or 0), 0)
        pace = (steps[-1]["time"] - steps[0]["time"]) / (len(steps) - 1) if len(steps) >= 2 else 0.0
        cause = str(e).splitlines()[0].split("; stopping the run")[0]  # the --resume hint is said below
        r = Resume(len(self.done) + 1, cause, checkpoint, time.time(), len(steps), redo, round(redo * pace, 1))
        self.done.append(r)
        self.pending = r
        self.metrics.auto_resumes.inc()
        where = f"checkpoint v{checkpoint}" if checkpoint is not None else "the start (no checkpoint yet)"
        say(f"AUTO-RESUME {r.n}/{self.limit}: after '{cause}': resuming from {where}, {redo} step(s) to redo")
        return r

    def after_poll(self, records: list[dict[str, Any]]) -> None:
        """The supervision's hook: the resumed learner's first step stops the pending resume's clock."""
        r = self.pending
        if r is None or len(_steps(records)) <= r.steps_before:
            return
        r.down_s = round(time.time() - r.stopped_at, 1)
        self.pending = None
        self.metrics.resume_lost_seconds.inc(r.lost_s)
        say(f"auto-resume {r.n}: the learner steps again {r.down_s:.0f} s after the stop; time lost "
            f"{r.lost_s:.0f} s (with {r.redo_steps} redone step(s))")
        with open(self.run_dir / RESUMES_FILE, "a") as f:
            f.write(json.dumps({**asdict(r), "lost_s": r.lost_s}) + "\n")

    def summary(self) -> dict[str, Any]:
        """What summary.json says of this launch's resumes."""
        return {"auto_resumes": len(self.done), "resume_lost_seconds": round(sum(r.lost_s for r in self.done), 1),
                "auto_resume_events": [{**asdict(r), "lost_s": r.lost_s} for r in self.done]}


def refuse_or_wait(auto: AutoResume, e: LaunchError, run_dir: Path) -> tuple[int | None, str | None]:
    """(checkpoint to resume from, None) or (None, why the run stops here)."""
    why = auto.refusal(e)
    if why is not None:
        return None, why
    checkpoint, why = newest_intact_checkpoint(auto.cfg, run_dir)
    if why is not None:
        return None, f"not resumed automatically: {why}"
    why = auto.wait_for_hosts(e.hosts)
    return checkpoint, why


RESUME = -1  # run_once: the run stopped and resumes


def run_once(launcher: Any, auto: AutoResume, no_actors: bool, root: Path) -> int:
    """The stages and supervision of ``launcher`` (an ``ops.launch.Launcher``; not imported: that module
    imports this one) once: 0 when the learner finished, RESUME for an automatic resume, else the launcher's
    exit code (its children stopped)."""
    cfg = launcher.cfg
    launcher.after_poll = auto.after_poll
    try:
        launcher.bootstrap()
        launcher.start_buffer()
        launcher.start_learner()
        if not no_actors:
            launcher.start_engines()
            launcher.start_actors()
        launcher.supervise()
        return 0
    except KeyboardInterrupt:
        say("interrupted: stopping every component")
        launcher.stop_all()
        return 130
    except LaunchError as e:
        say(f"FAILED — {e}")
        for note in failure_notes(launcher.run_dir, cfg.buffer_path if cfg.buffer_path.is_absolute() else root / cfg.buffer_path):
            say(note)
        launcher.stop_all()
        try:
            checkpoint, why = refuse_or_wait(auto, e, launcher.run_dir)
        except KeyboardInterrupt:
            say("interrupted while waiting to resume")
            return 130
        if why is not None:
            if why:  # "": no automatic resume asked for, the stop was told above
                say(f"STOPPED — {why}")
            return 1
        launcher.progress = getattr(launcher, "progress", None) or Progress(
            launcher.run_dir / "metrics.jsonl", cfg.learner.total_steps)
        auto.begin(e, launcher.progress.records, checkpoint)
        return RESUME
