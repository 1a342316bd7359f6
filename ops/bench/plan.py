"""Benchmark: the learner's micro-batch plan (``common.microplan``) on paper-scale rows: its lockstep cost over
the ideal, filler and padding shares, micro-batches a rank a pass.

    .venv/bin/python -m ops.bench.plan [--quick] [--run RUN_DIR] [--config ops/configs/paper.yaml] [key=value ...]

Prints one JSON line. Deterministic (no timing): the rows are drawn with a fixed seed and the plan is a pure
function of them, so it is one round, judged pass/fail directly (``--quick``: a smaller step, no verdict).

The step: ``learner.batch_groups x actors.group_size`` rows of the config (paper.yaml: 512 x 16 = 8,192), cut
into ``learner.mini_batches`` (16), dealt to the ``placement.learner_gpus`` ranks (48); prompts log-normal
around ``placement.est_prompt_tokens`` (256), responses log-normal (spread ``microplan.SIGMA``) with capped mean
1,500 / 5,000 / 8,000 tokens, capped at ``actors.max_new_tokens`` (20,480); the line prints each draw's
parameters. Rows at the cap are truncated: under ``algo.truncated=mask`` no loss reads them and the plan
leaves them out. The training passes are cut within ``learner.micro_batch_tokens``, the no-grad passes within
``learner.no_grad_micro_batch_tokens`` (0 = twice that), packed or padded as ``learner.packing`` says; beside
them, the padded layout with ``learner.micro_batch_size`` rows at most (``padded``).

Lockstep cost: under ZeRO-3 the ranks run micro-batch j together, so a pass costs the sum over j of the
slowest rank's j-th micro-batch, in forward FLOPs of the model (``Workload.of_model``: linear + causal-attention
quadratic in a row's length); the ideal is the rows' total workload over the ranks. ``plan_over_ideal_<mean>``
is the step's: the passes of ``common.balance.passes`` weighted by their forward-equivalents. Goals:
``plan_over_ideal_5000`` <= 1.10 and ``plan_over_ideal_1500`` <= 1.20 (8,000: reported, no goal).

``--run RUN_DIR``: the same plan on rows drawn like a run's: the mean response length, truncated fraction and
prompt length of its last ``--run-steps`` ``learner_step`` records in ``metrics.jsonl`` (the spread fitted to
the truncated fraction: ``microplan.sigma_for``), capped at the run's ``actors.max_new_tokens``; the step's
geometry (rows, ranks, budgets) stays the config's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from common import balance
from common.config import Config, load_config
from common.gpu_memory import read_model_config
from common.gpu_spec import parse_gpus
from common.microplan import Rows, Workload, lockstep, minibatches, plan_step, sigma_for, synthetic_lengths
from ops.bench.measure import Run, combined_verdict, summarise

ROOT = Path(__file__).resolve().parents[2]
MEANS = (1500, 5000, 8000)
GOALS = {5000: 1.10, 1500: 1.20}
SHAPE = ROOT / "ops" / "configs" / "shapes" / "qwen2.5-32b"
QUICK_MINIBATCHES = 2  # --quick: 2 of the config's mini-batches (same rows per mini-batch and ranks)


def world_of(cfg: Config) -> int:
    return max(len(parse_gpus(cfg.placement.learner_gpus, "placement.learner_gpus")), 1)


def measure(cfg: Config, rows: Rows, work: Workload, world: int, n_minibatches: int, layers: int) -> dict[str, Any]:
    """Every pass kind's plan on ``rows``: lockstep over ideal, slots a rank, filler and padding shares; the
    step's over ideal (``layers``: for the share of a forward that activation checkpointing recomputes)."""
    lc = cfg.learner
    lengths = rows.lengths
    skip = rows.truncated if cfg.algo.truncated == "mask" else np.zeros(len(lengths), dtype=bool)
    mbs = [[i for i in mb if not skip[i]] for mb in minibatches(len(lengths), n_minibatches)]
    budget = balance.budgets(cfg, max(lengths))
    kinds = {"train": (budget["train"], lc.packing), "no_grad": (budget["no_grad"], lc.packing),
             "padded": (budget["train"], False)}
    out: dict[str, Any] = {}
    for kind, (b, packed) in kinds.items():
        plan = plan_step(lengths, mbs, world, b, work, packed, lc.micro_batch_size)
        s = lockstep(plan, lengths, work, packed)
        out[kind] = {"budget_tokens": b, "packed": packed, "over_ideal": round(s["over_ideal"], 4),
                     "slots_per_rank": int(s["slots"]), "slots_per_minibatch": round(s["slots"] / max(len(mbs), 1), 2),
                     "filler_share": round(s["filler_share"], 4), "padding_share": round(s["padding_share"], 4),
                     "lockstep": s["lockstep"], "ideal": s["ideal"]}
    weights = {"train": 0.0, "no_grad": 0.0}
    for p in balance.passes(cfg, layers):
        weights[p.plan] += p.forwards
    num = sum(w * out[k]["lockstep"] for k, w in weights.items())
    den = sum(w * out[k]["ideal"] for k, w in weights.items())
    out["step_over_ideal"] = round(num / den, 4) if den else 1.0
    for kind in kinds:
        del out[kind]["lockstep"], out[kind]["ideal"]
    out["skipped_rows"] = int(skip.sum())
    return out


def run_lengths(run_dir: Path, steps: int, cap_default: int) -> dict[str, Any]:
    """Mean response length, truncated fraction, prompt length of a run's last ``steps`` learner steps, its cap."""
    recs = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("kind") == "learner_step" and "response_length_mean" in r:
            recs.append(r)
    if not recs:
        raise SystemExit(f"ops.bench.plan: no learner_step records in {run_dir / 'metrics.jsonl'}")
    recs = recs[-steps:]
    mean = float(np.mean([r["response_length_mean"] for r in recs]))
    trunc = float(np.mean([r.get("truncated_fraction", 0.0) for r in recs]))
    prompt = float(np.mean([max(r["tokens"] / max(r["samples"], 1) - r["response_length_mean"], 1.0)
                            for r in recs if r.get("tokens") and r.get("samples")] or [256.0]))
    cfg_file = run_dir / "config.yaml"
    run_cfg = yaml.safe_load(cfg_file.read_text()) if cfg_file.exists() else {}
    cap = int(((run_cfg or {}).get("actors") or {}).get("max_new_tokens", cap_default))
    return {"steps_read": len(recs), "response_length_mean": round(mean, 1), "truncated_fraction": round(trunc, 4),
            "prompt_tokens": round(prompt, 1), "cap": cap}


def judged(mean: int, value: float, quick: bool) -> dict[str, Any]:
    """The shared judging fields of one mean length's figure (one deterministic round; quick: no verdict)."""
    return summarise([value], GOALS[mean], higher_is_better=False, name=f"plan_over_ideal_{mean}",
                     min_rounds=2 if quick else 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides of --config")
    ap.add_argument("--config", default=str(ROOT / "ops" / "configs" / "paper.yaml"), help="the step's geometry")
    ap.add_argument("--model", default="", help="a directory with the model's config.json (default: model.path, "
                    f"else {SHAPE.relative_to(ROOT)})")
    ap.add_argument("--run", type=Path, default=None, help="also plan rows drawn like this run's metrics.jsonl")
    ap.add_argument("--run-steps", type=int, default=20, help="--run: the last this many learner steps")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_MINIBATCHES} mini-batches: a check that it runs")
    args = ap.parse_args(argv)
    run = Run(quick=args.quick)
    cfg = load_config(args.config, args.overrides)
    hf = read_model_config(args.model or cfg.model.path) or read_model_config(SHAPE)
    assert hf is not None, f"no config.json under {args.model or cfg.model.path} nor {SHAPE}"
    work = Workload.of_model(hf)
    layers = int(hf.get("text_config", hf)["num_hidden_layers"])
    world, n_mb = world_of(cfg), cfg.learner.mini_batches
    n_rows = cfg.learner.batch_groups * cfg.actors.group_size
    if args.quick:
        n_rows, n_mb = n_rows * QUICK_MINIBATCHES // n_mb, QUICK_MINIBATCHES
    cap, prompt = cfg.actors.max_new_tokens, float(cfg.placement.est_prompt_tokens)
    line: dict[str, Any] = {"bench": "plan", "deterministic": True, "rounds": 1}
    means, verdicts = [], []
    for mean in MEANS:
        rows = synthetic_lengths(n_rows, mean, cap, prompt=prompt)
        m = measure(cfg, rows, work, world, n_mb, layers)
        line[f"plan_over_ideal_{mean}"] = m["step_over_ideal"]
        row = {"mean": mean, "distribution": rows.params(), **m}
        if mean in GOALS:
            row.update(judged(mean, m["step_over_ideal"], args.quick))
            verdicts.append(row["verdict"])
        means.append(row)
    for key in ("filler_share", "padding_share", "slots_per_rank"):
        for kind in ("train", "no_grad", "padded"):
            line[f"{key}_{kind}"] = {r["mean"]: r[kind][key] for r in means}
    if args.run is not None:
        rl = run_lengths(args.run, args.run_steps, cap)
        sigma = sigma_for(rl["response_length_mean"], rl["truncated_fraction"], rl["cap"])
        rows = synthetic_lengths(n_rows, rl["response_length_mean"], rl["cap"], sigma=sigma, prompt=rl["prompt_tokens"])
        m = measure(cfg, rows, work, world, n_mb, layers)
        line["run"] = {"dir": str(args.run), **rl, "distribution": rows.params(), "plan_over_ideal": m["step_over_ideal"],
                       **m}
    line.update({"verdict": "unclear" if args.quick else combined_verdict(verdicts),
                 "goal": "plan_over_ideal_5000 <= 1.1, plan_over_ideal_1500 <= 1.2",
                 "geometry": {"rows": n_rows, "mini_batches": n_mb, "ranks": world, "cap": cap, "prompt_tokens": prompt,
                              "truncated": cfg.algo.truncated, "packing": cfg.learner.packing,
                              "micro_batch_size": cfg.learner.micro_batch_size,
                              "workload": {"linear": work.linear, "quadratic": work.quadratic}},
                 "means": means, **run.common_fields()})
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
