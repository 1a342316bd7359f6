"""Benchmark: the engine/learner log-prob mismatch of a bf16 rollout engine against an fp32 learner, with an
fp32 engine as the same-run baseline (what the learner's ``mismatch_kl`` / ``mismatch_ratio_max`` report).

    .venv/bin/python -m ops.bench.mismatch [--config ops/configs/default.yaml --prompts 32 --samples 8]

The rollout server's own decode loop (``common.generation.scheduler.Scheduler``: fused weights, KV
cache, batched decode) samples ``samples`` responses to each of ``prompts`` training prompts of the config's
task, once with the model loaded in bfloat16 and once in float32, and returns each token's log-prob as the
engine would send it. An fp32 ``Learner`` of the same config then scores the same tokens with the same
weights (version 0) exactly as in a step (``learner.forwards.compute_logprobs``), and
``learner.losses.mismatch_stats`` gives the per-token KL(π_engine ‖ π_learner) (k3 estimate) and the largest
ratio π_learner/π_engine. The fp32 engine's mismatch is the floor (different kernels, same precision).

Model: the config's ``model.path`` (its bootstrapped base; run ``ops/launch.sh CONFIG`` once, or
``python -m learner.sft CONFIG``, to build it). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.config import Config, load_config  # noqa: E402
from common.generation.sampling import SamplingParams  # noqa: E402
from common.generation.scheduler import Scheduler, Sequence  # noqa: E402
from common.modeling import load_model, load_tokenizer  # noqa: E402
from common.protocol import Sample, SampleGroup  # noqa: E402
from common.tasks import encode_prompt, get_task  # noqa: E402
from learner.forwards import compute_logprobs  # noqa: E402
from learner.losses import mismatch_stats  # noqa: E402
from learner.train import Learner  # noqa: E402


def sample(model_path: str, dtype: str, prompts: list[list[int]], n: int, max_new: int, eos: set[int],
           seed: int) -> list[Sequence]:
    """``n`` sampled responses per prompt from the rollout server's scheduler over ``model_path`` in ``dtype``."""
    model = load_model(model_path, dtype=dtype, device="cpu")
    sched = Scheduler(model, max_batch_size=len(prompts) * n, context_length=max(map(len, prompts)) + max_new,
                      eos_token_ids=eos, seed=seed)
    done = threading.Event()
    finished: list[Sequence] = []
    lock = threading.Lock()

    def on_done(s: Sequence) -> None:
        with lock:
            finished.append(s)
            if len(finished) == len(prompts) * n:
                done.set()

    sp = SamplingParams(max_new_tokens=max_new, temperature=1.0)
    seqs = [Sequence(rid=f"{i}-{j}", prompt_ids=list(p), params=sp, on_done=on_done)
            for i, p in enumerate(prompts) for j in range(n)]
    try:
        sched.submit(seqs)
        if not done.wait(timeout=1800):
            raise TimeoutError("generation did not finish in 30 min")
    finally:
        sched.shutdown()
    return seqs


def measure(cfg: Config, learner: object, seqs: list[Sequence], n: int) -> dict[str, float]:
    """The learner's mismatch statistics on ``seqs`` (groups of ``n``), as its first mini-batch computes them."""
    groups = []
    for g in range(len(seqs) // n):
        samples = [Sample(prompt_ids=np.array(s.prompt_ids, np.int32), output_ids=np.array(s.output_ids, np.int32),
                          output_logprobs=np.array(s.logprobs, np.float32), reward=0.0,
                          finish_reason=(s.finish or {}).get("type", "stop"), weight_version=0,
                          response_length=len(s.output_ids)) for s in seqs[g * n:(g + 1) * n] if s.output_ids]
        if samples:
            groups.append(SampleGroup(group_id=f"g{g}", prompt_id=str(g), task=cfg.task.name, actor_id=0,
                                      samples=samples, created_at=0.0))
    batch = learner.make_batch(groups=groups, extra=[])  # type: ignore[attr-defined]
    lp = compute_logprobs(learner.policy, batch, torch.arange(batch.size), 64)  # type: ignore[attr-defined]
    kl_sum, tokens, top = mismatch_stats(lp, batch.behaviour_logprobs, batch.mask)
    abs_diff = ((lp - batch.behaviour_logprobs).abs() * batch.mask).sum() / batch.mask.sum()
    return {"mismatch_kl": kl_sum / max(tokens, 1.0), "mismatch_ratio_max": top, "tokens": int(tokens),
            "mean_abs_logprob_diff": float(abs_diff)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="ops/configs/default.yaml")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = load_config(REPO / args.config, ["metrics.prometheus=false", "model.dtype=float32",
                                           "learner.precision=fp32", "learner.threads=2"])
    model_path = str(REPO / cfg.model.path)
    if not (Path(model_path) / "config.json").exists():
        sys.exit(f"no base model at {model_path}: build it with `python -m learner.sft {args.config}`")
    cfg.model.path = model_path
    torch.set_num_threads(2)
    tok = load_tokenizer(model_path)
    task = get_task(cfg.task)
    prompts = [encode_prompt(tok, task.train_prompt(i)) for i in range(args.prompts)]
    eos = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()

    learner = Learner(cfg, None)
    out: dict[str, object] = {"bench": "mismatch", "config": args.config, "model": cfg.model.path,
                              "prompts": args.prompts, "samples": args.samples}
    for dtype in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        seqs = sample(model_path, dtype, prompts, args.samples, cfg.actors.max_new_tokens, eos, args.seed)
        out[f"engine_{dtype}"] = {k: round(v, 7) if isinstance(v, float) else v
                                  for k, v in measure(cfg, learner, seqs, args.samples).items()}
        out[f"engine_{dtype}"]["seconds"] = round(time.perf_counter() - t0, 1)  # type: ignore[index]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
