"""Held-out accuracy against each compute axis, for any set of runs: comparisons at equal total compute.

    .venv/bin/python -m ops.bench.reports.compute_axes RUN_DIR [RUN_DIR ...] [--target 0.7] [--budget-axis AXIS=X ...]
        [--plots DIR] [--json]

Every evaluation of a run is placed on five cumulative axes, read from its ``metrics.jsonl``:

- ``samples``: samples trained on (value pretraining's batches and held-out groups included, and the groups
  DAPO's dynamic sampling generated and dropped): the paid-samples axis of the earlier studies;
- ``gen_tokens``: response tokens generated. The learner sees the tokens of what it trains on
  (``response_tokens``); groups generated and never trained on (filtered, stale) are counted at the mean
  length of the trained ones (``groups_consumed_total`` and the drop totals give their number), and value
  pretraining's at the first RL step's mean length (they are in ``groups_consumed_total`` too, since value
  pretraining draws from the same buffer: taken out there, so they count once);
- ``learner_passes``: learner token passes, forward + 2 × backward (a backward costs about two forwards),
  policy and critic together, value pretraining included (``learner.compute``);
- ``critic_passes``: the critic's share of ``learner_passes`` (0 for DAPO/GRPO);
- ``wall_s``: seconds from the learner's first record, evaluations taken out (their cadence is not the method).

For each run and axis it prints where accuracy first reaches ``--target``, linearly interpolated, with the
bracket: the evaluations on either side ("x_lo..x_hi"), since a crossing read between two evaluations is
only known to lie between them. ``--budget-axis AXIS=X`` adds the accuracy at that budget (interpolated,
bracketed the same way); without it the budget is the largest every run reached on that axis. Runs are
grouped into arms by name with a trailing seed suffix (``-s0``, ``_seed1``) removed: mean ± sd over seeds.
``--plots DIR`` writes one PNG per axis; ``--json`` prints the per-run points and readings instead of tables.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ops.bench.reports.run_records import mean_std
from ops.report import read_records

AXES = ("samples", "gen_tokens", "learner_passes", "critic_passes", "wall_s")
_SEED = re.compile(r"[-_](?:s|seed)\d+$")


@dataclass
class AxisRun:
    name: str
    points: list[dict[str, float]] = field(default_factory=list)  # per evaluation: step, acc and every axis

    @property
    def arm(self) -> str:
        return _SEED.sub("", self.name)


def _passes(r: dict[str, Any], model: str) -> float:
    return float(r.get(f"{model}_forward_tokens", 0)) + 2.0 * float(r.get(f"{model}_backward_tokens", 0))


def load_axis_run(d: Path) -> AxisRun | None:
    """The run in ``d`` with each evaluation on every axis (None without a base evaluation)."""
    recs = read_records(d / "metrics.jsonl")
    cfg = yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").exists() else {}
    g = int((cfg.get("actors") or {}).get("group_size", 1))
    vp = cfg.get("value_pretrain") or {}
    evals = {int(r.get("step", 0)): r for r in recs if r.get("kind") == "eval"}
    steps = [r for r in recs if r.get("kind") == "learner_step"]
    evals.update({int(r["step"]): r["eval"] for r in steps if isinstance(r.get("eval"), dict)})
    if 0 not in evals:
        return None
    vp_recs = [r for r in recs if r.get("kind") == "value_pretrain"]
    t0 = min((r["time"] for r in recs if "time" in r), default=0.0)
    first_len = float(steps[0].get("response_length_mean", 0.0)) if steps else 0.0
    vp_samples = (len(vp_recs) * int(vp.get("batch_groups", 0)) + int(vp.get("eval_groups", 0))) * g if vp_recs else 0
    critic = sum(_passes(r, "critic") for r in vp_recs)
    base_t = max((r["time"] for r in vp_recs), default=t0) - t0
    axes = {"samples": float(vp_samples), "gen_tokens": vp_samples * first_len, "learner_passes": critic,
            "critic_passes": critic, "wall_s": base_t}
    run = AxisRun(d.name, [{"step": 0, "acc": float(evals[0]["avg_at_k"]), **axes}])
    trained = resp = eval_s = 0.0
    policy = 0.0
    for r in steps:
        trained += float(r.get("samples", 0))
        resp += float(r.get("response_tokens", r.get("response_length_mean", 0.0) * r.get("samples", 0)))
        policy += _passes(r, "policy")
        critic += _passes(r, "critic")
        eval_s += float((r.get("phase_seconds") or {}).get("eval", 0.0))
        filtered = g * float(r.get("filtered_total", 0))
        gen = (g * (r["groups_consumed_total"] + r.get("stale_dropped_total", 0) + r.get("filtered_total", 0))
               - vp_samples if "groups_consumed_total" in r else trained)
        step = int(r["step"])
        if step in evals:
            run.points.append({"step": step, "acc": float(evals[step]["avg_at_k"]),
                               "samples": vp_samples + trained + filtered,
                               "gen_tokens": vp_samples * first_len + resp * gen / max(trained, 1.0),
                               "learner_passes": policy + critic, "critic_passes": critic,
                               "wall_s": r["time"] - t0 - eval_s})
    return run


def crossing(points: list[dict[str, float]], axis: str, target: float) -> dict[str, float] | None:
    """Where accuracy first reaches ``target`` on ``axis``: {x (interpolated), x_lo, x_hi, acc_lo, acc_hi}
    with the evaluations either side (both the first point when it already starts there); None if never."""
    prev = None
    for p in points:
        if p["acc"] >= target:
            lo = prev or p
            f = (target - lo["acc"]) / (p["acc"] - lo["acc"]) if p["acc"] > lo["acc"] else 1.0
            return {"x": lo[axis] + f * (p[axis] - lo[axis]), "x_lo": lo[axis], "x_hi": p[axis],
                    "acc_lo": lo["acc"], "acc_hi": p["acc"]}
        prev = p
    return None


def accuracy_at(points: list[dict[str, float]], axis: str, budget: float) -> dict[str, float] | None:
    """Accuracy at ``budget`` on ``axis``, interpolated between the evaluations either side (bracket
    included); None when the run did not reach the budget."""
    for lo, hi in zip(points, points[1:], strict=False):
        if lo[axis] <= budget <= hi[axis]:
            f = (budget - lo[axis]) / (hi[axis] - lo[axis]) if hi[axis] > lo[axis] else 1.0
            return {"acc": lo["acc"] + f * (hi["acc"] - lo["acc"]), "x_lo": lo[axis], "x_hi": hi[axis],
                    "acc_lo": lo["acc"], "acc_hi": hi["acc"]}
    if points and points[-1][axis] == budget:
        p = points[-1]
        return {"acc": p["acc"], "x_lo": p[axis], "x_hi": p[axis], "acc_lo": p["acc"], "acc_hi": p["acc"]}
    return None


def readings(runs: list[AxisRun], target: float, budgets: dict[str, float]) -> dict[str, Any]:
    """Per run and axis: the crossing and the accuracy at the budget (given, or the largest all runs reached)."""
    out: dict[str, Any] = {"target": target, "budgets": {}, "runs": {}}
    for axis in AXES:
        budget = budgets.get(axis, min((r.points[-1][axis] for r in runs), default=0.0))
        out["budgets"][axis] = budget
        for r in runs:
            row = out["runs"].setdefault(r.name, {"arm": r.arm, "points": r.points})
            row[axis] = {"crossing": crossing(r.points, axis, target), "at_budget": accuracy_at(r.points, axis, budget)}
    return out


def _ms(xs: list[float]) -> str:
    if not xs:
        return "—"
    m, sd = mean_std(xs)
    return f"{_num(m)} ± {_num(sd)} (n={len(xs)})"


def _num(x: float) -> str:
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-2):
        return f"{x:.3g}"
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.0f}"


def tables(res: dict[str, Any]) -> str:
    """Markdown: per run the crossing with its bracket and the accuracy at the budget; per arm mean ± sd."""
    lines = [f"Target {res['target']}; budgets: " + ", ".join(f"{a} {_num(b)}" for a, b in res["budgets"].items()), ""]
    for axis in AXES:
        lines += [f"### {axis}", "", "| run | crossing (bracket) | acc at budget (bracket) |", "|---|---|---|"]
        arms: dict[str, tuple[list[float], list[float]]] = {}
        for name, row in res["runs"].items():
            c, a = row[axis]["crossing"], row[axis]["at_budget"]
            cs = f"{_num(c['x'])} ({_num(c['x_lo'])}..{_num(c['x_hi'])})" if c else "not reached"
            as_ = f"{a['acc']:.3f} ({a['acc_lo']:.3f}@{_num(a['x_lo'])}..{a['acc_hi']:.3f}@{_num(a['x_hi'])})" if a else "—"
            lines.append(f"| {name} | {cs} | {as_} |")
            xs, accs = arms.setdefault(row["arm"], ([], []))
            if c:
                xs.append(c["x"])
            if a:
                accs.append(a["acc"])
        lines += ["", "| arm | crossing | acc at budget |", "|---|---|---|"]
        lines += [f"| {arm} | {_ms(xs)} | {_ms(accs)} |" for arm, (xs, accs) in arms.items()]
        lines.append("")
    return "\n".join(lines)


def plot(runs: list[AxisRun], out_dir: Path, target: float) -> list[Path]:
    """One PNG per axis: every run's accuracy curve, coloured by arm, the target dashed."""
    import matplotlib  # noqa: PLC0415 - plots only; the Agg backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - plots only; after the backend is chosen

    out_dir.mkdir(parents=True, exist_ok=True)
    arms = sorted({r.arm for r in runs})
    colours = {a: f"C{i % 10}" for i, a in enumerate(arms)}
    paths = []
    for axis in AXES:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        for r in runs:
            ax.plot([p[axis] for p in r.points], [p["acc"] for p in r.points], marker="o", ms=3,
                    color=colours[r.arm], label=r.arm if r is next(x for x in runs if x.arm == r.arm) else None)
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_xlabel(axis)
        ax.set_ylabel("held-out avg@k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"acc_vs_{axis}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops.bench.reports.compute_axes", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with metrics.jsonl, config.yaml)")
    ap.add_argument("--target", type=float, default=0.7, help="held-out accuracy whose crossing is read (default 0.7)")
    ap.add_argument("--budget-axis", action="append", default=[], metavar="AXIS=X",
                    help=f"accuracy at this budget on AXIS ({', '.join(AXES)}); default: the largest all runs reached")
    ap.add_argument("--plots", type=Path, help="write acc_vs_<axis>.png here")
    ap.add_argument("--json", action="store_true", help="print the points and readings as JSON")
    args = ap.parse_args(argv)
    budgets = {}
    for item in args.budget_axis:
        axis, _, x = item.partition("=")
        if axis not in AXES or not x:
            ap.error(f"--budget-axis {item!r}: want AXIS=X with AXIS one of {', '.join(AXES)}")
        budgets[axis] = float(x)
    runs = [r for r in (load_axis_run(d) for d in args.runs) if r is not None]
    skipped = [str(d) for d in args.runs if d.name not in {r.name for r in runs}]
    if skipped:
        print(f"compute_axes: no base evaluation in {', '.join(skipped)}: left out", file=sys.stderr)
    if not runs:
        return 2
    res = readings(runs, args.target, budgets)
    print(json.dumps(res, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x) if args.json
          else tables(res))
    if args.plots:
        for p in plot(runs, args.plots, args.target):
            print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
