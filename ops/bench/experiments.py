"""The experiment suite of the embedded default task: VAPO against vanilla PPO, GRPO and DAPO at the same sample budget, VAPO with
each component removed, async against synchronous training, the staleness sweep and an α sweep, all on
the embedded default task (addition, the 0.6M-parameter base). Writes ``docs/RESULTS.md`` and
``docs/results/*.png``.

    .venv/bin/python -m ops.bench.experiments                    # run what is missing, then write the report
    .venv/bin/python -m ops.bench.experiments --list             # the suite and what is done
    .venv/bin/python -m ops.bench.experiments --only vapo grpo   # some experiments (all their seeds)
    .venv/bin/python -m ops.bench.experiments --report-only      # re-make docs/RESULTS.md from finished runs
    .venv/bin/python -m ops.bench.experiments --jobs 2           # runs in parallel, each on its own ports
    .venv/bin/python -m ops.bench.experiments --suite long       # the long-horizon task (long_suite.py)
    .venv/bin/python -m ops.bench.experiments --suite actor_values   # pre- vs post-update critic (actor_values_suite.py)
    .venv/bin/python -m ops.bench.experiments --suite weight_sync    # drain vs in-place updates (weight_sync_suite.py)
    .venv/bin/python -m ops.bench.experiments --suite value_study    # where VAPO beats DAPO (value_study_suite.py)

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
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ops.bench import actor_values_suite, long_suite, value_study_report, value_study_suite, weight_sync_suite
from ops.bench.default_suite import (
    BY_NAME,
    EARLIER,
    FULL_STEPS,
    SHORT_STEPS,
    SUITE,
    Experiment,
    group_ran,
    run_name,
)
from ops.bench.run_records import (  # noqa: F401 (the suites read runs through this module)
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

REPO = Path(__file__).resolve().parents[2]


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
           f"run.seed={seed}", f"learner.total_steps={e.steps}", *e.overrides, *port_overrides(slot)]
    if st == "resumable":
        cmd.append("--resume")
    t0 = time.monotonic()
    with open(root / f"{name}.launch.log", "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.call(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return name, rc, time.monotonic() - t0


def run_suite(root: Path, todo: list[tuple[Experiment, int]], jobs: int) -> int:
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
            elapsed = time.monotonic() - t_all
            eta = elapsed / n * (len(todo) - n)
            log(f"{name}: {'ok' if rc == 0 else f'FAILED rc={rc}'} in {secs:.0f} s, final avg@8 "
                f"{acc if acc is None else f'{acc:.3f}'}; {n}/{len(todo)} done, ETA {eta / 60:.0f} min")
    return failures


# --------------------------------------------------------------------------------------------- analysis

def write_report(root: Path, out: Path, notes: Path) -> str:
    runs: dict[str, list[Run]] = {}
    for e in SUITE:
        got = [load_run(root / run_name(e, s)) for s in e.seeds]
        runs[e.name] = [r for r in got if r is not None]
    figdir = out.parent / "results"
    lines = _report_header(root, notes) + _baselines_section(runs, figdir) + _default_run_section(runs.get("vapo", []))
    for group, title, make in (("ablations", "Ablations", lambda: _ablations_section(runs, figdir)),
                               ("staleness", "Async vs synchronous, staleness sweep", lambda: _staleness_section(runs, figdir)),
                               ("alpha", "α sweep", lambda: _alpha_section(runs))):
        lines += make() if group_ran(runs, group) else [f"## {title}", "", EARLIER, ""]
    text = "\n".join(lines) + "\n"
    if out.exists():  # the long-horizon suite's and the value study's sections are written by their own reports
        for begin, end in ((long_suite.BEGIN, long_suite.END), (value_study_report.BEGIN, value_study_report.END)):
            text = keep_block(out.read_text(), text, begin, end)
    out.write_text(text)
    return text


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def _report_header(root: Path, notes: Path) -> list[str]:
    """The title, what every run is, the machines that produced them and the hand-written reading."""
    from common.provenance import machines_line

    lines = ["# Results: VAPO in miniature", "",
             f"Generated by `.venv/bin/python -m ops.bench.experiments --root {_rel(root)}` (re-make the tables and plots "
             "from the finished runs with `--report-only`). Task: the embedded default (step-by-step addition, 1–6 digits; the "
             "0.6M-parameter SFT base shipped in `ops/bases/addition-tiny` samples 46% correct on the held-out split). Every run: 32 prompts × G = 8 "
             "samples per step, one actor with the CPU rollout engine, one learner, 2 CPU cores. "
             "\"Samples\" are the samples a method pays for: trained on, spent on value pretraining (VAPO: "
             "10 batches + 1 held-out batch = 2,816 before its first step), or generated and discarded by dynamic "
             "sampling (DAPO). "
             "Accuracy is held-out avg@8 (256 prompts × 8 samples at temperature 1); wall times are learner time "
             "from the base evaluation, net of held-out evaluations.", ""]
    lines += ["Produced by (each run's metrics.jsonl header): "
              + machines_line([root / run_name(e, s) for e in SUITE for s in e.seeds]), ""]
    if notes.exists():
        lines += [notes.read_text().rstrip(), ""]
    return lines


def _baselines_section(runs: dict[str, list[Run]], figdir: Path) -> list[str]:
    """1. VAPO against the baselines at the full budget: the table and its three plots."""
    lines = ["## VAPO against the baselines (same budget: 60 steps, 15,360 samples)", "",
             f"| method | seeds | final avg@8 mean ± sd (min–max) | greedy | samples paid to {TARGET:.2f} (mean; per seed) "
             f"| trained samples to {TARGET:.2f} (mean) | learner s to {TARGET:.2f} | trained samples/s |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("vapo", "dapo", "grpo", "ppo"):
        lines.append(_baseline_row(name, runs.get(name, [])))
    lines.append("")
    plot_curves(figdir / "baselines_samples.png", {BY_NAME[n].label: runs.get(n, []) for n in ("vapo", "dapo", "grpo", "ppo")},
                "cost", "samples paid for (thousands)", "Held-out accuracy vs samples (mean, band = min–max over seeds)")
    plot_curves(figdir / "baselines_trained.png", {BY_NAME[n].label: runs.get(n, []) for n in ("vapo", "dapo", "grpo", "ppo")},
                "samples", "samples trained on (thousands)", "Held-out accuracy vs trained samples (value pretraining and "
                "discarded groups not counted)")
    plot_curves(figdir / "baselines_time.png", {BY_NAME[n].label: runs.get(n, []) for n in ("vapo", "dapo", "grpo", "ppo")},
                "t", "learner wall seconds (net of evaluation)", "Held-out accuracy vs wall time")
    return lines + ["![accuracy vs samples](results/baselines_samples.png)", "",
                    "![accuracy vs trained samples](results/baselines_trained.png)", "",
                    "![accuracy vs wall time](results/baselines_time.png)", ""]


def _baseline_row(name: str, rs: list[Run]) -> str:
    if not rs:
        return f"| {BY_NAME[name].label} | 0 | not run yet | | | | | |"
    finals = [r.final(FULL_STEPS)["acc"] for r in rs]
    m, sd = mean_std(finals)
    cross = [r.crossing(TARGET, "cost") for r in rs]
    tcross = [r.crossing(TARGET, "t") for r in rs]
    reached = [c for c in cross if c is not None]
    cm = statistics.fmean(reached) if len(reached) == len(rs) else None
    tm = statistics.fmean(tcross) if all(t is not None for t in tcross) else None
    scross = [r.crossing(TARGET, "samples") for r in rs]
    sm = statistics.fmean(scross) if all(c is not None for c in scross) else None
    thr = statistics.fmean(r.throughput(FULL_STEPS) for r in rs)
    return (f"| {BY_NAME[name].label} | {len(rs)} | {m:.3f} ± {sd:.3f} ({min(finals):.3f}–{max(finals):.3f}) "
            f"| {statistics.fmean(r.final(FULL_STEPS)['greedy'] for r in rs):.3f} "
            f"| {fmt_k(cm)}; {', '.join(fmt_k(c) for c in cross)} | {fmt_k(sm)} | {fmt(tm, 0)} | {thr:.1f} |")


def _default_run_section(vr: list[Run]) -> list[str]:
    """2. The default run's acceptance, seed by seed (nothing without VAPO runs)."""
    if not vr:
        return []
    lines = ["## The default run (`ops/launch.sh`, 3 seeds)", "",
             f"Deliverable: +20 points held-out avg@8 within 15 minutes. The default is "
             f"{SHORT_STEPS} steps; these runs went on to {FULL_STEPS} for the comparison above, and the learning rate "
             f"is constant, so their first {SHORT_STEPS} steps are the default run. \"Wall to step {SHORT_STEPS}\" "
             "counts from the launch; a shipped base (`ops/bases/`) needs no bootstrap, and a run on a base an "
             "earlier launch bootstrapped adds the bootstrap that launch measured.", "",
             f"| seed | base | step {SHORT_STEPS} | step {FULL_STEPS} | lowest eval after base | held-out length base → "
             f"step {SHORT_STEPS} | entropy (min–max) | EV after value pretraining | wall to step {SHORT_STEPS} "
             "from the launch (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in vr:
        ents = [s["entropy"] for s in r.steps if s["entropy"] is not None]
        lowest = min(p["acc"] for p in r.points[1:]) if len(r.points) > 1 else float("nan")
        p40 = r.final(SHORT_STEPS)
        to40 = r.launch_to.get(SHORT_STEPS)
        boot = ("" if r.bootstrap_seconds is None or to40 is None
                else f" ({to40 - r.bootstrap_seconds:.0f} + {r.bootstrap_seconds:.0f} bootstrap)")
        lines.append(f"| {r.name} | {r.base:.3f} | {p40['acc']:.3f} | {r.final(FULL_STEPS)['acc']:.3f} | {lowest:.3f} "
                     f"| {fmt(r.points[0]['len'], 1)} → {fmt(p40['len'], 1)} | {min(ents):.3f}–{max(ents):.3f} "
                     f"| {fmt(r.pretrain_ev)} | {fmt(r.launch_to.get(SHORT_STEPS), 0)}{boot} |")
    return lines + [""]


def _ablations_section(runs: dict[str, list[Run]], figdir: Path) -> list[str]:
    """3. Each ablation against VAPO's mean at the short budget, and their plot."""
    vr = runs.get("vapo", [])
    vapo_short = [r.final(SHORT_STEPS)["acc"] for r in vr]
    vcross = [r.crossing(TARGET, "cost") for r in vr]
    vm, vsd = mean_std(vapo_short)
    lines = [f"## Ablations (1 seed each, marked; {SHORT_STEPS} steps = 10,240 samples)", "",
             f"Reference: VAPO at step {SHORT_STEPS}, {len(vr)} seeds: **{vm:.3f} ± {vsd:.3f}**; samples paid to "
             f"{TARGET:.2f}: {fmt_k(statistics.fmean(vcross) if vr and all(c is not None for c in vcross) else None)} "
             f"(value pretraining included). Single-seed differences within ~2 sd ({2 * vsd:.3f}) are noise.", "",
             f"| variant | seed | avg@8 at {SHORT_STEPS} steps | Δ vs VAPO mean | samples to {TARGET:.2f} | EV (mean over steps) |",
             "|---|---|---|---|---|---|"]
    for e in SUITE:
        if e.group != "ablations":
            continue
        for r in runs.get(e.name, []):
            a = r.final(SHORT_STEPS)["acc"]
            evs = [s["ev"] for s in r.steps if s["ev"] is not None]
            lines.append(f"| {e.label}<br>`{' '.join(e.overrides)}` | {r.name[-1]} (1 seed) | {a:.3f} | {a - vm:+.3f} | {fmt_k(r.crossing(TARGET, 'cost'))} "
                         f"| {fmt(statistics.fmean(evs) if evs else None)} |")
        if not runs.get(e.name):
            lines.append(f"| {e.label} | — | not run yet | | | |")
    lines.append("")
    abl = {"VAPO": vr} | {e.label: runs[e.name] for e in SUITE if e.group == "ablations" and runs.get(e.name)}
    plot_curves(figdir / "ablations.png", abl, "cost", "samples paid for (thousands)",
                "VAPO with one component removed (1 seed each)", upto_step=SHORT_STEPS)
    return lines + ["![ablations](results/ablations.png)", ""]


def _staleness_section(runs: dict[str, list[Run]], figdir: Path) -> list[str]:
    """4. Async against synchronous training and the staleness sweep (plus GRPO's pair), and their plot."""
    lines = [f"## Async vs synchronous, staleness sweep ({SHORT_STEPS} steps = 10,240 samples, seed 0 unless marked)", "",
             "| buffer.max_staleness | runs | trained samples/s | speed-up vs sync | learner s/step waiting for data "
             "| learner s/step computing | mean staleness of trained groups "
             f"| groups dropped as stale | learner s to {TARGET:.2f} | avg@8 at {SHORT_STEPS} steps |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    sweep: list[tuple[str, list[Run]]] = [
        ("0 (sync)", runs.get("stale0", [])), ("1 (default)", runs.get("vapo", [])), ("2", runs.get("stale2", [])),
        ("4", runs.get("stale4", [])), ("4, learner.off_policy=decoupled", runs.get("stale4_decoupled", []))]
    sync_thr = statistics.fmean(r.throughput(SHORT_STEPS) for r in sweep[0][1]) if sweep[0][1] else None
    for k, rs in sweep:
        lines.append(_staleness_row(k, rs, sync_thr) if rs else f"| {k} | 0 | not run yet | | | | | | | |")
    lines.append("")
    lines += _grpo_sync_table(runs.get("grpo_sync", []), runs.get("grpo", []))
    plot_curves(figdir / "staleness_time.png", {f"max_staleness={k}": rs for k, rs in sweep if rs}, "t",
                "learner wall seconds (net of evaluation)", "Async vs synchronous", upto_step=SHORT_STEPS)
    return lines + ["![staleness](results/staleness_time.png)", ""]


def _staleness_row(k: str, rs: list[Run], sync_thr: float | None) -> str:
    thr = statistics.fmean(r.throughput(SHORT_STEPS) for r in rs)
    st = statistics.fmean(statistics.fmean(s["staleness"] or 0.0 for s in r.steps if s["step"] <= SHORT_STEPS)
                          for r in rs)
    tc = [r.crossing(TARGET, "t") for r in rs]
    tcm = statistics.fmean(tc) if all(t is not None for t in tc) else None
    acc = mean_std([r.final(SHORT_STEPS)["acc"] for r in rs])
    shares = [x for x in (r.stale_share(SHORT_STEPS) for r in rs) if x is not None]
    drop = f"{100 * statistics.fmean(shares):.0f}%" + (f" ({len(shares)} of {len(rs)} runs)" if len(shares) < len(rs) else "") if shares else "—"
    wait, busy = (statistics.fmean(statistics.fmean(s[key] for s in r.steps if s["step"] <= SHORT_STEPS) for r in rs)
                  for key in ("fetch_s", "busy_s"))
    return (f"| {k} | {len(rs)} | {thr:.1f} "
            f"| {fmt(thr / sync_thr if sync_thr else None, 2)}× | {wait:.2f} | {busy:.2f} | {st:.2f} | {drop} | {fmt(tcm, 0)} "
            f"| {acc[0]:.3f}{f' ± {acc[1]:.3f}' if len(rs) > 1 else ''} |")


def _grpo_sync_table(gs: list[Run], ga: list[Run]) -> list[str]:
    """The same comparison where generation and training take similar time (no critic to train)."""
    if not (gs and ga):
        return []
    thr_s = statistics.fmean(r.throughput(SHORT_STEPS) for r in gs)
    thr_a = statistics.fmean(r.throughput(SHORT_STEPS) for r in ga)
    acc_s = mean_std([r.final(SHORT_STEPS)["acc"] for r in gs])
    acc_a = mean_std([r.final(SHORT_STEPS)["acc"] for r in ga])
    return ["GRPO (no critic, so a learner step costs about as much as generating its batch):", "",
            f"| GRPO | runs | trained samples/s | speed-up vs sync | avg@8 at {SHORT_STEPS} steps |", "|---|---|---|---|---|",
            f"| max_staleness=0 (sync) | {len(gs)} | {thr_s:.1f} | 1.00× | {acc_s[0]:.3f} |",
            f"| max_staleness=1 | {len(ga)} | {thr_a:.1f} | {thr_a / thr_s:.2f}× | {acc_a[0]:.3f}"
            f"{f' ± {acc_a[1]:.3f}' if len(ga) > 1 else ''} |", ""]


def _alpha_section(runs: dict[str, list[Run]]) -> list[str]:
    """5. The α sweep: λ at three lengths and the accuracy of each α (VAPO's seed 0 is α = 1)."""
    lines = [f"## α sweep (length-adaptive λ = 1 − 1/(α·l); 1 seed, {SHORT_STEPS} steps)", "",
             f"| α | λ at l = 10 / 40 / 70 | avg@8 at {SHORT_STEPS} steps | samples to {TARGET:.2f} |", "|---|---|---|---|"]

    def lam(a: float, n: int) -> str:
        return f"{max(0.0, 1 - 1 / (a * n)):.2f}"

    for a, rs in [(0.3, runs.get("alpha0.3", [])), (1.0, runs.get("vapo", [])[:1]), (3.0, runs.get("alpha3", []))]:
        if not rs:
            lines.append(f"| {a} | {lam(a, 10)} / {lam(a, 40)} / {lam(a, 70)} | not run yet | |")
            continue
        r = rs[0]
        lines.append(f"| {a}{' (default, seed 0)' if a == 1.0 else ''} | {lam(a, 10)} / {lam(a, 40)} / {lam(a, 70)} "
                     f"| {r.final(SHORT_STEPS)['acc']:.3f} | {fmt_k(r.crossing(TARGET, 'cost'))} |")
    return lines + [""]


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


def run_actor_values(root: Path, args: argparse.Namespace, module: Any = actor_values_suite,
                     label: str = "actor_values") -> int:
    """A suite of arms with a JSON summary (actor_values_suite.py, weight_sync_suite.py, value_study_suite.py):
    run what is missing, print one JSON summary line. A phased module (``PHASED``: value_study) lists its runs
    from what is done under ``root``, so a second pass runs the phase-2 seeds phase 1 earned; its ``prepare``
    (if any: files its runs read) precedes the runs, its ``post`` follows them, its ``report`` writes its section
    of the report (``--out``) from the summary. A module's ``OPT_IN`` arms run
    only when named with --only."""
    phased = getattr(module, "PHASED", False)
    opt_in = getattr(module, "OPT_IN", frozenset())

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
            print(f"{run_name(e, s):32s} {status(root, e, s):10s} {e.steps:3d} steps{cost}  {e.label}")
        return 0
    failures = 0
    if not args.report_only:
        root.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        getattr(module, "prepare", lambda log: None)(print)  # files the runs read that no run makes
        for _ in range(2 if phased else 1):  # phase 2 only after a phase 1 without failures (no retry loop)
            failures += run_suite(root.resolve(), [(e, s) for e, s in todo_now() if status(root, e, s) != "done"], args.jobs)
            if failures:
                break
        if hasattr(module, "post"):
            module.post(root.resolve(), print)
    summary = module.summary(root, load_run)
    if hasattr(module, "report"):  # a section of the report (value_study)
        module.report(root, summary, REPO / args.out)
    print(json.dumps({"bench": "experiments", "suite": label, "failed_runs": failures, "arms": summary}))
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/exp", help="parent directory of the experiment runs (default runs/exp)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help=f"experiments to run: {', '.join(BY_NAME)}")
    ap.add_argument("--group", nargs="+", choices=["baselines", "ablations", "staleness", "alpha"],
                    help="run only these groups of the suite")
    ap.add_argument("--seeds", nargs="+", type=int, help="override the seeds of the selected experiments")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (default 1: on 2 cores more skews wall times)")
    ap.add_argument("--list", action="store_true", help="print the suite and each run's state, then exit")
    ap.add_argument("--report-only", action="store_true", help="only (re)write the report from finished runs")
    ap.add_argument("--out", default="docs/RESULTS.md", help="report path (plots go to <its dir>/results/)")
    ap.add_argument("--notes", default="docs/results/notes.md", help="hand-written reading included in the report")
    ap.add_argument("--alpha", type=float, help="long suite: VAPO's α for seeds 1-2 and the follow-ups, instead of "
                    "the sweep's pick (with --only, the sweep can be skipped)")
    ap.add_argument("--suite", choices=["default", "long", "actor_values", "weight_sync", "value_study"], default="default",
                    help="default: baselines, ablations, staleness and α on the embedded default task (root runs/exp); long: the long-horizon "
                    "task (root runs/exp-long, its own section of the report); actor_values: pre- vs post-update "
                    "critic values for the actor, default and long tasks, 2 seeds (root runs/exp-actor-values, a "
                    "JSON summary, no report); weight_sync: weight updates that drain (wait, disk) against in-place "
                    "pauses (distributed push) on the long task, 2 seeds (root runs/exp-weight-sync, a JSON summary); "
                    "value_study: VAPO vs DAPO where a group baseline is weak, two phases (root runs/exp-value-study)")
    args = ap.parse_args(argv)
    if args.suite == "value_study":
        return run_actor_values(REPO / (args.root if args.root != "runs/exp" else "runs/exp-value-study"), args,
                                value_study_suite, "value_study")
    if args.suite == "weight_sync":
        return run_actor_values(REPO / (args.root if args.root != "runs/exp" else "runs/exp-weight-sync"), args,
                                weight_sync_suite, "weight_sync")
    if args.suite == "actor_values":
        return run_actor_values(REPO / (args.root if args.root != "runs/exp" else "runs/exp-actor-values"), args)
    if args.suite == "long":
        root = (REPO / (args.root if args.root != "runs/exp" else "runs/exp-long")).resolve()
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
        write_long_report(root, REPO / args.out, args.alpha)
        print(json.dumps({"bench": "experiments", "suite": "long", "report": args.out, "failed_runs": failures,
                          "alpha": long_suite.chosen_alpha(root, args.alpha)}))
        return 1 if failures else 0
    root = (REPO / args.root).resolve()
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    unknown = [n for n in args.only or [] if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown experiment(s) {unknown}; choose from {list(BY_NAME)}")
    chosen = [e for e in SUITE if (not args.only or e.name in args.only) and (not args.group or e.group in args.group)]
    todo = [(e, s) for e in chosen for s in (args.seeds or e.seeds)]
    if args.list:
        for e, s in todo:
            print(f"{run_name(e, s):24s} {status(root, e, s):10s} {e.steps:3d} steps  {e.label}\n"
                  f"{'':24s} ops/launch.sh {e.config} run.seed={s} learner.total_steps={e.steps} {' '.join(e.overrides)}")
        return 0
    failures = 0
    if not args.report_only:
        root.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        failures = run_suite(root, [(e, s) for e, s in todo if status(root, e, s) != "done"], args.jobs)
    write_report(root, REPO / args.out, REPO / args.notes)
    print(json.dumps({"bench": "experiments", "report": args.out, "failed_runs": failures,
                      "done": sum(status(root, e, s) == "done" for e in SUITE for s in e.seeds),
                      "total": sum(len(e.seeds) for e in SUITE)}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
