"""What a run survives, and what each failure costs: one small launched run per failure, one process SIGKILLed
mid-run, the figures in one JSON line.

    .venv/bin/python -m ops.bench.failures [--only engine,actor,buffer,learner,launcher] [--steps 14]
                                           [--kill-at 5] [key=value ...]

Each scenario runs ``ops/launch.sh ops/configs/smoke.yaml`` with two actors (``--steps`` learner steps, a
checkpoint every 4) and, once the learner has logged step ``--kill-at``, SIGKILLs one process:

- ``engine``: actor 0's ``rollout_server`` (its actor restarts it);
- ``actor``: actor 0 (the launcher restarts it);
- ``buffer``: the buffer (the launcher restarts it; the waiting learner asks the new one);
- ``learner``: the learner (the launcher stops the run), then ``--resume``;
- ``launcher``: the launcher itself (every child dies with it), then ``--resume``.

A run that goes on is judged against itself: ``gap_s`` is the longest interval between two learner steps
after the kill, ``interval_before_s`` the median interval before it (the same run's baseline), and
``cost_s = gap_s - interval_before_s`` what the failure cost. A run that stops reports ``stopped_after_s``
(kill to launcher exit), ``procs_left`` (processes of the run still alive 5 s after it), ``steps_redone``
(steps made after ``resumed_from``, the checkpoint ``--resume`` takes: done again) and ``resume_to_step_s``
(``--resume`` start to its first new step: process starts, checkpoint load, the buffer's groups). Engine hosts, learner hosts and a
power loss during a checkpoint are measured by ``ops/rehearse.sh`` (``check_engine_host_lost``,
``check_kill_host``) and ``tests/learner/test_checkpoint.py``; docs/OPERATIONS.md's "What a run survives" collects them.
Timings are this machine's and noisy: compare a cost with the same run's step interval.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common.ports import as_overrides, fresh_ports
from ops.bench.measure import load, machine

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = ("engine", "actor", "buffer", "learner", "launcher")
RUN_TIMEOUT_S = 600.0


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process of this machine."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(name)] = (ppid, cmd)
    return out


def victim(scenario: str, run_dir: Path, launcher_pid: int) -> int | None:
    """The pid of the process ``scenario`` kills in the run at ``run_dir`` (None: not running now)."""
    procs = processes()
    mine = {pid: (ppid, cmd) for pid, (ppid, cmd) in procs.items() if str(run_dir) in cmd}
    if scenario == "launcher":
        return next((pid for pid, (_, cmd) in mine.items() if "-m ops.launch" in cmd), launcher_pid)
    if scenario in ("engine", "actor"):
        actor = next((pid for pid, (_, cmd) in mine.items() if "-m actors " in cmd and "--actor-id 0" in cmd), None)
        if scenario == "actor" or actor is None:
            return actor
        return next((pid for pid, (ppid, cmd) in procs.items() if ppid == actor and "rollout_server" in cmd), None)
    marker = {"buffer": "-m buffer ", "learner": "-m learner"}[scenario]
    return next((pid for pid, (_, cmd) in mine.items() if marker in cmd), None)


def step_times(run_dir: Path) -> list[tuple[int, float]]:
    """(step, time) of every learner step record so far, in file order (a resumed run appends)."""
    path = run_dir / "metrics.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if rec.get("kind") == "learner_step":
                out.append((int(rec["step"]), float(rec["time"])))
    return out


def launch(root: Path, name: str, overrides: list[str], resume: bool = False) -> subprocess.Popen:
    argv = [str(REPO / "ops/launch.sh"), "ops/configs/smoke.yaml", f"run.root={root}", f"run.name={name}",
            *as_overrides(fresh_ports()), *overrides, *(["--resume"] if resume else [])]
    log = open(root / f"{name}{'-resume' if resume else ''}.out", "w")  # the child owns it
    return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(what: str, ok: Any, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not ok():
        if proc.poll() is not None and not ok():
            raise RuntimeError(f"the run exited with code {proc.returncode} before {what}")
        if time.time() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)  # poll interval of an outside observer


def went_on(steps: list[tuple[int, float]], t_kill: float) -> dict[str, Any]:
    """Figures of a run that survived the kill at ``t_kill``: its longest step interval across and after
    the kill against the median interval before it."""
    times = [t for _, t in steps]
    before = [b - a for a, b in itertools.pairwise(times) if b <= t_kill]
    after = [b - a for a, b in itertools.pairwise(times) if b > t_kill]
    base = statistics.median(before) if before else None
    gap = max(after) if after else None
    return {"interval_before_s": round(base, 2) if base else None, "gap_s": round(gap, 2) if gap else None,
            "cost_s": round(gap - base, 2) if gap and base else None, "steps": len(steps)}


def stopped(root: Path, name: str, run_dir: Path, proc: subprocess.Popen, t_kill: float,
            overrides: list[str]) -> dict[str, Any]:
    """Figures of a run the kill stopped: how fast it stopped, what it left, and its ``--resume``."""
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    stop_s = time.time() - t_kill
    time.sleep(5)  # what lingers 5 s after the stop is left behind, not stopping
    left = [pid for pid, (_, cmd) in processes().items() if str(run_dir) in cmd]
    last = max((s for s, _ in step_times(run_dir)), default=0)
    # The checkpoint --resume will take (the resumed run numbers its steps past every published version, so
    # its step numbers do not say how far back it went).
    ckpt = max((int(p.name[1:]) for p in (run_dir / "checkpoints").glob("v*")
                if p.name[1:].isdigit() and (p / "COMPLETE").is_file()), default=0)
    t_resume = time.time()
    resumed = launch(root, name, overrides, resume=True)
    wait_for("a step of the resumed run", lambda: any(t > t_resume for _, t in step_times(run_dir)), resumed,
             RUN_TIMEOUT_S)
    first_s = min(t for _, t in step_times(run_dir) if t > t_resume) - t_resume
    rc = resumed.wait(timeout=RUN_TIMEOUT_S)
    return {"stopped_after_s": round(stop_s, 1), "rc": proc.returncode, "procs_left": len(left),
            "last_step_before": last, "resumed_from": ckpt, "steps_redone": last - ckpt,
            "resume_to_step_s": round(first_s, 1), "resume_rc": rc}


def scenario(kind: str, root: Path, steps: int, kill_at: int, extra: list[str]) -> dict[str, Any]:
    name = f"fail-{kind}"
    run_dir = root / name
    overrides = ["actors.num_actors=2", f"learner.total_steps={steps}", "learner.checkpoint_every=4",
                 "learner.eval_every=0", *extra]
    proc = launch(root, name, overrides)
    wait_for(f"learner step {kill_at}", lambda: any(s >= kill_at for s, _ in step_times(run_dir)), proc,
             RUN_TIMEOUT_S)
    pid = victim(kind, run_dir, proc.pid)
    if pid is None:
        raise RuntimeError(f"{kind}: no process to kill in {run_dir}")
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    if kind in ("learner", "launcher"):
        return {kind: stopped(root, name, run_dir, proc, t_kill, overrides)}
    rc = proc.wait(timeout=RUN_TIMEOUT_S)
    return {kind: {"rc": rc, **went_on(step_times(run_dir), t_kill)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops.bench.failures", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios (default: all)")
    ap.add_argument("--steps", type=int, default=14, help="learner steps of each run")
    ap.add_argument("--kill-at", type=int, default=5, help="kill once the learner logged this step")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = ap.parse_args(argv)
    kinds = [k for k in args.only.split(",") if k]
    if unknown := [k for k in kinds if k not in SCENARIOS]:
        ap.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    out: dict[str, Any] = {"bench": "failures", "machine": machine(), "load_start": load(),
                           "steps": args.steps, "kill_at": args.kill_at}
    with tempfile.TemporaryDirectory(prefix="vapo-failures-") as tmp:
        for kind in kinds:
            print(f"failures: {kind} ...", file=sys.stderr, flush=True)
            out.update(scenario(kind, Path(tmp), args.steps, args.kill_at, args.overrides))
    out["load_end"] = load()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
