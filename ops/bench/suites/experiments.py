"""The experiment suite of the embedded default task: VAPO against vanilla PPO, GRPO and DAPO at the same sample budget, VAPO with
each component removed, async against synchronous training, the staleness sweep and an α sweep, all on
the embedded default task (addition, the 0.6M-parameter base). Writes ``docs/RESULTS.md`` and
``docs/results/*.png`` (the report itself: ``ops/bench/reports/default_report.py``).

    .venv/bin/python -m ops.bench.suites.experiments                    # run what is missing, then write the report
    .venv/bin/python -m ops.bench.suites.experiments --list             # the suite and what is done
    .venv/bin/python -m ops.bench.suites.experiments --only vapo grpo   # some experiments (all their seeds)
    .venv/bin/python -m ops.bench.suites.experiments --report-only      # re-make docs/RESULTS.md from finished runs
    .venv/bin/python -m ops.bench.suites.experiments --jobs 2           # runs in parallel, each on its own ports
    .venv/bin/python -m ops.bench.suites.experiments --suite long       # the long-horizon task (long_suite.py)
    .venv/bin/python -m ops.bench.suites.experiments --suite actor_values   # pre- vs post-update critic (actor_values_suite.py)
    .venv/bin/python -m ops.bench.suites.experiments --suite weight_sync    # drain vs in-place updates (weight_sync_suite.py)
    .venv/bin/python -m ops.bench.suites.experiments --suite value_study    # where VAPO beats DAPO (value_study_suite.py)
    .venv/bin/python -m ops.bench.suites.experiments --suite value_parts    # the critic, NLL, filter, oracle (value_parts_suite.py)

Every run is a plain ``ops/launch.sh <config> run.root=runs/exp run.name=<exp>-s<seed> ...``; its
directory is the record. Resumable: a run with ``summary.json`` is done and skipped, a run with a checkpoint
is continued with ``--resume``, anything else is started afresh (its partial directory moved aside). A
continued run still ends at ``learner.total_steps`` but without the updates made after its last checkpoint
(docs/OPERATIONS.md, "Crashes, restarts, resume"); for a strict equal-updates comparison, move such a run aside and rerun it.

Cost is counted in *generated* samples: trained samples plus the groups the buffer dropped as stale or
filtered (DAPO's dynamic sampling pays for groups it never trains on). On 2 cores one default VAPO run
takes ~9 minutes, so the default is one run at a time: two runs at once would each get half the cores
and skew every wall-time figure. ``--jobs`` is for machines with more cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.bench.reports.default_report import write_report
from ops.bench.reports.run_records import (  # noqa: F401 (the suites read runs through this module)
    TARGET,
    Run,
    bootstrap_seconds,
    fmt,
    fmt_k,
    keep_block,
    load_run,
    mean_std,
    plot_curves,
    port_overrides,
)
from ops.bench.suites import (
    actor_values_suite,
    long_suite,
    value_parts_suite,
    value_study_suite,
    weight_sync_suite,
)
from ops.bench.suites.default_suite import BY_NAME, SUITE, Experiment, run_name

REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------------------------- running

def status(root: Path, e: Experiment, seed: int) -> str:
    d = root / run_name(e, seed)
    if (d / "summary.json").exists():
        return "done"
    if (d / "checkpoints").exists() and any((d / "checkpoints").iterdir()):
        return "resumable"
    return "partial" if d.exists() else "todo"


def run_one(root: Path, e: Experiment, seed: int, slot: int, log: Any) -> tuple[str, int, float]:
    name, st = run_name(e, seed), status(root, e, seed)
    d = root / name
    if st == "partial":  # nothing to resume from; keep it for inspection, start clean
        aside = root / f"{name}.failed-{int(time.time())}"
        d.rename(aside)
        log(f"{name}: moved a partial run without a checkpoint to {aside.name}")
    cmd = [str(REPO / "ops" / "launch.sh"), str(REPO / e.config), f"run.root={root}", f"run.name={name}",
           f"run.seed={seed}", f"learner.total_steps={e.steps}", *e.launch_overrides, *port_overrides(slot)]
    if st == "resumable":
        cmd.append("--resume")
    t0 = time.monotonic()
    with open(root / f"{name}.launch.log", "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.call(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return name, rc, time.monotonic() - t0


def run_suite(root: Path, todo: list[tuple[Experiment, int]], jobs: int,
              on_done: Callable[[Path, str, int, float, Callable[[str], None]], None] | None = None) -> int:
    """Run ``todo``, ``jobs`` at a time; ``on_done(root, name, rc, seconds, log)`` follows each run."""
    def log(msg: str) -> None:
        print(f"[experiments {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    failures = 0
    if not todo:
        log("nothing to run: every selected run is done")
        return 0
    log(f"{len(todo)} runs to do ({jobs} at a time): " + ", ".join(run_name(e, s) for e, s in todo))
    slots = list(range(jobs))
    t_all = time.monotonic()

    def work(i: int, e: Experiment, seed: int) -> tuple[str, int, float]:
        slot = slots.pop()
        try:
            log(f"[{i + 1}/{len(todo)}] {run_name(e, seed)} started ({e.label}, {e.steps} steps; "
                f"log {root / run_name(e, seed)}.launch.log)")
            return run_one(root, e, seed, slot, log)
        finally:
            slots.append(slot)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(work, i, e, s) for i, (e, s) in enumerate(todo)]
        for n, f in enumerate(futures, 1):
            name, rc, secs = f.result()
            summary = root / name / "summary.json"
            acc = json.loads(summary.read_text()).get("final_accuracy") if summary.exists() else None
            failures += rc != 0
            if on_done is not None:
                on_done(root, name, rc, secs, log)
            elapsed = time.monotonic() - t_all
            eta = elapsed / n * (len(todo) - n)
            log(f"{name}: {'ok' if rc == 0 else f'FAILED rc={rc}'} in {secs:.0f} s, final avg@8 "
                f"{acc if acc is None else f'{acc:.3f}'}; {n}/{len(todo)} done, ETA {eta / 60:.0f} min")
    return failures


def write_long_report(root: Path, out: Path, fixed_alpha: float | None = None) -> str:
    block = long_suite.section(root, out.parent / "results", fixed_alpha)
    out.write_text(long_suite.splice(out.read_text() if out.exists() else "# Results: VAPO in miniature\n", block))
    return block


def run_long(root: Path, args: argparse.Namespace) -> int:
    """The long suite's two phases (long_suite's docstring): every seed-0 run (the α sweep, DAPO, GRPO), then
    seeds 1-2 of the picked α and of the baselines; each finished VAPO run's critic is probed before the report."""
    def log(msg: str) -> None:
        print(f"[experiments {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    failures = 0
    for phase in (1, 2):
        best = long_suite.chosen_alpha(root, args.alpha)
        if phase == 2 and best is None:
            log("the α sweep is not finished; phase 2 (picked α's seeds 1-2, DAPO, GRPO, the plain-critic follow-ups) waits for it")
            break
        suite = long_suite.experiments(Experiment, best)
        chosen = [e for e in suite if not args.only or e.name in args.only]
        todo = [(e, s) for e in chosen for s in (args.seeds or e.seeds) if status(root, e, s) != "done"]
        if phase == 1:
            todo = [(e, s) for e, s in todo if s == 0]
        else:
            log(f"α given by --alpha: {best:g}" if args.alpha is not None
                else f"α picked by the sweep (late training reward): {best:g}")
        if not args.report_only:
            failures += run_suite(root, todo, args.jobs)
            for e in suite:
                for s in e.seeds:
                    long_suite.final_eval(root / run_name(e, s), log)
                    if e.name.startswith("long_vapo"):  # a critic to probe
                        long_suite.probe_values(root / run_name(e, s), log)
    return failures


def refuse_empty_report(root: Path, runs: list[tuple[Experiment, int]]) -> str | None:
    """Why a report must not be re-made from ``root`` (None when it may): runs are not in git, so on another
    checkout (or with a ``--root`` that holds another suite's runs) a report re-made from none of the suite's
    ``runs`` (experiment, seed) finished would empty its tables."""
    if any(status(root, e, s) == "done" for e, s in runs):
        return None
    return (f"none of this suite's runs finished under {root}: the report is left as it is; run the suite "
            "first, or give --root where its runs are")


def run_actor_values(root: Path, args: argparse.Namespace, module: Any = actor_values_suite,
                     label: str = "actor_values") -> int:
    """A suite of arms with a JSON summary (actor_values_suite.py, weight_sync_suite.py, value_study_suite.py):
    run what is missing, print one JSON summary line. A phased module (``PHASED``: value_study) lists its runs
    from what is done under ``root``, so a second pass runs the phase-2 seeds phase 1 earned; its ``prepare``
    (if any: files its runs read) precedes the runs, its ``post`` follows them, its ``report`` writes its section
    of the report (``--out``) from the summary (refused when ``REPORT_FROM_RUNS`` and none of its runs under
    ``root`` finished). A module's ``OPT_IN`` arms run only when named with --only."""
    phased = getattr(module, "PHASED", False)
    opt_in: frozenset[str] = getattr(module, "OPT_IN", frozenset())
    recorded: set[str] = getattr(module, "recorded_names", set)()  # done on an earlier checkout (value_parts' ledger)

    def state(e: Experiment, s: int) -> str:
        st = status(root, e, s)
        return "recorded" if st != "done" and run_name(e, s) in recorded else st

    def todo_now() -> list[tuple[Experiment, int]]:
        exps = module.experiments(Experiment, root) if phased else module.experiments(Experiment)
        return [(e, s) for e in exps if (e.name in args.only if args.only else e.name not in opt_in)
                for s in (args.seeds or e.seeds)]

    if args.list:
        est = getattr(module, "estimate_run_minutes", None)
        if phased:
            print(module.phase_line(root))
        for e, s in todo_now():
            cost = f" ~{est(e.name):.0f} min" if est else ""
            print(f"{run_name(e, s):32s} {state(e, s):10s} {e.steps:3d} steps{cost}  {e.label}")
        return 0
    failures = 0
    if not args.report_only:
        root.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        getattr(module, "prepare", lambda log: None)(print)  # files the runs read that no run makes
        for _ in range(2 if phased else 1):  # phase 2 only after a phase 1 without failures (no retry loop)
            missing = [(e, s) for e, s in todo_now() if state(e, s) not in ("done", "recorded")][:args.max_runs]
            est = getattr(module, "estimate_run_minutes", None)
            if est and missing:  # stated before the first run starts
                minutes = sum(est(e.name) for e, _ in missing)
                print(f"experiments: {len(missing)} runs to start, ~{minutes:.0f} min (~{minutes / 60:.1f} h) by the "
                      f"suite's estimate", flush=True)
            failures += run_suite(root.resolve(), missing, args.jobs, getattr(module, "on_run_done", None))
            if failures:
                break
        if hasattr(module, "post"):
            module.post(root.resolve(), print)
    every_run = [(e, s) for e in (module.experiments(Experiment, root) if phased else module.experiments(Experiment))
                 for s in e.seeds]
    refusal = refuse_empty_report(root, every_run) if getattr(module, "REPORT_FROM_RUNS", False) else None
    if refusal:
        print(f"experiments: {refusal}", file=sys.stderr)
        return 2
    summary = module.summary(root, load_run)
    if hasattr(module, "report"):  # a section of the report (value_study, value_parts)
        module.report(root, summary, REPO / args.out)
    print(json.dumps({"bench": "experiments", "suite": label, "failed_runs": failures, "arms": summary}))
    return 1 if failures else 0


def run_default(root: Path, args: argparse.Namespace) -> int:
    """The default suite: list it, or run what is missing, then write the report (``default_report``)."""
    unknown = [n for n in args.only or [] if n not in BY_NAME]
    if unknown:
        print(f"experiments: unknown experiment(s) {unknown}; choose from {list(BY_NAME)}", file=sys.stderr)
        return 2
    chosen = [e for e in SUITE if (not args.only or e.name in args.only) and (not args.group or e.group in args.group)]
    todo = [(e, s) for e in chosen for s in (args.seeds or e.seeds)]
    if args.list:
        for e, s in todo:
            print(f"{run_name(e, s):24s} {status(root, e, s):10s} {e.steps:3d} steps  {e.label}\n"
                  f"{'':24s} ops/launch.sh {e.config} run.seed={s} learner.total_steps={e.steps} {' '.join(e.launch_overrides)}")
        return 0
    failures = 0
    if not args.report_only:
        root.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        failures = run_suite(root, [(e, s) for e, s in todo if status(root, e, s) != "done"][:args.max_runs], args.jobs)
    refusal = refuse_empty_report(root, [(e, s) for e in SUITE for s in e.seeds])
    if refusal:
        print(f"experiments: {refusal}", file=sys.stderr)
        return 2
    write_report(root, REPO / args.out, REPO / args.notes)
    print(json.dumps({"bench": "experiments", "report": args.out, "failed_runs": failures,
                      "done": sum(status(root, e, s) == "done" for e in SUITE for s in e.seeds),
                      "total": sum(len(e.seeds) for e in SUITE)}))
    return 1 if failures else 0


def run_long_suite(root: Path, args: argparse.Namespace) -> int:
    """The long suite: list it, or run its two phases (``run_long``), then write its section of the report."""
    if args.list:
        best = long_suite.chosen_alpha(root, args.alpha)
        print(f"α given by --alpha: {best:g}" if args.alpha is not None else
              f"α picked by the sweep: {'not yet (sweep unfinished)' if best is None else f'{best:g}'}")
        for e in long_suite.experiments(Experiment, best):
            for s in e.seeds:
                print(f"{run_name(e, s):24s} {status(root, e, s):10s} {e.steps:3d} steps  {e.label}")
        return 0
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    failures = run_long(root, args)
    long_runs = long_suite.experiments(Experiment, long_suite.chosen_alpha(root, args.alpha))
    refusal = refuse_empty_report(root, [(e, s) for e in long_runs for s in e.seeds])
    if refusal:
        print(f"experiments: {refusal}", file=sys.stderr)
        return 2
    write_long_report(root, REPO / args.out, args.alpha)
    print(json.dumps({"bench": "experiments", "suite": "long", "report": args.out, "failed_runs": failures,
                      "alpha": long_suite.chosen_alpha(root, args.alpha)}))
    return 1 if failures else 0


def arms(module: Any, label: str) -> Callable[[Path, argparse.Namespace], int]:
    """A suite of arms with a JSON summary, run by ``run_actor_values``."""
    return lambda root, args: run_actor_values(root, args, module, label)


@dataclass(frozen=True)
class Suite:
    root: str  # where its runs live unless --root says otherwise
    run: Callable[[Path, argparse.Namespace], int]  # (resolved root, arguments) -> exit status
    doc: str  # one clause of --suite's help


SUITES: dict[str, Suite] = {
    "default": Suite("runs/exp", run_default, "baselines, ablations, staleness and α on the embedded default task"),
    "long": Suite("runs/exp-long", run_long_suite, "the long-horizon task, its own section of the report"),
    "actor_values": Suite("runs/exp-actor-values", arms(actor_values_suite, "actor_values"),
                          "pre- vs post-update critic values for the actor, default and long tasks, 2 seeds (a JSON "
                          "summary, no report)"),
    "weight_sync": Suite("runs/exp-weight-sync", arms(weight_sync_suite, "weight_sync"),
                         "weight updates that drain (wait, disk) against in-place pauses (distributed push) on the "
                         "long task, 2 seeds (a JSON summary)"),
    "value_study": Suite("runs/exp-value-study", arms(value_study_suite, "value_study"),
                         "VAPO vs DAPO where a group baseline is weak, two phases"),
    "value_parts": Suite("runs/exp-value-parts", arms(value_parts_suite, "value_parts"),
                         "the critic, the NLL, DAPO's filter and an oracle critic separated at G = 2 and 16, 3 seeds, "
                         "equal-compute readings (~13.5 h)"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=list(SUITES), default="default",
                    help="; ".join(f"{k}: {s.doc} (root {s.root})" for k, s in SUITES.items()))
    ap.add_argument("--root", help="parent directory of the suite's runs (default: the suite's, in --suite's help)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help=f"experiments to run: {', '.join(BY_NAME)}")
    ap.add_argument("--group", nargs="+", choices=["baselines", "ablations", "staleness", "alpha"],
                    help="default suite: run only these groups")
    ap.add_argument("--seeds", nargs="+", type=int, help="override the seeds of the selected experiments")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (default 1: on 2 cores more skews wall times)")
    ap.add_argument("--list", action="store_true", help="print the suite and each run's state, then exit")
    ap.add_argument("--max-runs", type=int, metavar="N",
                    help="start at most N of the missing runs, then summarise: a long suite over several sessions "
                    "(every suite but long)")
    ap.add_argument("--report-only", action="store_true",
                    help="only (re)write the report from finished runs (refused when there are none: runs are not "
                    "in git, and a report made from none would empty its tables)")
    ap.add_argument("--out", default="docs/RESULTS.md", help="report path (plots go to <its dir>/results/)")
    ap.add_argument("--notes", default="docs/results/notes.md", help="hand-written reading included in the report")
    ap.add_argument("--alpha", type=float, help="long suite: VAPO's α for seeds 1-2 and the follow-ups, instead of "
                    "the sweep's pick (with --only, the sweep can be skipped)")
    args = ap.parse_args(argv)
    if args.max_runs is not None and args.max_runs < 1:
        ap.error("--max-runs must be at least 1")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    suite = SUITES[args.suite]
    return suite.run((REPO / (args.root or suite.root)).resolve(), args)


if __name__ == "__main__":
    sys.exit(main())
