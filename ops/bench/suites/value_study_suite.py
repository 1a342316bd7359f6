"""Where does the value model pay? VAPO against DAPO in the regimes where a group baseline should be weak,
both arms training the same samples per step and compared at equal paid (generated) samples too, run by
``python -m ops.bench.suites.experiments --suite value_study``:

    .venv/bin/python -m ops.bench.suites.experiments --suite value_study           # run what is missing, then summarise
    .venv/bin/python -m ops.bench.suites.experiments --suite value_study --list    # the cells, runs, states, phase-2 pick
    .venv/bin/python -m ops.bench.suites.experiments --suite value_study --report-only

Root ``runs/exp-value-study``; every run is a plain ``ops/launch.sh ops/configs/long.yaml ...`` (resumable as
in the other suites). Both arms are ``long.yaml`` (VAPO: α = 1, surprise critic, 10 value-pretraining steps)
and ``long_suite.DAPO`` on top of the cell's shared overrides. Every run trains 40 steps x 256 samples
(``learner.batch_groups`` x ``actors.group_size`` = 256 in every cell; value pretraining's groups and the
actors' prompts in flight are scaled the same way, so VAPO's pretraining samples and the sequences decoded
at once are the same at every G). The cells:

- (a) small groups: G = 2, 4, 8, 16 (batch_groups 128, 64, 32, 16), the long task as shipped;
- (b) hard prompts: ``task.min_steps=35`` (35-44 additions, 319-400 tokens; the shipped base gets ~8% of
  such chains right: RESULTS.md, 321-400 tokens: 0.08), so most groups of 8 are all-wrong and DAPO's dynamic
  sampling drops them; ``task.eval_size=189`` is every held-out item of that range;
- (c) the longest chains: ``task.min_steps=20`` (the ``long`` bucket only, 184-400 tokens, base ~11%);
- (d) a critic that can assign credit, VAPO only (against the G = 8 cell's DAPO): 50 value-pretraining
  steps instead of 10 (patience 50, so it does not stop early) at α = 1, 0.2 and 0.05, with the policy-sized
  critic (``pt50_*``) and with a critic twice the policy (``x2_*``: ``model.critic_path`` = the shipped
  chain-tiny base grown from 3 to 6 layers, 0.60M -> 1.19M parameters, by ``learner.grow``; ``prepare``
  builds it in seconds). The pair at each α separates capacity from pretraining budget.

Without a new base, difficulty on ``chain`` comes only from length (the per-line slip rate is the base's, set
by ``model.bootstrap.teacher_error_rate`` when it is built): a higher slip rate needs a new base (a new
``model.path`` with that key, built by ``ops/launch.sh``, ~11-40 min of SFT here) or a higher
``actors.temperature``, which changes the held-out evaluation too; neither is in the scan. Likewise the larger
critic is grown from the policy's base rather than pretrained at its size: a wider model trained as long as
the base (600 SFT steps) would cost 1-2 h here, and a critic that is a worse language model than the policy
would also have worse surprise features (its own LM head reads them); growing keeps them the policy's at the
start. A larger pretrained critic, as used in practice, is one ``model.critic_path`` away.

Two phases (``pick_phase2``): phase 1 is seed 0 of every cell; once all of it is done, a cell whose seed-0
VAPO − DAPO held-out avg@8 differs by more than ``THRESHOLD`` (0.05: about twice the seed sd of the long table
from the shipped base, 0.013-0.030) gets seeds 1 and 2 of both arms, largest |difference| first, while the
estimated cost fits the rest of the 5 h budget (``phase2_budget``: 5 h minus the wall time of the runs done
and the estimate of the seed-0 runs still to do). The difference is taken at equal paid
samples for (a)-(c), the issue's measure (DAPO pays for the uniform groups it drops, VAPO for value
pretraining), and at step 40 (equal trained samples) for (d), whose question is what a better critic buys
(its pretraining's cost is in the table apart). The summary reports the seed-1/2 difference apart
("confirm"), since seed 0 chose the cell. After the runs (``post``) every finished VAPO run's critic is probed
along long failed responses (``ops/bench/probes/value_curve.py``, ``value_curve.json``, as the long suite does).

Estimated compute on 2 quiet cores (``estimate_minutes``: 8 min per VAPO long.yaml run, scaled by the mean
response length; DAPO, with no critic, 0.55 of that plus its extra generation for dropped uniform groups;
VAPO's extra value pretraining; ``critic_cost`` 1.5 for the 2x critic, as measured): phase 1 is 18 runs (the G = 8 DAPO arm
serves the (d) cells too), ~208 min (a: 56, b: 32, c: 23, d: 96); phase 2 at most the remaining ~92 min (e.g.
one (a) cell's two arms, 28-34 min; the (b) cell's would take 64 min); total <= 5 h.
``--list`` prints each run's estimate; loaded cores (another job running) make every run slower.

The summary is one JSON line, per cell: each arm's final held-out avg@8 (mean, per seed), per length bucket,
the critic's mean EV, learner seconds (net of evaluation, value pretraining included), VAPO − DAPO (all seeds,
seed 0, seeds 1-2), per bucket, at equal paid samples (each arm's accuracy where the cheaper arm ends: every
cell trains the same samples, but DAPO also pays for the uniform groups it drops and VAPO for value
pretraining's) and at equal learner wall time (likewise, in time), with the value along failed responses and
where the actor's advantage falls (``value_curve.json``) where probed. ``report`` writes it as a section of
docs/RESULTS.md (``value_study_report.py``).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.bench.reports import value_study_report
from ops.bench.reports.run_records import load_run
from ops.bench.suites.long_suite import DAPO, last_eval, pretrain_seconds, probe_values

CONFIG = "ops/configs/long.yaml"
STEPS = 40
SAMPLES_PER_STEP = 256     # learner.batch_groups x actors.group_size in every cell (long.yaml: 32 x 8)
SEQS_IN_FLIGHT = 128       # actors.prompts_in_flight x G (long.yaml: 16 x 8)
THRESHOLD = 0.05           # |VAPO − DAPO| final avg@8 (seed 0) that earns a cell seeds 1 and 2
PHASE2_SEEDS = (1, 2)
BUDGET_MIN = 300.0         # the 5 h
RUN_MIN = 8.0              # one VAPO long.yaml run of 40 steps on quiet cores (measured 7.9-8.4 min at G = 2, 4, 8)
DAPO_SHARE = 0.55          # a DAPO run (no critic) against a VAPO one, before regenerated groups (measured at G = 8)
BUCKETS = ("short", "medium", "long")
PHASED = True              # experiments() reads root: experiments.run_actor_values runs a second pass for phase 2
REPORT_FROM_RUNS = True    # report() reads run directories: re-made from none it would empty its section


@dataclass(frozen=True)
class Cell:
    name: str
    regime: str                   # a | b | c | d (the list)
    label: str
    shared: tuple[str, ...]       # both arms
    vapo: tuple[str, ...] = ()    # VAPO's arm only
    dapo_cell: str | None = None  # the cell whose DAPO arm this one is compared with (None: its own)
    min_steps: int = 5            # the chain lengths (for the cost estimate)
    max_steps: int = 44
    base_acc: float = 0.21        # the shipped base's held-out accuracy on the cell's task (RESULTS.md)
    group_size: int = 8
    critic_cost: float = 1.0      # a VAPO run's time relative to one with a policy-sized critic (estimate)
    pick_on: str = "paid"         # phase 2's measure: VAPO − DAPO at equal paid samples | "trained" (at step 40)


def group_overrides(g: int) -> tuple[str, ...]:
    """G and everything scaled with it, so every G generates and trains the same samples per step."""
    n = SAMPLES_PER_STEP // g
    return (f"actors.group_size={g}", f"learner.batch_groups={n}", f"value_pretrain.batch_groups={n}",
            f"value_pretrain.eval_groups={n}", f"actors.prompts_in_flight={SEQS_IN_FLIGHT // g}")


PT50 = ("value_pretrain.steps=50", "value_pretrain.patience=50")
# A critic twice the policy: the shipped chain-tiny base grown from 3 to 6 layers by block expansion
# (learner.grow: the copies start as identity blocks, so it starts as the policy's own function); prepare() builds it.
CRITIC_X2 = "runs/bases/chain-tiny-x2"
CRITIC_X2_SOURCE, CRITIC_X2_LAYERS = "ops/bases/chain-tiny", 6
CELLS: tuple[Cell, ...] = (
    *(Cell(f"g{g}", "a", f"G = {g}, {SAMPLES_PER_STEP // g} prompts per step", group_overrides(g), group_size=g)
      for g in (2, 4, 8, 16)),
    Cell("hard", "b", "hard prompts: 35-44 additions (base ~8%)", ("task.min_steps=35", "task.eval_size=189"),
         min_steps=35, base_acc=0.08),
    Cell("longest", "c", "longest chains: 20-44 additions (base ~11%)", ("task.min_steps=20",),
         min_steps=20, base_acc=0.11),
    *(Cell(f"pt50_a{a:g}", "d", f"50 value-pretraining steps, α = {a:g} (vs DAPO at G = 8)",
           group_overrides(8), (*PT50, f"algo.alpha={a}"), dapo_cell="g8", pick_on="trained")
      for a in (1.0, 0.2, 0.05)),
    *(Cell(f"x2_a{a:g}", "d", f"critic 2x the policy (6 layers, 1.19M), 50 value-pretraining steps, α = {a:g} "
           "(vs DAPO at G = 8)", group_overrides(8), (f"model.critic_path={CRITIC_X2}", *PT50, f"algo.alpha={a}"),
           dapo_cell="g8", critic_cost=1.5, pick_on="trained") for a in (1.0, 0.2, 0.05)),
)
BY_CELL = {c.name: c for c in CELLS}


def arm_name(cell: str, arm: str) -> str:
    return f"vs_{cell}_{arm}"


def arms(c: Cell) -> dict[str, str]:
    """The experiment name of each arm of ``c`` (DAPO's may be another cell's)."""
    return {"vapo": arm_name(c.name, "vapo"), "dapo": arm_name(c.dapo_cell or c.name, "dapo")}


def _mean_steps(lo: int, hi: int) -> float:
    """Mean additions of ChainTask's draw: int(exp(U(log lo, log(hi + 1)))) capped at hi."""
    return (hi + 1 - lo) / math.log((hi + 1) / lo) - 0.5


def estimate_minutes(c: Cell, arm: str) -> float:
    """One run's minutes on 2 quiet cores: RUN_MIN scaled by mean response length (9 tokens per addition + 4);
    DAPO regenerates the groups it drops as uniform (generation taken as half a run), from the base's
    accuracy p as p^G + (1 − p)^G; VAPO's extra value-pretraining steps cost ~0.6 of an RL step each."""
    t = RUN_MIN * (9 * _mean_steps(c.min_steps, c.max_steps) + 4) / (9 * _mean_steps(5, 44) + 4)
    if arm == "dapo":
        p, g = c.base_acc, c.group_size
        return DAPO_SHARE * t * (0.5 + 0.5 / (1 - p ** g - (1 - p) ** g))
    extra = sum(int(o.split("=")[1]) - 10 for o in c.vapo if o.startswith("value_pretrain.steps="))
    return t * (1 + 0.6 * extra / STEPS) * c.critic_cost


def runs() -> dict[str, tuple[Cell, str]]:
    """Every run of the suite once (a shared DAPO arm once): experiment name -> (the cell it is set up by, arm)."""
    out: dict[str, tuple[Cell, str]] = {}
    for c in CELLS:
        for arm, name in arms(c).items():
            out.setdefault(name, (c if arm == "vapo" or c.dapo_cell is None else BY_CELL[c.dapo_cell], arm))
    return out


def users(name: str) -> set[str]:
    """The cells comparing against run ``name``."""
    return {c.name for c in CELLS if name in arms(c).values()}


def experiments(Experiment: Any, root: Path | None = None) -> list[Any]:
    """Every cell's arms; seeds 1-2 for the arms of the cells ``pick_phase2(root)`` chose (none before)."""
    picked = set(pick_phase2(root) or []) if root is not None else set()
    out = []
    for name, (c, arm) in runs().items():
        ov = (*c.shared, *(c.vapo if arm == "vapo" else DAPO))
        out.append(Experiment(name, "value_study", f"({c.regime}) {arm.upper()}, {c.label}", CONFIG, ov,
                              seeds=(0, *PHASE2_SEEDS) if picked & users(name) else (0,), steps=STEPS))
    return out


def estimate_run_minutes(exp_name: str) -> float:
    """Estimated minutes of one run of the experiment ``exp_name``."""
    cell, arm = exp_name[3:].rsplit("_", 1)
    return estimate_minutes(BY_CELL[cell], arm)


def phase1_minutes() -> float:
    return sum(estimate_run_minutes(n) for n in runs())


def seed0_delta(c: Cell, root: Path, load_run: Any) -> float | None:
    """VAPO − DAPO of seed 0 on the cell's measure (``Cell.pick_on``): at equal paid samples (each arm's
    held-out avg@8 where the cheaper arm ends) or at the final step (equal trained samples); None: not run."""
    v, d = (load_run(root / f"{n}-s0") for n in arms(c).values())
    if v is None or d is None:
        return None
    if c.pick_on == "trained":
        return float(v.final(STEPS)["acc"]) - float(d.final(STEPS)["acc"])
    x = min(v.points[-1]["cost"], d.points[-1]["cost"])
    return _acc_at(v.points, x, 0.0, "cost") - _acc_at(d.points, x, 0.0, "cost")


def _finished(root: Path, name: str, seed: int) -> bool:
    return (root / f"{name}-s{seed}" / "summary.json").is_file()


def spent_minutes(root: Path) -> float:
    """Minutes the suite's finished runs under ``root`` took (any seed; their ``wall_seconds``)."""
    total = 0.0
    for name in runs():
        for d in root.glob(f"{name}-s*"):
            if (d / "summary.json").is_file():
                total += float(json.loads((d / "summary.json").read_text()).get("wall_seconds", 0.0))
    return total / 60


def phase2_budget(root: Path | None = None) -> float:
    """Minutes left for phase 2: the 5 h budget minus phase 1. Without ``root``, phase 1's estimate; with it,
    what the finished runs under ``root`` took plus the estimate of the seed-0 runs still to do, so a slower
    machine (or sitting) than the estimate leaves phase 2 less, never more than the budget allows."""
    if root is None:
        return BUDGET_MIN - phase1_minutes()
    todo = sum(estimate_run_minutes(n) for n in runs() if not _finished(root, n, 0))
    return BUDGET_MIN - spent_minutes(root) - todo


def phase_line(root: Path) -> str:
    """One line for ``--list``: the estimate and what phase 2 picked (or that it waits)."""
    picked = pick_phase2(root)
    state = ("waits for phase 1 (seed 0 of every cell)" if picked is None
             else f"picked {', '.join(picked) or 'no cell'} (|VAPO − DAPO| > {THRESHOLD} at seed 0)")
    return (f"value_study: phase 1 ~{phase1_minutes():.0f} min estimated; {spent_minutes(root):.0f} min of runs spent, "
            f"phase 2 budget ~{phase2_budget(root):.0f} min; phase 2 {state}")


def pick_phase2(root: Path, budget_min: float | None = None) -> list[str] | None:
    """Cells whose seed-0 VAPO − DAPO (``seed0_delta``) exceeds THRESHOLD, largest |Δ| first, while the estimated
    minutes of their runs not yet done fit ``budget_min`` (default ``phase2_budget(root)``; a shared DAPO arm
    counted once); None until every seed-0 run is done."""
    deltas = {}
    for c in CELLS:
        delta = seed0_delta(c, root, load_run)
        if delta is None:
            return None
        deltas[c.name] = delta
    picked: list[str] = []
    paid: set[str] = set()
    left = phase2_budget(root) if budget_min is None else budget_min
    for name in sorted(deltas, key=lambda n: -abs(deltas[n])):
        if abs(deltas[name]) <= THRESHOLD:
            break
        new = set(arms(BY_CELL[name]).values()) - paid
        cost = sum(estimate_run_minutes(n) for n in new for seed in PHASE2_SEEDS if not _finished(root, n, seed))
        if cost == 0 or cost <= left:  # a cell whose seeds are all done costs nothing more
            picked.append(name)
            paid |= new
            left -= cost
    return picked


def prepare(log: Any) -> None:
    """The files the runs read that no run makes: the grown critic base (seconds; kept across sittings)."""
    repo = Path(__file__).resolve().parents[3]
    if not (repo / CRITIC_X2 / "config.json").is_file():
        log(f"value_study: building the 2x critic base {CRITIC_X2} from {CRITIC_X2_SOURCE}")
        subprocess.run([sys.executable, "-m", "learner.grow", CRITIC_X2_SOURCE, CRITIC_X2, "--layers",
                        str(CRITIC_X2_LAYERS)], cwd=repo, check=True)


def report(root: Path, summary: dict[str, Any], out: Path) -> None:
    """The study's section of ``out`` (docs/RESULTS.md): value_study_report."""
    value_study_report.write(root, out, summary)


def post(root: Path, log: Any) -> None:
    """After the runs: each finished VAPO run's critic probed along long failed responses (value_curve.json)."""
    for name, (_, arm) in runs().items():
        for s in (0, *PHASE2_SEEDS):
            if arm == "vapo":
                probe_values(root / f"{name}-s{s}", log)


# --------------------------------------------------------------------------------------------- summary

def _acc_at(points: list[dict[str, float]], x: float, offset: float, key: str = "t") -> float:
    """Held-out accuracy at ``x`` of ``key`` (learner time ``t`` or paid samples ``cost``), linear between
    evaluations; ``offset`` is added to the points' ``key`` (value pretraining's seconds for ``t``)."""
    pts = [(p[key] + offset, p["acc"]) for p in points]
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, a0), (x1, a1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return a0 + (a1 - a0) * (x - x0) / max(x1 - x0, 1e-12)
    return pts[-1][1]


def _rnd(xs: list[float], nd: int = 4) -> float | None:
    return round(statistics.fmean(xs), nd) if xs else None


def _arm(root: Path, name: str, load_run: Any) -> dict[str, Any]:
    """One arm's finished seeds: final avg@8, per bucket, EV, learner seconds, the run records for timing."""
    seeds: dict[int, float] = {}
    buckets: dict[str, list[float]] = {b: [] for b in BUCKETS}
    evs: list[float] = []
    secs: list[float] = []
    paid: list[float] = []
    curves: list[tuple[list[dict[str, float]], float]] = []
    probes: list[dict[str, Any]] = []
    for s in (0, *PHASE2_SEEDS):
        d = root / f"{name}-s{s}"
        run = load_run(d)
        if run is None:
            continue
        seeds[s] = float(run.final(STEPS)["acc"])
        for b, v in (last_eval(d).get("by_bucket") or {}).items():
            if b in buckets:
                buckets[b].append(float(v["avg_at_k"]))
        evs += [x["ev"] for x in run.steps if x.get("ev") is not None]
        pre = pretrain_seconds(d)
        secs.append(run.points[-1]["t"] + pre)
        paid.append(run.points[-1]["cost"])
        curves.append((run.points, pre))
        if (d / "value_curve.json").exists():
            probes.append(json.loads((d / "value_curve.json").read_text()))
    out = {"run": name, "seeds_done": len(seeds), "final_avg_at_8": _rnd(list(seeds.values())),
           "per_seed": {str(s): round(a, 4) for s, a in seeds.items()},
           "by_bucket": {b: _rnd(v) for b, v in buckets.items() if v}, "ev_mean": _rnd(evs),
           "learner_s": _rnd(secs, 1), "paid_samples": _rnd(paid, 0)}
    if probes:
        out["value_curve"] = {k: _rnd([p[k] for p in probes if p.get(k) is not None])
                              for k in ("value_change_at_mistake", "fraction_dropping", "mean_abs_change_elsewhere",
                                        "advantage_share_on_mistake_line", "uniform_share_on_mistake_line",
                                        "advantage_before_mistake_line", "advantage_on_mistake_line",
                                        "advantage_after_mistake_line", "raw_advantage_share_on_mistake_line",
                                        "raw_advantage_before_mistake_line", "raw_advantage_on_mistake_line",
                                        "raw_advantage_after_mistake_line")}
    return out | {"_curves": curves, "_seeds": seeds}


def _delta(v: dict[int, float], d: dict[int, float], seeds: tuple[int, ...]) -> float | None:
    a, b = [v[s] for s in seeds if s in v], [d[s] for s in seeds if s in d]
    return round(statistics.fmean(a) - statistics.fmean(b), 4) if a and b else None


def _equal_at(v: dict[str, Any], d: dict[str, Any], key: str) -> dict[str, Any] | None:
    """Each arm's mean accuracy where the shorter arm ends in ``key``: learner time ``t`` (value pretraining's
    seconds counted) or ``cost``, the samples a method pays for (generated for training, for value pretraining,
    or by DAPO's dynamic sampling and dropped)."""
    if not v["_curves"] or not d["_curves"]:
        return None
    off = (lambda pre: pre) if key == "t" else (lambda pre: 0.0)  # paid samples already count pretraining's
    x = min(min(pts[-1][key] + off(pre) for pts, pre in arm["_curves"]) for arm in (v, d))
    acc = {k: statistics.fmean(_acc_at(pts, x, off(pre), key) for pts, pre in arm["_curves"])
           for k, arm in (("vapo", v), ("dapo", d))}
    return {("t_s" if key == "t" else "samples"): round(x, 1), "vapo": round(acc["vapo"], 4),
            "dapo": round(acc["dapo"], 4), "vapo_minus_dapo": round(acc["vapo"] - acc["dapo"], 4)}


def summary(root: Path, load_run: Any) -> dict[str, Any]:
    """Per cell: both arms (``_arm``), VAPO − DAPO (all seeds, seed 0, seeds 1-2 apart), per bucket, at equal
    learner time, and whether phase 2 picked it."""
    chosen = pick_phase2(root)
    picked = chosen or []
    out: dict[str, Any] = {"_threshold": THRESHOLD, "_phase2": chosen}
    for c in CELLS:
        names = arms(c)
        v, d = _arm(root, names["vapo"], load_run), _arm(root, names["dapo"], load_run)
        vb, db = v["by_bucket"], d["by_bucket"]
        out[c.name] = {
            "regime": c.regime, "label": c.label, "phase2": c.name in picked,
            "vapo": {k: x for k, x in v.items() if not k.startswith("_")},
            "dapo": {k: x for k, x in d.items() if not k.startswith("_")},
            "vapo_minus_dapo": _delta(v["_seeds"], d["_seeds"], (0, *PHASE2_SEEDS)),
            "vapo_minus_dapo_seed0": _delta(v["_seeds"], d["_seeds"], (0,)),
            "vapo_minus_dapo_confirm": _delta(v["_seeds"], d["_seeds"], PHASE2_SEEDS),
            "by_bucket_vapo_minus_dapo": {b: round(vb[b] - db[b], 4) for b in BUCKETS if b in vb and b in db},
            "equal_learner_time": _equal_at(v, d, "t"),
            "equal_paid_samples": _equal_at(v, d, "cost"),
        }
    return out
