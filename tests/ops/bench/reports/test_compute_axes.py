"""ops.bench.reports.compute_axes on hand-made run records: each evaluation's place on every axis, the crossing with
its bracket, the accuracy at a budget, arms over seeds, and the CLI's tables and plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ops.bench.reports.compute_axes import accuracy_at, crossing, load_axis_run, readings, tables

ROOT = Path(__file__).resolve().parents[4]


def _run(root: Path, name: str, accs: list[float], *, critic: bool, filtered: int = 0) -> Path:
    """A run of G = 2 with 2 value-pretraining steps (batch_groups 3, eval_groups 1) when ``critic``, then
    learner steps of 4 samples, 40 response tokens and 100 tokens per pass, one evaluation per step."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"actors": {"group_size": 2},
                                                   "value_pretrain": {"batch_groups": 3, "eval_groups": 1}}))
    recs: list[dict] = [{"kind": "header", "time": 1000.0}]
    if critic:
        recs += [{"kind": "value_pretrain", "step": k, "time": 1000.0 + 5 * k, "critic_forward_tokens": 30,
                  "critic_backward_tokens": 20} for k in (1, 2)]
    recs.append({"kind": "eval", "step": 0, "time": 1011.0, "avg_at_k": accs[0]})
    for step, acc in enumerate(accs[1:], start=1):
        recs.append({"kind": "learner_step", "step": step, "time": 1010.0 + 10 * step, "samples": 4,
                     # value pretraining's groups come from the same buffer: the learner counts them consumed
                     "response_tokens": 40, "response_length_mean": 10.0,
                     "groups_consumed_total": (7 if critic else 0) + 2 * step,
                     "filtered_total": filtered * step, "stale_dropped_total": 0,
                     "phase_seconds": {"eval": 1.0}, "policy_forward_tokens": 100, "policy_backward_tokens": 100,
                     "critic_forward_tokens": 200 if critic else 0, "critic_backward_tokens": 100 if critic else 0,
                     "eval": {"avg_at_k": acc}})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_every_axis_by_hand(tmp_path: Path) -> None:
    """VAPO-like run: pretraining paid (2·3 + 1)·2 = 14 samples, at the first step's 10 tokens each = 140
    generated tokens, and 2·(30 + 2·20) = 140 critic token passes (its 7 groups, in the learner's consumed
    total, are counted there once, not again at the trained samples' length). Each step adds 4 samples, 40 tokens,
    policy 100 + 2·100 = 300 and critic 200 + 2·100 = 400 passes, and 10 s of which 1 s is evaluation.
    DAPO-like run with one filtered group per step: 2 more paid samples per step and generation scaled by
    (2 consumed + 1 filtered) groups · 2 / 4 trained = 1.5."""
    vapo = load_axis_run(_run(tmp_path, "vapo-s0", [0.4, 0.5, 0.8], critic=True))
    assert vapo is not None and [p["step"] for p in vapo.points] == [0, 1, 2]
    p0, p2 = vapo.points[0], vapo.points[2]
    assert (p0["samples"], p0["gen_tokens"], p0["learner_passes"], p0["critic_passes"], p0["wall_s"]) == (
        14, 140, 140, 140, 10.0)
    assert (p2["samples"], p2["gen_tokens"], p2["learner_passes"], p2["critic_passes"], p2["wall_s"]) == (
        22, 220, 140 + 2 * 700, 140 + 2 * 400, 28.0)
    dapo = load_axis_run(_run(tmp_path, "dapo-s0", [0.4, 0.6, 0.7], critic=False, filtered=1))
    assert dapo is not None
    q2 = dapo.points[2]
    assert (q2["samples"], q2["gen_tokens"], q2["learner_passes"], q2["critic_passes"]) == (8 + 4, 80 * 1.5, 600, 0)


def test_crossing_and_budget_come_with_their_brackets() -> None:
    pts = [{"acc": 0.4, "x": 0.0}, {"acc": 0.6, "x": 10.0}, {"acc": 0.8, "x": 30.0}]
    c = crossing(pts, "x", 0.7)
    assert c == {"x": pytest.approx(20.0), "x_lo": 10.0, "x_hi": 30.0, "acc_lo": 0.6, "acc_hi": 0.8}
    assert crossing(pts, "x", 0.9) is None
    assert crossing(pts, "x", 0.3)["x"] == 0.0  # already there at the start
    a = accuracy_at(pts, "x", 15.0)
    assert a == {"acc": pytest.approx(0.65), "x_lo": 10.0, "x_hi": 30.0, "acc_lo": 0.6, "acc_hi": 0.8}
    assert accuracy_at(pts, "x", 31.0) is None
    assert accuracy_at(pts, "x", 30.0)["acc"] == 0.8


def test_arms_group_seeds_and_the_cli_writes_tables_and_plots(tmp_path: Path) -> None:
    dirs = [_run(tmp_path, "vapo-s0", [0.4, 0.5, 0.8], critic=True), _run(tmp_path, "vapo-s1", [0.4, 0.7, 0.8], critic=True),
            _run(tmp_path, "dapo_seed0", [0.4, 0.6, 0.7], critic=False)]
    runs = [load_axis_run(d) for d in dirs]
    res = readings([r for r in runs if r], 0.7, {"samples": 18.0})
    assert res["budgets"]["samples"] == 18.0 and res["budgets"]["wall_s"] == 28.0
    assert {row["arm"] for row in res["runs"].values()} == {"vapo", "dapo"}
    # vapo-s1 reaches 0.7 at its first step: on samples between 14 (base) and 18.
    assert res["runs"]["vapo-s1"]["samples"]["crossing"]["x"] == pytest.approx(18.0)
    assert res["runs"]["vapo-s0"]["samples"]["at_budget"]["acc"] == pytest.approx(0.5)
    text = tables(res)
    assert "| vapo | " in text and "(n=2)" in text and "### learner_passes" in text
    done = subprocess.run([sys.executable, "-m", "ops.bench.reports.compute_axes", *map(str, dirs), "--plots",
                           str(tmp_path / "plots"), "--budget-axis", "samples=18"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "### wall_s" in done.stdout
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(
        f"acc_vs_{a}.png" for a in ("samples", "gen_tokens", "learner_passes", "critic_passes", "wall_s"))
    bad = subprocess.run([sys.executable, "-m", "ops.bench.reports.compute_axes", str(dirs[0]), "--budget-axis", "flops=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "AXIS=X" in bad.stderr
