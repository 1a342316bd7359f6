"""Separate the parts of VAPO's gain, at equal total compute: the critic, the positive NLL, DAPO's filter, and
a hand-made, task-aware reference critic. Run by ``python -m ops.bench.suites.experiments --suite value_parts``:

    .venv/bin/python -m ops.bench.suites.experiments --suite value_parts --list           # runs, states, minutes each
    .venv/bin/python -m ops.bench.suites.experiments --suite value_parts                  # run what is missing, summarise
    .venv/bin/python -m ops.bench.suites.experiments --suite value_parts --report-only
    .venv/bin/python -m ops.bench.suites.value_parts_suite --pilot g16_oracle_a1 --steps 4   # one arm, one seed, few steps

Root ``runs/exp-value-parts``; every run is a plain ``ops/launch.sh ops/configs/long.yaml ...`` (resumable as in
the other suites), 40 steps x 256 samples, evaluated every 5 steps (``learner.eval_every=5``: a crossing is
read between two evaluations, so they are close). At G = 2 and G = 16 (prompts per step scaled to keep 256
samples, as ``value_study_suite.group_overrides``), the arms are:

- ``vapo`` (long.yaml: surprise critic, 10 value-pretraining steps, μ = 0.1 NLL) and ``vapo_nonll`` (μ = 0);
- ``oracle`` (``algo.critic=oracle``: the task's own values, a hand-made reference critic that cannot foresee
  a slip and assumes one slip rate for every line, not a ceiling; ``pre_update`` values, so no value pass is spent on the critic the actor does not read),
  ``trainable`` (the critic at the actor's lr, 1e-4, in RL and value pretraining; its surprise MLP, at
  ``learner.value_head_lr_scale`` = 1000 times that, then trains at 0.1) and ``backbone`` (the backbone at
  1e-4 with the surprise MLP at its shipped 1e-2: which of the two a faster critic's result comes from);
- each of those five at α = 1 and α = 0.05 (``_a1``, ``_a0.05``);
- ``dapo`` (``long_suite.DAPO``: dynamic sampling, no NLL), ``dapo_nofilter`` and ``dapo_nll`` (μ = 0.1).

Opt-in (run only when named: ``--only vp_g2_paper_behaviour_a1 ...``; ``--estimate`` states their minutes): a critic
trained as the paper trains one (``PAPER_CRITIC``) with its surprise features from the behaviour log-probs
(``paper_behaviour``) or a frozen base model (``paper_frozen``) at G = 2 and 16, the second also with PPO's
clipped value loss (``paper_clip``, ``algo.value_clip=0.2``), and the group's leave-one-out baseline (``loo``,
``algo.baseline=group_loo``) at G = 16; each at α = 1 and α = 0.05 (``critic_training_arms``).
The summary reads them beside the study, against shipped VAPO and DAPO with the NLL (``OPT_IN_DIFFERENCES``), at
the study's equal budgets (which its own arms alone set, so an opt-in run moves none of the study's figures) and
at each pair's own; the ledger keeps their lines as it keeps the study's (``value_parts_ledger``).

Three seeds per arm (``SEEDS``), each arm its own. 26 arms x 3 seeds = 78 runs. Wall time on this machine
(2 cores, quiet; ``estimate_run_minutes``), the medians of the first 22 runs (G = 2, ``docs/results/
value_parts_runs.jsonl``): a run that trains or reads a critic ~11 min (10.6-13.0), a DAPO one 0.87 of that
(9.4-9.9 min: the groups its filter drops are regenerated), DAPO without the filter 0.58 (6.2-6.4 min);
~271 min per seed, **~13.5 h** in all, if G = 16 costs what G = 2 does; loaded cores make every run slower.

Pilot (``--pilot g16_oracle_a1 --steps 4``, seed 0, 2 cores under load ~6): 511 s end to end (10 value-pretraining
steps, 4 RL steps of 256 samples, 3 evaluations); avg@8 0.213 -> 0.303; the oracle's EV on the RL batches 0.41 /
0.26 / 0.45, the trained critic's 0.27 / 0.10 / 0.21 (steps 1-3).

**A study longer than a machine's lease.** Run directories stay on the machine that made them, so each run
that finishes is also kept, as one line of its readings (every evaluation on every axis, the final accuracy,
its seconds, the commit and CPU it ran on, the load at its start and end, its critic's explained variance:
``critic_readings``, and at each evaluation's step: ``critic_at_evaluations``; lines written before those were
kept have none), in ``docs/results/value_parts_runs.jsonl``: committed, it lets the next checkout, on this
machine or another, go on from there (a recorded run counts as done) and the summary read every run so far.
``--max-runs N`` starts at most N runs, to fit a session:

    .venv/bin/python -m ops.bench.suites.experiments --suite value_parts --max-runs 6

Runs recorded on different CPUs are comparable on every axis but wall time; the summary lists the CPUs
(``machines``), and each difference its two arms' (``cpus``): a wall-time difference across them is marked.

The summary (one JSON line, ``summary``): per arm the final held-out avg@8 (each seed, mean, sd), the
accuracy at equal budget on every compute axis of ``ops.bench.reports.compute_axes`` (samples, generated tokens,
learner and critic token passes, wall time; the budget is the largest every run of the regime reached, critic
passes among the runs that train a critic, and only those runs are read on that axis) and on policy passes
(learner passes less the critic's: what the actor's updates cost, and all an oracle critic would cost, since
the oracle arm trains a critic only to measure it), and per regime (G, α)
the differences that separate the parts (a pair of DAPO arms, which have no α, once per G): ``DIFFERENCES``
(and per G what α = 0.05 does to an arm against α = 1: ``ALPHA_DIFFERENCES``),
each with the Welch σ of the difference of two means (sqrt(sd_a²/n_a + sd_b²/n_b)) and, since every arm runs the
same seeds, seed-blocked (``paired``: the per-seed differences' mean, standard error, df and paired-t p) at the
regime's equal budgets and at the pair's own (``own``, the largest both arms' runs reached: ``own_budgets``);
every arm across G at one budget of generated tokens (``cross_g``); and per arm its critic's explained variance
(``critic``: the best held-out EV of value pretraining, and the means over the RL steps of the critic's and the
reference critic's on the RL batches).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from common.provenance import of_run
from ops.bench.reports import paired, value_parts_report
from ops.bench.reports.compute_axes import AXES, AxisRun, accuracy_at, load_axis_run
from ops.bench.reports.run_records import port_overrides
from ops.bench.suites import value_parts_ledger
from ops.bench.suites.long_suite import DAPO
from ops.bench.suites.value_parts_ledger import (
    AXES_VERSION,
    CRITIC_READINGS,
    critic_readings,
    pretraining_counted_once,
)
from ops.bench.suites.value_study_suite import group_overrides

REPO = Path(__file__).resolve().parents[3]
LEDGER = REPO / "docs" / "results" / "value_parts_runs.jsonl"  # every finished run's readings, committed
NOTES = REPO / "docs" / "results" / "value_parts_notes.md"  # the section's hand-written reading
CONFIG = "ops/configs/long.yaml"
STEPS = 40
SEEDS = (0, 1, 2)
GROUPS = (2, 16)
ALPHAS = (1.0, 0.05)
SHARED = ("learner.eval_every=5",)
RUN_MIN = 11.0             # a critic arm on long.yaml, 40 steps, evaluated every 5: median of 13 G = 2 runs
DAPO_SHARE = 0.87          # DAPO against that: the median of 6 (its filter's dropped groups are regenerated)
NOFILTER_SHARE = 0.58      # DAPO without the filter against that: the median of 3
CRITIC_ARMS: dict[str, tuple[str, ...]] = {
    "vapo": (),
    "vapo_nonll": ("nll.coef=0",),
    "oracle": ("algo.critic=oracle", "algo.actor_values=pre_update"),
    "trainable": ("learner.critic_lr=1e-4", "value_pretrain.lr=1e-4"),
    "backbone": ("learner.critic_lr=1e-4", "value_pretrain.lr=1e-4", "learner.value_head_lr_scale=100"),
}
DAPO_ARMS: dict[str, tuple[str, ...]] = {
    "dapo": DAPO,
    "dapo_nofilter": (*DAPO, "buffer.filter_uniform_groups=false"),
    "dapo_nll": (*DAPO, "nll.coef=0.1"),
}
# The critic trained as the paper trains one (lr 2 x the actor's, warmup, K_v = 16, value pretraining in epochs to
# its plateau, refused at EV <= 0) and the leave-one-out baseline: opt-in arms (the module docstring).
PAPER_CRITIC = ("learner.critic_lr=2e-4",  # 2 x long.yaml's actor lr (paper.yaml: 2e-6 : 1e-6)
                "learner.critic_warmup_steps=160",  # optimizer steps: 10 learner steps of K_v = 16
                "learner.critic_updates=16", "learner.value_head_lr_scale=50",  # the surprise MLP stays at 1e-2
                "value_pretrain.lr=2e-4", "value_pretrain.steps=50", "value_pretrain.patience=5",
                "value_pretrain.pool_groups=128", "value_pretrain.allow_untrained_critic=false")
PAPER_FROZEN = (*PAPER_CRITIC, "learner.value_head_surprise_source=frozen_base")  # the variant that cleared the bar
CRITIC_TRAINING_ARMS: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {  # arm: (group sizes, overrides)
    "paper_behaviour": (GROUPS, (*PAPER_CRITIC, "learner.value_head_surprise_source=behaviour")),
    "paper_frozen": (GROUPS, PAPER_FROZEN),
    "loo": ((16,), ("algo.baseline=group_loo",)),
    # PPO's clipped value loss on the frozen-base critic (the variant that beat shipped VAPO at both G, α = 1): with
    # K_v = 16 updates a step at 2 x the actor's lr, clipping each value to 0.2 (a fifth of the 0-1 reward) around
    # its pre-update value is what would hold a fast critic back
    "paper_clip": (GROUPS, (*PAPER_FROZEN, "algo.value_clip=0.2")),
}
PAPER_SHARE = 1.1          # paper_behaviour's median run (733 s of 703-862, 6 runs, Xeon) against RUN_MIN
# (a, b, what a − b measures); a critic arm and "dapo*" are matched within the regime (G, α).
DIFFERENCES = (("vapo", "dapo", "as shipped"), ("vapo_nonll", "dapo", "the critic alone (no NLL in either)"),
               ("vapo", "dapo_nll", "both with the NLL"), ("dapo", "dapo_nofilter", "DAPO's filter"),
               ("vapo", "dapo_nofilter", "as shipped, against DAPO without its filter"),
               ("vapo_nonll", "dapo_nofilter", "the critic alone, against DAPO without its filter"),
               ("oracle", "vapo", "what the reference critic adds"), ("oracle", "dapo", "the reference critic against none"),
               ("oracle", "dapo_nll", "the reference critic against none, both with the NLL"),
               ("trainable", "vapo", "a critic that can learn"),
               ("backbone", "vapo", "the backbone at the actor's lr, its head's as shipped"))
# The opt-in arms against shipped VAPO and against DAPO with the NLL (the best critic-free arm per update),
# where both have runs; read at the study's budgets (set by its own arms alone) and at the pair's own.
OPT_IN_DIFFERENCES = (
    ("paper_behaviour", "vapo", "the paper's critic training, surprise from the behaviour log-probs"),
    ("paper_behaviour", "dapo_nll", "that critic against none, both with the NLL"),
    ("paper_frozen", "vapo", "the paper's critic training, surprise from a frozen base LM head"),
    ("paper_frozen", "dapo_nll", "that critic against none, both with the NLL"),
    ("loo", "vapo", "the group's leave-one-out baseline, the critic for credit within a response"),
    ("loo", "dapo_nll", "that baseline against no critic, both with the NLL"),
    ("paper_clip", "vapo", "the paper's critic (frozen base) with its value loss clipped at 0.2"),
    ("paper_clip", "paper_frozen", "what value clipping does to that critic"))
# One arm at the paper's α (0.05) against itself at α = 1, on the same seeds, per G (keys "g<G>: <arm> a0.05 − a1").
ALPHA_DIFFERENCES = (("vapo", "the paper's α, shipped critic"), ("paper_frozen", "the paper's α, paper-trained critic"))
WITH_ALPHA = frozenset((*CRITIC_ARMS, *CRITIC_TRAINING_ARMS))  # arms that read a critic, so have an α
# Every axis a run is read on: compute_axes' and policy passes (learner passes less the critic's).
READ_AXES = (*AXES, "policy_passes")


def arms() -> dict[str, tuple[str, ...]]:
    """Every arm's name (``g<G>_<arm>[_a<α>]``) and its overrides on top of long.yaml, in the order they run:
    one regime (G, α) whole before the next, shipped VAPO and DAPO first, so that a suite run a session at a
    time has complete comparisons to read early (G = 2 at α = 1 after its first 21 runs)."""
    out: dict[str, tuple[str, ...]] = {}
    for g in GROUPS:
        for i, a in enumerate(ALPHAS):
            critic = {f"g{g}_{arm}_a{a:g}": (*SHARED, *group_overrides(g), f"algo.alpha={a}", *ov)
                      for arm, ov in CRITIC_ARMS.items()}
            dapo = {f"g{g}_{arm}": (*SHARED, *group_overrides(g), *ov) for arm, ov in DAPO_ARMS.items()} if i == 0 else {}
            first, *others = critic.items()
            out.update([first, *dapo.items(), *others])
    return out


def critic_training_arms() -> dict[str, tuple[str, ...]]:
    """``CRITIC_TRAINING_ARMS`` by regime (``g<G>_<arm>_a<α>``), α = 1 first: the follow-up's arms, run at
    α = 0.05 only for the best of them."""
    return {f"g{g}_{arm}_a{a:g}": (*SHARED, *group_overrides(g), f"algo.alpha={a}", *ov)
            for a in ALPHAS for arm, (gs, ov) in CRITIC_TRAINING_ARMS.items() for g in gs}


def name(arm: str) -> str:
    return f"vp_{arm}"


OPT_IN = frozenset(name(a) for a in critic_training_arms())


def all_arms() -> dict[str, tuple[str, ...]]:
    """The study's arms, then the opt-in ones: every arm a run or a ledger line can belong to."""
    return {**arms(), **critic_training_arms()}


def experiments(Experiment: Any) -> list[Any]:
    return [Experiment(name(a), "value_parts", f"{a} on long.yaml", CONFIG, ov, seeds=SEEDS, steps=STEPS)
            for a, ov in all_arms().items()]


def estimate_run_minutes(run: str) -> float:
    """Minutes one run of ``run`` (an experiment name) takes on 2 quiet cores."""
    if "_paper_" in run:
        return RUN_MIN * PAPER_SHARE
    if "_dapo" not in run:
        return RUN_MIN
    return RUN_MIN * (NOFILTER_SHARE if run.endswith("_nofilter") else DAPO_SHARE)


def total_minutes() -> float:
    return sum(estimate_run_minutes(name(a)) for a in arms()) * len(SEEDS)


def diff(a: list[float], b: list[float]) -> dict[str, Any] | None:
    """mean(a) − mean(b) and the σ of that difference, sqrt(sd_a²/n_a + sd_b²/n_b) (sd 0 for one seed)."""
    if not a or not b:
        return None
    sd = [statistics.stdev(x) if len(x) > 1 else 0.0 for x in (a, b)]
    return {"diff": statistics.fmean(a) - statistics.fmean(b),
            "sigma": math.sqrt(sd[0] ** 2 / len(a) + sd[1] ** 2 / len(b)), "n": [len(a), len(b)]}


def read_ledger(ledger: Path | None = None) -> dict[str, dict[str, Any]]:
    """The recorded runs by name (a later line of the same run replaces an earlier one). ``None``: ``LEDGER``,
    looked up on each call (a default bound at import would ignore a test's or a tool's own ledger)."""
    return value_parts_ledger.read(LEDGER if ledger is None else ledger)


def recorded_names(ledger: Path | None = None) -> set[str]:
    """Runs the ledger holds: done, wherever they ran."""
    return set(read_ledger(ledger))


def record(root: Path, run: str, seconds: float, ledger: Path | None = None) -> dict[str, Any] | None:
    """Keep finished run ``run``'s readings in the ledger (its line replaced if it was there); None, and
    nothing written, for a run without ``summary.json`` or without evaluations beyond the base one."""
    row = value_parts_ledger.run_row(root / run, run, seconds)
    if row is not None:
        value_parts_ledger.write_row(LEDGER if ledger is None else ledger, row)
    return row


def on_run_done(root: Path, run: str, rc: int, seconds: float, log: Any) -> None:
    """After each run of the suite: a finished one goes into the ledger at once (a killed driver loses none)."""
    if rc == 0 and record(root, run, seconds) is not None:
        log(f"{run}: recorded in {LEDGER.relative_to(REPO)}")


def runs_by_arm(root: Path, ledger: Path | None = None) -> tuple[dict[str, list[AxisRun]], dict[str, str]]:
    """Each arm's finished runs with evaluations beyond the base one (a run directory under ``root`` wins over
    its ledger line; one without ``summary.json``, still running or killed, is left out), and each run's CPU."""
    kept = read_ledger(ledger)
    runs: dict[str, list[AxisRun]] = {}
    machines: dict[str, str] = {}
    for arm in all_arms():
        for s in SEEDS:
            run = f"{name(arm)}-s{s}"
            r = load_axis_run(root / run) if (root / run / "summary.json").exists() else None  # finished only
            if r is None and run in kept:
                points = kept[run]["points"]
                r = AxisRun(run, points if kept[run].get("axes_version", 1) >= AXES_VERSION
                            else pretraining_counted_once(points))
                machines[run] = kept[run].get("cpu", "unknown")
            elif r is not None:
                machines[run] = ((of_run(root / run) or {}).get("cpu") or {}).get("model", "unknown")
            if r is not None and len(r.points) > 1:
                runs.setdefault(arm, []).append(with_policy_passes(r))
    return runs, machines


def with_policy_passes(run: AxisRun) -> AxisRun:
    """``run`` with each evaluation's policy passes: its learner passes less the critic's."""
    return AxisRun(run.name, [{**p, "policy_passes": p["learner_passes"] - p["critic_passes"]} for p in run.points])


def critic_by_arm(root: Path, ledger: Path | None = None) -> dict[str, dict[str, list[float]]]:
    """Each arm's ``CRITIC_READINGS`` over its finished runs that have them (a run directory under ``root``
    wins over its ledger line; ledger lines from before the readings were kept have none)."""
    kept = read_ledger(ledger)
    out: dict[str, dict[str, list[float]]] = {}
    for arm in all_arms():
        for s in SEEDS:
            run = f"{name(arm)}-s{s}"
            d = root / run
            got = critic_readings(d) if (d / "summary.json").exists() else kept.get(run, {}).get("critic") or {}
            for k in CRITIC_READINGS:
                if (v := got.get(k)) is not None:
                    out.setdefault(arm, {}).setdefault(k, []).append(v)
    return out


def summary(root: Path, load_run: Any = None, ledger: Path | None = None) -> dict[str, Any]:
    """Per arm: final accuracy per seed and at equal budget per axis; per regime the differences (docstring).
    Reads the runs under ``root`` and those the ledger holds. The budgets are the study's arms' alone, so that
    an opt-in arm's runs, read there, move none of the study's figures (``runs``: the study's runs;
    ``opt_in_runs``: the others)."""
    runs, machines = runs_by_arm(root, ledger)
    cpus = {arm: {machines[r.name] for r in rs} for arm, rs in runs.items()}
    study = arms()
    out: dict[str, Any] = {"estimate_minutes": round(total_minutes()),
                           "runs": sum(len(rs) for arm, rs in runs.items() if arm in study),
                           "opt_in_runs": sum(len(rs) for arm, rs in runs.items() if arm not in study),
                           "machines": sorted(set(machines.values())), "budgets": {}, "arms": {}, "differences": {},
                           "critic": critic_by_arm(root, ledger)}
    for g in GROUPS:
        in_g = [r for arm, rs in runs.items() if arm.startswith(f"g{g}_") and arm in study for r in rs]
        # an axis a run has none of (DAPO's critic passes) is not a budget: it is read only for runs that have it
        budgets = {axis: min((r.points[-1][axis] for r in in_g if r.points[-1][axis] > 0), default=0.0)
                   for axis in READ_AXES}
        if in_g:
            out["budgets"][g] = budgets
        for arm, rs in runs.items():
            if not arm.startswith(f"g{g}_"):
                continue
            row: dict[str, Any] = {"final": [r.points[-1]["acc"] for r in rs]}
            for axis in READ_AXES:
                row[f"at_equal_{axis}"] = list(at_budget(rs, axis, budgets[axis]).values())
            out["arms"][arm] = row
    for g in GROUPS:
        for i, alpha in enumerate(f"a{x:g}" for x in ALPHAS):
            for a, b, what in (*DIFFERENCES, *OPT_IN_DIFFERENCES):
                with_alpha = a in WITH_ALPHA or b in WITH_ALPHA
                if not with_alpha and i > 0:
                    continue  # a pair of DAPO arms has no α: once per G
                an, bn = (f"g{g}_{x}_{alpha}" if x in WITH_ALPHA else f"g{g}_{x}" for x in (a, b))
                _difference(out, runs, cpus, (an, bn, g, what),
                            f"g{g} {alpha}: {a} − {b}" if with_alpha else f"g{g}: {a} − {b}")
        for arm, what in ALPHA_DIFFERENCES:  # an arm at the paper's α against itself at α = 1, same seeds
            _difference(out, runs, cpus, (f"g{g}_{arm}_a0.05", f"g{g}_{arm}_a1", g, what), f"g{g}: {arm} a0.05 − a1")
    out["cross_g"] = cross_g(runs, study)
    out["default_verdict"] = default_verdict(out)
    return out


def _difference(out: dict[str, Any], runs: dict[str, list[AxisRun]], cpus: dict[str, set[str]],
                pair: tuple[str, str, int, str], key: str) -> None:
    """``out["differences"][key]``: arm a − arm b (``pair``: names, G, what it measures) where both have runs."""
    an, bn, g, what = pair
    ra, rb = out["arms"].get(an), out["arms"].get(bn)
    if ra is not None and rb is not None:
        out["differences"][key] = {
            "what": what, "cpus": sorted(cpus[an] | cpus[bn]), "final": diff(ra["final"], rb["final"]),
            **{f"at_equal_{ax}": diff(ra[f"at_equal_{ax}"], rb[f"at_equal_{ax}"]) for ax in READ_AXES},
            **seed_blocked(runs[an], runs[bn], out["budgets"][g])}


def default_verdict(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per opt-in arm and α: its seed-blocked difference from shipped VAPO at the end of each G's runs (every
    arm makes the same number of policy updates), and whether it beats VAPO per update at every G of the
    study (mean > 0 with p < 0.05, every seed in at each): the bar for becoming ``long.yaml``'s default. An
    arm that runs at one G only (``loo``) cannot pass it."""
    out: dict[str, dict[str, Any]] = {}
    for arm in CRITIC_TRAINING_ARMS:
        for alpha in (f"a{x:g}" for x in ALPHAS):
            by_g = {g: summary["differences"].get(f"g{g} {alpha}: {arm} − vapo", {}).get("paired", {}).get("final")
                    for g in GROUPS}
            if not any(by_g.values()):
                continue
            beats = all(d is not None and len(d["seeds"]) == len(SEEDS) and d["diff"] > 0 and d["p"] is not None
                        and d["p"] < 0.05 for d in by_g.values())
            out[f"{arm} {alpha}"] = {"by_g": by_g, "beats_at_every_g": beats}
    return out


def at_budget(rs: list[AxisRun], axis: str, budget: float) -> dict[int, float]:
    """Each run's accuracy at ``budget`` on ``axis`` by seed, for the runs that have the axis and reach it."""
    return {paired.seed_of(r.name): a["acc"] for r in rs if r.points[-1][axis] > 0
            and (a := accuracy_at(r.points, axis, budget)) is not None}


def seed_blocked(ra: list[AxisRun], rb: list[AxisRun], budgets: dict[str, float]) -> dict[str, Any]:
    """Two arms' seed-blocked differences (``paired.paired``): ``paired`` at the end and at the regime's equal
    budgets (the columns beside it), ``own`` at the pair's own budgets, the largest both arms' runs reached
    (so that no third arm sets where the pair is read), and ``own_budgets`` those budgets."""
    final_a = {paired.seed_of(r.name): r.points[-1]["acc"] for r in ra}
    final_b = {paired.seed_of(r.name): r.points[-1]["acc"] for r in rb}
    both = [*ra, *rb]
    own = {ax: min((r.points[-1][ax] for r in both if r.points[-1][ax] > 0), default=0.0) for ax in READ_AXES}
    return {"paired": {"final": paired.paired(final_a, final_b),
                       **{f"at_equal_{ax}": paired.paired(at_budget(ra, ax, budgets[ax]), at_budget(rb, ax, budgets[ax]))
                          for ax in READ_AXES}},
            "own": {"final": paired.paired(final_a, final_b),
                    **{f"at_equal_{ax}": paired.paired(at_budget(ra, ax, own[ax]), at_budget(rb, ax, own[ax]))
                       for ax in READ_AXES}},
            "own_budgets": own}


def cross_g(runs: dict[str, list[AxisRun]], study: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """Every arm at each G read at one budget of generated tokens, the largest every run of the study's arms
    (``study``) reached: ``budget`` and per arm (its name without ``g<G>_``) and G its accuracy by seed."""
    every = [r for arm, rs in runs.items() if arm in study for r in rs]
    budget = min((r.points[-1]["gen_tokens"] for r in every), default=0.0)
    arms_: dict[str, dict[int, dict[int, float]]] = {}
    for arm, rs in runs.items():
        g, rest = arm[1:].split("_", 1)
        arms_.setdefault(rest, {})[int(g)] = at_budget(rs, "gen_tokens", budget)
    return {"budget": budget, "arms": arms_}


def report(root: Path, summary: dict[str, Any], out: Path) -> None:
    """The suite's section of ``out`` (docs/RESULTS.md) and its plots: value_parts_report."""
    kept = read_ledger(LEDGER)
    hours = {opt: sum(r.get("seconds", 0.0) for r in kept.values() if (r["run"].rsplit("-s", 1)[0] in OPT_IN) == opt) / 3600
             for opt in (False, True)}
    value_parts_report.write(out, summary, value_parts_report.Study(
        arms=list(arms()), groups=GROUPS, alphas=ALPHAS, total_runs=len(arms()) * len(SEEDS), hours=hours[False],
        opt_in=list(critic_training_arms()), opt_in_total=len(critic_training_arms()) * len(SEEDS),
        opt_in_hours=hours[True], source=str(LEDGER.relative_to(REPO) if LEDGER.is_relative_to(REPO) else LEDGER),
        task=CONFIG, steps=STEPS, runs=runs_by_arm(root, LEDGER)[0], notes=NOTES,
        made=[{k: r.get(k) for k in ("run", "commit", "dirty", "critic_at_eval")} for r in kept.values()]))


def pilot(arm: str, steps: int, seed: int, root: Path) -> int:
    """One arm, one seed, ``steps`` learner steps (evaluated every other step) under ``root``: the suite's own
    command line, short. Prints the run directory."""
    overrides = {**arms(), **critic_training_arms()}[arm]
    cmd = [str(REPO / "ops" / "launch.sh"), str(REPO / CONFIG), f"run.root={root}", f"run.name={name(arm)}-s{seed}",
           f"run.seed={seed}", f"learner.total_steps={steps}", *overrides, f"learner.eval_every={max(1, steps // 2)}",
           *port_overrides(0)]
    print("$ " + " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=REPO)
    print(root / f"{name(arm)}-s{seed}")
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops.bench.suites.value_parts_suite", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--pilot", metavar="ARM", help=f"run one arm briefly: {', '.join(arms())}")
    ap.add_argument("--steps", type=int, default=4, help="--pilot: learner steps (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", type=Path, default=REPO / "runs" / "exp-value-parts-pilot")
    ap.add_argument("--estimate", action="store_true", help="print the suite's runs and estimated minutes")
    args = ap.parse_args(argv)
    if args.estimate or not args.pilot:
        extra = critic_training_arms()
        extra_min = sum(estimate_run_minutes(name(a)) for a in extra) * len(SEEDS)
        print(f"{len(arms())} arms x {len(SEEDS)} seeds = {len(arms()) * len(SEEDS)} runs, "
              f"~{total_minutes():.0f} min (~{total_minutes() / 60:.1f} h) on 2 quiet cores; opt-in (--only): "
              f"{len(extra)} critic-training arms x {len(SEEDS)} seeds, ~{extra_min:.0f} min")
        return 0
    if args.pilot not in {**arms(), **critic_training_arms()}:
        ap.error(f"unknown arm {args.pilot!r}; choose from {', '.join({**arms(), **critic_training_arms()})}")
    return pilot(args.pilot, args.steps, args.seed, args.root.resolve())


if __name__ == "__main__":
    sys.exit(main())
