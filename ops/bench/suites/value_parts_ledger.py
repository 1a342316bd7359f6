"""The value_parts ledger (``docs/results/value_parts_runs.jsonl``): one line per finished run, what a run
directory says of it (its evaluations on every compute axis, its seconds, commit, CPU and load, its critic's
explained variance), so that a study longer than one machine's lease goes on from any checkout. The suite
(``value_parts_suite``) decides which runs there are and where its ledger lies; this module reads and writes
lines.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from common.provenance import of_run
from ops.bench import measure
from ops.bench.reports.compute_axes import load_axis_run

CRITIC_READINGS = ("pretrain_ev", "rl_ev", "oracle_ev")  # what a run's ledger line keeps of its critic
AXES_VERSION = 2           # ledger lines since gen_tokens counts value pretraining's groups once (compute_axes)


def read(ledger: Path) -> dict[str, dict[str, Any]]:
    """The recorded runs by name (a later line of the same run replaces an earlier one); empty when there is
    no ledger yet."""
    if not ledger.exists():
        return {}
    rows = (json.loads(line) for line in ledger.read_text().splitlines() if line.strip())
    return {row["run"]: row for row in rows}


def write_row(ledger: Path, row: dict[str, Any]) -> None:
    """Put ``row`` in ``ledger`` in place of that run's line, lines sorted by run."""
    rows = read(ledger)
    rows[row["run"]] = row
    ledger.parent.mkdir(parents=True, exist_ok=True)
    tmp = ledger.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in sorted(rows.values(), key=lambda r: r["run"])))
    tmp.replace(ledger)  # a crash mid-write leaves the old ledger, never half of one


def run_row(d: Path, run: str, seconds: float) -> dict[str, Any] | None:
    """Run directory ``d``'s ledger line, or None for a run without ``summary.json`` (unfinished) or without
    evaluations beyond the base one."""
    axis_run = load_axis_run(d) if (d / "summary.json").exists() else None
    if axis_run is None or len(axis_run.points) < 2:
        return None
    made_by = of_run(d) or {}  # the run's own header: the commit and machine it ran on, its starting load
    cpu = made_by.get("cpu") or {}
    return {"run": run, "final_accuracy": axis_run.points[-1]["acc"],
            "points": [{k: round(v, 6) for k, v in p.items()} for p in axis_run.points], "seconds": round(seconds, 1),
            "commit": (made_by.get("commit") or {}).get("sha"), "dirty": (made_by.get("commit") or {}).get("dirty"),
            "cpu": cpu.get("model", "unknown"), "simd": cpu.get("torch_capability"), "cpus": cpu.get("logical_cpus"),
            "load_at_start": made_by.get("load_1m"), "load_at_end": measure.load()[0], "date": time.strftime("%Y-%m-%d"),
            "critic": critic_readings(d),
            "critic_at_eval": critic_at_evaluations(d, [int(p["step"]) for p in axis_run.points[1:]]),
            "axes_version": AXES_VERSION}


def critic_readings(d: Path) -> dict[str, float | None]:
    """Run directory ``d``'s critic (``CRITIC_READINGS``): the held-out EV value pretraining ended with (the
    best, which it keeps), and the mean over the RL steps of the critic's EV on the trained batches and, under
    ``algo.critic=oracle``, of the oracle's on the same batches. None where the run has none (DAPO)."""
    pretrain, rl, oracle = None, [], []
    for line in (d / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("kind") == "value_pretrain":
            pretrain = rec.get("best_explained_variance", pretrain)
        elif rec.get("kind") == "learner_step":
            rl += [rec["value_explained_variance"]] if "value_explained_variance" in rec else []
            oracle += [rec["oracle_explained_variance"]] if "oracle_explained_variance" in rec else []
    return {"pretrain_ev": pretrain, "rl_ev": statistics.fmean(rl) if rl else None,
            "oracle_ev": statistics.fmean(oracle) if oracle else None}


def critic_at_evaluations(d: Path, steps: list[int]) -> list[dict[str, Any]]:
    """Run directory ``d``'s critic EV and reference (oracle) EV on the RL batch of each step in ``steps`` (its
    evaluations' steps), None where that step reported none: how the critic's fit moves with training, which
    the means of ``critic_readings`` hide."""
    at: dict[int, dict[str, Any]] = {}
    for line in (d / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("kind") == "learner_step" and rec.get("step") in steps:
            at[rec["step"]] = {"rl_ev": rec.get("value_explained_variance"),
                               "oracle_ev": rec.get("oracle_explained_variance")}
    return [{"step": s, **at.get(s, {"rl_ev": None, "oracle_ev": None})} for s in steps]


def pretraining_counted_once(points: list[dict[str, float]]) -> list[dict[str, float]]:
    """The points of a ledger line recorded before ``AXES_VERSION`` 2, whose generated tokens counted value
    pretraining's ``vp`` samples twice: once at the first step's length (``gen_tokens`` at step 0) and again
    among the generated samples scaled to the trained ones' length. With ``s`` the samples axis (``vp`` +
    trained + filtered) the recorded ``gen = gen_0 + L·s`` (L: tokens per trained sample), so the right one is
    ``gen_0 + L·(s − vp)``; exact when no group was dropped stale (otherwise short by stale · vp / s samples'
    tokens). A run without value pretraining (``vp`` = 0) is unchanged."""
    vp, gen_0 = points[0]["samples"], points[0]["gen_tokens"]
    if vp <= 0:
        return points
    return [points[0]] + [{**p, "gen_tokens": gen_0 + (p["gen_tokens"] - gen_0) * (p["samples"] - vp) / p["samples"]}
                          for p in points[1:]]
