"""Benchmark: learner tokens/s of a full VAPO step (critic + actor) under DeepSpeed vs plain PyTorch.

    .venv/bin/python -m ops.bench.learner [--groups 8] [--group-size 8] [--steps 5] [--threads 2] [--quick] [key=value ...]

Prints one JSON line. Both sides run the same ``learner.train.Learner.step`` code (values → critic
update → fresh values → advantages → actor update, same mini-/micro-batches, same losses); the baseline
swaps the two DeepSpeed-wrapped models for a minimal wrapper around the bare module + ``torch.optim.AdamW`` +
``clip_grad_norm_``, so the ratio is DeepSpeed's own overhead. Steps alternate between the two sides so
machine contention hits both. Model: ``ops/bases/addition-tiny`` (the shipped base) when it exists, otherwise a random tiny
Qwen2 of the default shape (hidden 128, 3 layers); data: synthetic groups shaped like the addition task.
Judged (``ops/bench/measure.py``): ``deepspeed_over_plain`` = DeepSpeed tokens/s ÷ plain tokens/s per round (each
side steps on the round's batch until it ran ``--min-round-s``, 10 s: one step of a few seconds read 0.14-4.9
on a loaded machine; the side going first alternates), **goal ≥ 0.8**: median, range,
interquartile range and verdict (``unclear`` when the interquartile range straddles the goal); also
``ratio_total_wall`` over all steps and ``ratio_cpu_time`` from this process's CPU seconds, which other
processes on a shared machine disturb less. ``--quick``: 2 small steps (a check that it runs; no verdict). To compare two
versions of the learner, run this file from each checkout and compare ``deepspeed_step_cpu_s``.
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

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from common.config import load_config  # noqa: E402
from common.modeling import build_char_tokenizer, build_tiny_qwen2, save_hf  # noqa: E402
from learner.models import load_critic_module, load_policy_module  # noqa: E402
from learner.synthetic import synth_groups  # noqa: E402
from learner.train import Learner  # noqa: E402
from ops.bench.measure import MIN_ROUNDS, Run, Timed, summarise  # noqa: E402

GOAL = 0.8  # DeepSpeed's overhead over a plain loop at most 25%
QUICK = {"groups": 2, "group_size": 4, "steps": 2, "min_round_s": 0.0}


class PlainModel:
    """The slice of the DeepSpeed model interface that learner.update uses, on a bare module."""

    def __init__(self, module: torch.nn.Module, lr: float, weight_decay: float, clip: float) -> None:
        self.module = module
        self.opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
        self.clip = clip
        self._norm: float | None = None

    def __call__(self, *a: Any, **kw: Any) -> Any:
        return self.module(*a, **kw)

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        loss.backward()

    def step(self) -> None:
        if self.clip > 0:
            self._norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def get_global_grad_norm(self) -> float | None:
        return self._norm

    def get_lr(self) -> list[float]:
        return [self.opt.param_groups[0]["lr"]]


def model_dir(tmp: Path) -> tuple[Path, str]:
    base = REPO / "ops" / "bases" / "addition-tiny"
    if (base / "config.json").is_file():
        return base, "ops/bases/addition-tiny"

    tok = build_char_tokenizer()
    return save_hf(build_tiny_qwen2(len(tok), hidden_size=128, num_layers=3), tok, tmp / "tiny"), "random tiny Qwen2 (128x3)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=8, help="groups per step (default 8)")
    ap.add_argument("--group-size", type=int, default=8, help="samples per group (default 8)")
    ap.add_argument("--steps", type=int, default=MIN_ROUNDS, help="rounds after one warm-up step (a batch each)")
    ap.add_argument("--min-round-s", type=float, default=10.0, help="each side repeats its round's step until it ran this long")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--quick", action="store_true", help=f"a check that it runs, no verdict: {QUICK}")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. learner.micro_batch_tokens=2048)")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    run = Run(quick=args.quick)
    torch.set_num_threads(args.threads)


    with tempfile.TemporaryDirectory() as tmp:
        mdir, mdesc = model_dir(Path(tmp))
        cfg = load_config(None, [f"model.path={mdir}", f"learner.batch_groups={args.groups}",
                                 "metrics.prometheus=false", *args.overrides])
        hf_config: Any = load_policy_module(mdir).config  # nn.Module's __getattr__ types it as Tensor | Module
        vocab: int = hf_config.vocab_size
        batches = [synth_groups(args.groups, args.group_size, vocab, seed=100 + i, prompt_len=(8, 20),
                                resp_len=(10, cfg.actors.max_new_tokens), max_new_tokens=cfg.actors.max_new_tokens)
                   for i in range(args.steps + 1)]
        ds = Learner(cfg, None)
        lc = cfg.learner
        plain = Learner(cfg, None, models=(
            PlainModel(load_policy_module(mdir, packing=lc.packing), lc.actor_lr, lc.weight_decay, lc.grad_clip),
            PlainModel(load_critic_module(cfg), lc.critic_lr, lc.weight_decay, lc.grad_clip)))
        res: dict[str, list[dict[str, Any]]] = {"deepspeed": [], "plain": []}
        rounds: dict[str, list[Timed]] = {"deepspeed": [], "plain": []}
        for i, groups in enumerate(batches):
            for name, learner in (("deepspeed", ds), ("plain", plain)) if i % 2 == 0 else (("plain", plain), ("deepspeed", ds)):
                done = Timed(0, 0.0)
                while not done.seconds or (i > 0 and done.seconds < args.min_round_s):  # step 0: the warm-up
                    t0, c0 = time.perf_counter(), time.process_time()
                    st = learner.step(groups)
                    st["wall"], st["cpu"] = time.perf_counter() - t0, time.process_time() - c0
                    done = done + Timed(st["tokens"], st["wall"])
                    if i > 0:
                        res[name].append(st)
                if i > 0:
                    rounds[name].append(done)

    def tok_s(rows: list[dict[str, Any]], clock: str = "wall") -> float:
        return sum(r["tokens"] for r in rows) / sum(r[clock] for r in rows)

    def phases(rows: list[dict[str, Any]]) -> dict[str, float]:
        keys = rows[0]["phase_seconds"].keys()
        return {k: round(statistics.mean(r["phase_seconds"][k] for r in rows), 4) for k in keys}

    ds_tps, plain_tps = tok_s(res["deepspeed"]), tok_s(res["plain"])
    per_step = [d.rate / p.rate for d, p in zip(rounds["deepspeed"], rounds["plain"], strict=True)]
    out = {
        "bench": "learner", **summarise(per_step, GOAL, name="deepspeed_over_plain"), "rounds": args.steps,
        **run.common_fields(), "model": mdesc, "groups": args.groups, "group_size": args.group_size,
        "steps": args.steps, "min_round_s": args.min_round_s, "threads": args.threads,
        "steps_per_round": {k: round(len(v) / args.steps, 1) for k, v in res.items()},
        "tokens_per_step": round(statistics.mean(r["tokens"] for r in res["deepspeed"]), 1),
        "deepspeed_tokens_per_s": round(ds_tps, 1), "plain_torch_tokens_per_s": round(plain_tps, 1),
        "ratio_total_wall": round(ds_tps / plain_tps, 3),
        # CPU seconds of this process: less sensitive to other processes sharing the cores.
        "ratio_cpu_time": round(tok_s(res["deepspeed"], "cpu") / tok_s(res["plain"], "cpu"), 3),
        "ratio_median_step": round(statistics.median(r["wall"] for r in res["plain"])
                                   / statistics.median(r["wall"] for r in res["deepspeed"]), 3),
        "deepspeed_step_s": round(statistics.mean(r["wall"] for r in res["deepspeed"]), 3),
        "plain_step_s": round(statistics.mean(r["wall"] for r in res["plain"]), 3),
        # CPU seconds per step: the figure to compare across runs (before/after a change) on a shared machine.
        "deepspeed_step_cpu_s": round(statistics.mean(r["cpu"] for r in res["deepspeed"]), 3),
        "plain_step_cpu_s": round(statistics.mean(r["cpu"] for r in res["plain"]), 3),
        "deepspeed_phase_s": phases(res["deepspeed"]), "plain_phase_s": phases(res["plain"]),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
