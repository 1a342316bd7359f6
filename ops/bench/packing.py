"""Benchmark: packed vs padded learner micro-batches, real tokens/s of a full VAPO step on one CPU rank.

    .venv/bin/python -m ops.bench.packing [--quick] [--rounds 5] [--min-round-s 20] [--budget 4096] [key=value ...]

Prints one JSON line. Two ``learner.train.Learner``s (one CPU rank, ZeRO-0, fp32, critic + policy, the default
algorithm) on one random Qwen2 made on the fly (hidden 128, 3 layers, the char tokenizer's vocabulary) train on the
same synthetic groups: the **subject** packs each micro-batch's rows into one token stream (``learner.packing=true``,
bounded by ``learner.micro_batch_tokens`` alone); the **baseline** is today's padded plan (``learner.packing=false``,
rows right-padded to the longest, at most the paper's ``learner.micro_batch_size=4`` rows, the same token budget
counting rows x the longest). Response lengths are log-normal with a long tail (``common.microplan.synthetic_lengths``:
mean ``--mean`` after capping at ``--cap``, spread ``--sigma``; prompts log-normal around ``--prompt``, one per group),
a scaled-down version of the paper's long chains of thought; the JSON line gives the parameters and what the draw gave.

Rounds: each round draws a fresh batch; the two learner sides take one step each in turn (padded first in even
rounds, packed first in odd ones) until each has run ``--min-round-s`` on the round's batch, and a matmul ceiling
is timed after them. Steps alternate rather than each side running its whole share in one block: on a machine
shared with other work the load changes within seconds, and one side's block of ~20 s could fall in a busy spell
and the other's in a quiet one (per-round ratios of 0.96-2.0 in one run that way). Judged: ``packed_over_padded`` = packed real tokens/s over padded real
tokens/s per round (real: the rows' prompt + response tokens, never padding), **goal >= 1.15**: median, range,
interquartile range, verdict. Beside it, per side, "CPU MFU": model FLOPs of the real tokens
(``learner.compute.step_model_flops``: no padding, no recompute) per second over the round's fp32 matmul ceiling at
the model's width (``common.device_peak.measure_matmul_tflops``, timed afresh each round, ``--ceiling-s``), and per
step the model calls (forward passes of policy and critic, no-grad and training), the tokens they ran and the padding
share among them, and the phase seconds.

One thread by default (``--threads``): on a 2-core machine shared with other processes, a 2-thread rank's 32-row
step took 2-23 s from one round to the next (OpenMP's threads wait for each other at every op while another process
holds a core: elementwise ops read 2 ms instead of 0.1), which no interleaving averages out; one thread read 3-4 s. The
budget (4,096 tokens, ~14x the mean row) puts the padded layout's row cap in play, as paper.yaml's 24,576 does at
1.5k-token responses; ``--budget`` changes it for both sides.

``--quick``: 2 small rounds on a smaller model (a check that it runs; no verdict).
Deviation: the learner's own ``mfu`` (against a ceiling measured once at its start) is reported beside, not judged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from common.config import load_config
from common.device_peak import measure_matmul_tflops
from common.microplan import SIGMA, Rows, synthetic_lengths
from common.modeling import build_char_tokenizer, build_tiny_qwen2, save_hf
from common.protocol import Sample, SampleGroup
from learner.train import Learner
from ops.bench.measure import MIN_ROUNDS, Run, Timed, summarise

GOAL = 1.15  # packed real tokens/s over padded: no row cap, no padding, fewer calls
PADDED_ROWS = 4  # the paper's micro-batch rows (the padded baseline's row cap)
DEFAULTS = {"groups": 16, "group_size": 4, "mean": 256, "cap": 1024, "prompt": 64, "budget": 4096,
            "rounds": MIN_ROUNDS, "min_round_s": 20.0, "ceiling_s": 1.0, "hidden": 128, "layers": 3}
QUICK = {"groups": 2, "group_size": 4, "mean": 48, "cap": 128, "prompt": 16, "budget": 512,
         "rounds": 2, "min_round_s": 0.0, "ceiling_s": 0.1, "hidden": 64, "layers": 2}
SIDES = ("padded", "packed")


def make_model(out: Path, hidden: int, layers: int, positions: int) -> tuple[Path, dict[str, int]]:
    """A random tiny Qwen2 (fp32, tied embeddings) with the char tokenizer in ``out``; its shape."""
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(len(tok), hidden_size=hidden, num_layers=layers, intermediate_size=3 * hidden,
                             max_position_embeddings=positions)
    shape = {"vocab": len(tok), "hidden": hidden, "layers": layers, "params": sum(p.numel() for p in model.parameters())}
    return save_hf(model, tok, out), shape


def make_groups(rows: Rows, group_size: int, vocab: int, cap: int, seed: int) -> list[SampleGroup]:
    """Groups of ``group_size`` consecutive rows of ``rows``: the group's prompt is its first row's length, each
    response its own; random token ids over [3, vocab), reward 0/1, a response at ``cap`` marked truncated."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(len(rows.responses) // group_size):
        prompt = rng.integers(3, vocab, size=int(rows.prompts[g * group_size])).astype(np.int32)
        samples = []
        for i in range(g * group_size, (g + 1) * group_size):
            n = int(rows.responses[i])
            samples.append(Sample(prompt_ids=prompt, output_ids=rng.integers(3, vocab, size=n).astype(np.int32),
                                  output_logprobs=(-rng.random(n) * 3.0 - 0.05).astype(np.float32),
                                  reward=float(rng.random() < 0.5), finish_reason="length" if n >= cap else "stop",
                                  weight_version=0, response_length=n))
        groups.append(SampleGroup(group_id=f"g{seed}-{g}", prompt_id=f"p{seed}-{g}", task="synthetic", actor_id=0,
                                  samples=samples, created_at=0.0))
    return groups


class Calls:
    """Model calls of one learner (policy and critic root forwards) and the tokens they ran, real and padding."""

    def __init__(self, learner: Learner) -> None:
        self.calls = self.run = self.real = 0
        for engine in (learner.policy, learner.critic):
            engine.module.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self.calls += 1
        self.run += int(ids.numel())
        # Packed calls carry no mask tensor (a dict, or None): every token of the stream is a row's.
        self.real += int(mask.sum()) if isinstance(mask, torch.Tensor) else int(ids.numel())

    def snapshot(self) -> tuple[int, int, int]:
        return self.calls, self.run, self.real


class Side:
    """One layout's learner and what its measured steps did."""

    def __init__(self, name: str, learner: Learner) -> None:
        self.name, self.learner, self.counter = name, learner, Calls(learner)
        self.steps: list[dict[str, Any]] = []
        self.rounds: list[dict[str, Any]] = []

    def step(self, groups: list[SampleGroup]) -> dict[str, Any]:
        c0, t0, p0 = self.counter.snapshot(), time.perf_counter(), time.process_time()
        st = self.learner.step(groups)
        wall, cpu = time.perf_counter() - t0, time.process_time() - p0
        calls, run, real = (a - b for a, b in zip(self.counter.snapshot(), c0, strict=True))
        return {"wall": wall, "cpu": cpu, "tokens": st["tokens"], "model_flops": st.get("model_flops", 0.0), "calls": calls,
                "tokens_run": run, "real_run": real, "mfu_learner": st.get("mfu"), "phases": st["phase_seconds"]}

    def record(self, recs: list[dict[str, Any]]) -> Timed:
        """Keep one round's steps; their real tokens over their seconds."""
        self.steps.extend(recs)
        done = Timed(sum(r["tokens"] for r in recs), sum(r["wall"] for r in recs))
        self.rounds.append({"timed": done, "flops": sum(r["model_flops"] for r in recs)})
        return done


def paired_round(sides: list[Side], groups: list[SampleGroup], min_s: float) -> dict[str, Timed]:
    """The sides step on ``groups`` one step each in turn, in the order given, until every side ran ``min_s``
    (at least one step each): a change in the machine's load lands on both alike."""
    recs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}
    while any(not recs[s.name] or sum(r["wall"] for r in recs[s.name]) < min_s for s in sides):
        for side in sides:
            recs[side.name].append(side.step(groups))
    return {side.name: side.record(recs[side.name]) for side in sides}


def ceiling(hidden: int, seconds: float) -> Timed:
    """The fp32 matmul ceiling at the model's width, measured afresh (work: TFLOP, so rate = TFLOP/s)."""
    t0 = time.perf_counter()
    tflops = measure_matmul_tflops.__wrapped__(hidden, "fp32", seconds)  # uncached: a new figure each round
    return Timed(tflops * (time.perf_counter() - t0), time.perf_counter() - t0)


def build_sides(model: Path, args: argparse.Namespace) -> dict[str, Side]:
    common = [f"model.path={model}", f"learner.batch_groups={args.groups}", f"actors.group_size={args.group_size}",
              f"actors.max_new_tokens={args.cap}", f"learner.micro_batch_tokens={args.budget}",
              "learner.zero_stage=0", "learner.precision=fp32", "model.dtype=float32", "algo.advantage=gae",
              "metrics.prometheus=false", *args.overrides]
    return {"packed": Side("packed", Learner(load_config(None, [*common, "learner.packing=true"]), None)),
            "padded": Side("padded", Learner(load_config(None, [*common, "learner.packing=false",
                                                                f"learner.micro_batch_size={PADDED_ROWS}"]), None))}


def side_figures(side: Side, ceilings: list[float]) -> dict[str, Any]:
    """Per-step means of the side's measured steps; its real tokens/s and CPU MFU per round (median, range)."""
    s = side.steps
    tps = [r["timed"].rate for r in side.rounds]
    mfu = [r["flops"] / r["timed"].seconds / 1e12 / c for r, c in zip(side.rounds, ceilings, strict=True)]
    run, real = sum(r["tokens_run"] for r in s), sum(r["real_run"] for r in s)
    learner_mfu = [r["mfu_learner"] for r in s if r["mfu_learner"] is not None]
    return {
        "real_tokens_per_s": round(statistics.median(tps), 1), "real_tokens_per_s_range": [round(min(tps), 1), round(max(tps), 1)],
        "cpu_mfu": round(statistics.median(mfu), 4), "cpu_mfu_range": [round(min(mfu), 4), round(max(mfu), 4)],
        "steps": len(s), "step_s": round(statistics.mean(r["wall"] for r in s), 3),
        # This process's CPU seconds: what other processes on a shared machine disturb least.
        "step_cpu_s": round(statistics.mean(r["cpu"] for r in s), 3),
        "real_tokens_per_cpu_s": round(sum(r["tokens"] for r in s) / max(sum(r["cpu"] for r in s), 1e-9), 1),
        "model_calls_per_step": round(statistics.mean(r["calls"] for r in s), 1),
        "real_tokens_per_step": round(statistics.mean(r["tokens"] for r in s), 1),
        "tokens_run_per_step": round(run / len(s), 1), "real_run_per_step": round(real / len(s), 1), "padding_share": round(1 - real / run, 4) if run else 0.0,
        "learner_mfu": round(statistics.median(learner_mfu), 4) if learner_mfu else None,
        "phase_s": {k: round(statistics.mean(r["phases"].get(k, 0.0) for r in s), 4) for k in s[0]["phases"]},
    }


def order(r: int) -> tuple[str, ...]:
    """Which side steps first in round ``r``: padded in even rounds, packed in odd ones."""
    return SIDES if r % 2 == 0 else SIDES[::-1]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ops.bench.packing", description=__doc__.split("\n\n")[0])
    for key, val in DEFAULTS.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(val), default=None, help=f"default {val}")
    ap.add_argument("--sigma", type=float, default=SIGMA, help=f"log-normal spread of responses (default {SIGMA})")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see the module docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"a check that it runs, no verdict: {QUICK}")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value for both sides")
    args = ap.parse_args(argv)
    for key, val in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run = Run(quick=args.quick)
    torch.set_num_threads(args.threads)
    n_rows = args.groups * args.group_size
    draws = [synthetic_lengths(n_rows, args.mean, args.cap, args.sigma, args.prompt, seed=args.seed + r)
             for r in range(args.rounds + 1)]
    positions = max(int((d.prompts + d.responses).max()) for d in draws) + 8
    with tempfile.TemporaryDirectory() as tmp:
        model, shape = make_model(Path(tmp) / "model", args.hidden, args.layers, positions)
        batches = [make_groups(d, args.group_size, shape["vocab"], args.cap, seed=1000 + i) for i, d in enumerate(draws)]
        sides = build_sides(model, args)
        for side in sides.values():  # warm-up on batch 0 (allocator, DeepSpeed's first step), not counted
            side.step(batches[0])
        rounds = [{**paired_round([sides[n] for n in order(r)], batches[r + 1], args.min_round_s),
                   "ceiling": ceiling(args.hidden, args.ceiling_s)} for r in range(args.rounds)]
    ceilings = [r["ceiling"].rate for r in rounds]
    ratios = [r["packed"].rate / r["padded"].rate for r in rounds]
    figs = {name: side_figures(sides[name], ceilings) for name in SIDES}
    out = {
        "bench": "packing", **summarise(ratios, GOAL, name="packed_over_padded"), "rounds": args.rounds,
        **run.common_fields(), "model": shape, "threads": args.threads,
        "rows_per_step": n_rows, "groups": args.groups, "group_size": args.group_size,
        "micro_batch_tokens": args.budget, "padded_micro_batch_size": PADDED_ROWS, "min_round_s": args.min_round_s,
        "lengths": {"mean": args.mean, "cap": args.cap, "sigma": args.sigma, "prompt": args.prompt,
                    **merged_params(draws[1:])},
        "matmul_ceiling_tflops": round(statistics.median(ceilings), 4),
        "matmul_ceiling_tflops_range": [round(min(ceilings), 4), round(max(ceilings), 4)],
        "ratio_cpu_time": round(figs["packed"]["real_tokens_per_cpu_s"] / max(figs["padded"]["real_tokens_per_cpu_s"], 1e-9), 4),
        "cpu_mfu_packed_over_padded": round(figs["packed"]["cpu_mfu"] / max(figs["padded"]["cpu_mfu"], 1e-12), 4),
        "order": [[*order(r), "ceiling"] for r in range(args.rounds)], **figs,
    }
    print(json.dumps(out))
    return 0


def merged_params(draws: list[Rows]) -> dict[str, Any]:
    """The measured rounds' rows as one draw's parameters (``Rows.params``)."""
    both = Rows(np.concatenate([d.prompts for d in draws]), np.concatenate([d.responses for d in draws]),
                np.concatenate([d.truncated for d in draws]), draws[0].mu, draws[0].sigma)
    return both.params()


if __name__ == "__main__":
    raise SystemExit(main())
