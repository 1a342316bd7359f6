"""Shared by the tests of ``ops/bench/suites`` and ``ops/bench/reports``: the experiments module, and a fake
finished run directory (config, metrics records, summary) for the suites to read."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import yaml

from ops.bench.suites import experiments
from ops.bench.suites import value_parts_suite as vp

ROOT = Path(__file__).resolve().parents[3]


def load_experiments() -> ModuleType:
    """``ops.bench.suites.experiments``, the module every suite's test reads runs and reports through."""
    return experiments


def make_run(d: Path, accs: dict[int, float], group_size: int = 8, filtered_per_step: int = 0,
             step_s: float = 10.0, eval_s: float = 3.0, base_time: float = 1000.0) -> None:
    """A finished run: base eval at ``base_time``, one step every ``step_s`` seconds (plus ``eval_s`` when it
    evaluates), 4 groups consumed per step, ``filtered_per_step`` uniform groups dropped per step."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"actors": {"group_size": group_size}, "model": {"path": "x/y"},
                                                   "value_pretrain": {"batch_groups": 2, "eval_groups": 1}}))
    recs = [{"kind": "value_pretrain", "step": 1, "explained_variance": 0.4, "time": base_time - 5},
            {"kind": "eval", "weight_version": 0, "step": 0, "time": base_time, "avg_at_k": accs[0],
             "greedy_accuracy": 0.9}]
    t = base_time
    for step in range(1, max(accs) + 1):
        evals = step in accs
        t += step_s + (eval_s if evals else 0.0)
        r = {"kind": "learner_step", "step": step, "weight_version": step, "time": t, "samples": 4 * group_size,
             "groups_consumed_total": 4 * step + 3, "stale_dropped_total": step, "filtered_total": filtered_per_step * step,
             "phase_seconds": {"fetch": 0.5, "actor_update": 9.5} | ({"eval": eval_s} if evals else {}),
             "value_explained_variance": 0.3,
             "response_length_mean": 40.0 + step, "entropy": 0.1, "staleness_mean": 0.5, "reward_mean": 0.5}
        if evals:
            r["eval"] = {"avg_at_k": accs[step], "greedy_accuracy": 0.95}
        recs.append(r)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n{cut by a cra")
    (d / "summary.json").write_text(json.dumps({"value_pretrain_explained_variance": 0.4, "wall_seconds": 99.0}))


def long_run(d: Path, accs: dict[int, float], reward: float, advantage: str = "gae") -> None:
    """A finished long-suite run: make_run plus per-bucket held-out accuracy and the late training reward."""
    make_run(d, accs)
    cfg = yaml.safe_load((d / "config.yaml").read_text()) | {"algo": {"advantage": advantage}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()[:-1]]
    for r in recs:
        if r["kind"] == "learner_step":
            r["reward_mean"] = reward
        ev = r if r["kind"] == "eval" else r.get("eval")
        if ev is not None:
            ev.update({"by_bucket": {b: {"avg_at_k": ev["avg_at_k"] + dv} for b, dv in
                                     (("short", 0.1), ("medium", 0.0), ("long", -0.1))},
                       "min_response_length": 49, "max_response_length": 400, "mean_response_length": 150.0,
                       "by_response_length": {"<=64": {"n_samples": 10, "avg_at_k": 0.9}}})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def value_parts_run(root: Path, arm: str, seed: int, accs: list[float], finished: bool = True,
                    pretrain_ev: list[float] = (), rl_ev: list[float] = (), oracle_ev: list[float] = (),
                    cpu: str = "Test CPU") -> None:
    """A value_parts run directory of ``arm``/``seed`` under ``root`` whose evaluations read ``accs``, run on
    ``cpu``; without summary.json unless ``finished``. Its critic: one value-pretraining record per ``pretrain_ev`` (the best
    so far), and the RL steps' ``rl_ev`` / ``oracle_ev`` (step k's, where given)."""
    d = root / f"{vp.name(arm)}-s{seed}"
    d.mkdir(parents=True)
    if finished:
        (d / "summary.json").write_text("{}")
    (d / "config.yaml").write_text(yaml.safe_dump({"actors": {"group_size": 2}}))
    recs = [{"kind": "header", "commit": {"sha": "c0ffee", "dirty": False}, "cpu": {"model": cpu, "logical_cpus": 2},
             "load_1m": 0.5},
            {"kind": "eval", "step": 0, "time": 0.0, "avg_at_k": accs[0]}]
    recs[1:1] = [{"kind": "value_pretrain", "step": k, "time": 0.0, "best_explained_variance": ev}
                 for k, ev in enumerate(pretrain_ev, start=1)]
    recs += [{"kind": "learner_step", "step": k, "time": 10.0 * k, "samples": 256, "response_tokens": 2560,
              "policy_forward_tokens": 100, "policy_backward_tokens": 100, "eval": {"avg_at_k": a},
              **({"value_explained_variance": rl_ev[k - 1]} if k <= len(rl_ev) else {}),
              **({"oracle_explained_variance": oracle_ev[k - 1]} if k <= len(oracle_ev) else {})}
             for k, a in enumerate(accs[1:], start=1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
