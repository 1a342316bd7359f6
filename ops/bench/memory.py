"""Benchmark: learner peak memory of one critic + actor step against response length T and vocabulary V.

    .venv/bin/python -m ops.bench.memory [--t 1024,2048,4096,8192,16384] [--vocab 151936,4096]
        [--hidden 256] [--layers 2] [--old-max-elements 268435456] [--threads 2] [--embeddings frozen]

Prints one JSON line. For every (T, V) a fresh subprocess builds the learner (DeepSpeed engines, ZeRO-0,
fp32) on a random Qwen2 (hidden 256, 2 layers, tied embeddings), runs one warm-up step on a short row (so
gradients and Adam states exist), then one full ``Learner.step`` on a single row of 16 prompt + T response
tokens (value pass, critic update, fresh values, actor update: one micro-batch each) and reports that
step's peak memory. Two paths run in the same invocation:

- ``new``: chunked LM-head log-probs (learner.logits_chunk_elements default) + activation checkpointing;
- ``old``: full ``[B, S, V]`` logits (logits_chunk_elements=0), no checkpointing: the code before.

Measurement: peak resident set size. The child runs with glibc's ``MALLOC_MMAP_THRESHOLD_=65536``, so
every tensor above 64 KiB is its own mmap and freeing it returns the pages (RSS follows live tensor memory
instead of keeping freed heap); after the warm-up the kernel's high-water mark is reset
(``/proc/self/clear_refs`` ← 5) and the figure is ``VmHWM − VmRSS before the step``: the step's own
working memory (activations, logits, gradients, optimizer temporaries), without the weights and Adam
states every configuration holds alike. (tracemalloc does not see torch's allocations; torch keeps no CPU
allocator statistics.) At this model size the tied embedding is almost all parameters (V × 256 against
~1.5M in the layers), so its gradient and AdamW temporaries (a few × V × H × 4 bytes, whatever T) are most
of a short step's peak; ``--embeddings frozen`` leaves them out to show activations + logits alone. The old path is skipped where T × V > ``--old-max-elements`` (it would need tens of
GB here); ``new_over_old_at_16k`` is therefore measured at the smallest vocabulary, and the largest
vocabulary's old peak at 16k is also given as a linear extrapolation from the T values it ran at.

Padding: the scheduler's padded layout (``learner.schedule``, learner.packing=false) cuts a batch with the embedded task's lengths
(default config, 256 rows, 2 mini-batches, learner.micro_batch_tokens=1024) and a long-tailed paper-like
batch (8192 rows, lognormal responses capped at 20k tokens, 16 mini-batches, 8 ranks, 32768-token
budget); waste = padded + filler tokens / all tokens the forwards process.

Targets (ratios from one run): peak_16k_over_1k ≤ 20 (1.25 × 16), vocab_152k_over_4k_at_16k ≤ 1.3,
new_over_old_at_16k ≤ 0.25, padding_waste_default and padding_waste_long_tail ≤ 0.10.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from common.config import load_config
from common.protocol import Sample, SampleGroup
from common.tasks import get_task
from common.tasks.addition import teacher_response

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPT = 16
PATHS = {
    "new": ["learner.activation_checkpointing=true"],
    "old": ["learner.logits_chunk_elements=0", "learner.activation_checkpointing=false"],
}


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _group(n_resp: int, vocab: int, seed: int) -> Any:

    rng = np.random.default_rng(seed)
    s = Sample(prompt_ids=rng.integers(3, vocab, PROMPT).astype(np.int32),
               output_ids=rng.integers(3, vocab, n_resp).astype(np.int32),
               output_logprobs=np.full(n_resp, -1.0, np.float32), reward=1.0, finish_reason="length",
               weight_version=0, response_length=n_resp)
    return SampleGroup(group_id=f"m{seed}", prompt_id="p", task="synthetic", actor_id=0, samples=[s], created_at=0.0)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this (fresh) process: warm-up, reset the high-water mark, one measured step."""
    import torch  # noqa: PLC0415 - measured: loaded inside the figures' window

    torch.set_num_threads(spec["threads"])
    from learner.train import Learner  # noqa: PLC0415 - measured: loaded inside the figures' window

    cfg = load_config(None, [f"model.path={spec['model']}", f"run.root={spec['root']}", "learner.batch_groups=1",
                             "learner.mini_batches=1", "learner.micro_batch_size=1", "metrics.prometheus=false",
                             f"actors.max_new_tokens={spec['t']}", *PATHS[spec["path"]]])
    learner = Learner(cfg, None)
    if spec.get("embeddings", "trained") == "frozen":
        # The tied embedding's gradient and Adam update are O(V·H) whatever T: at this model size they
        # dwarf the activations and would hide what T and V do to the forward/backward itself.
        for emb in (learner.policy.module.get_input_embeddings(), learner.critic.module.backbone.get_input_embeddings()):
            emb.weight.requires_grad_(False)
    learner.step([_group(32, spec["vocab"], 1)])
    group = _group(spec["t"], spec["vocab"], 2)
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    st = learner.step([group])
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"peak_mib": round((peak - before) / 1024, 1), "rss_before_mib": round(before / 1024, 1),
            "step_s": round(seconds, 2), "phase_s": {k: round(v, 2) for k, v in st["phase_seconds"].items()}}


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(spec["threads"])}
    p = subprocess.run([sys.executable, "-m", "ops.bench.memory", "--child", json.dumps(spec)], env=env, capture_output=True,
                       text=True, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"{spec}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def padding_waste(prompt_lens: list[int], resp_lens: list[int], mini_batches: int, world: int, rows: int,
                  tokens: int, sort: bool = True, seed: int = 0) -> float:
    """Padded and filler tokens / all tokens the forwards of one update process, for the scheduler as
    configured (``sort=False``: the old cut, micro_batch_size rows in permutation order, no fillers)."""
    import torch  # noqa: PLC0415 - measured: loaded inside the figures' window

    from common.microplan import Workload, cut_shares, deal  # noqa: PLC0415 - measured: loaded inside the figures' window
    from learner.schedule import minibatch_rows  # noqa: PLC0415 - measured: loaded inside the figures' window

    b = SimpleNamespace(prompt_lengths=torch.tensor(prompt_lens), lengths=torch.tensor(resp_lens))
    seq = b.prompt_lengths + b.lengths
    lengths = seq.tolist()
    real = processed = 0
    for mb in minibatch_rows(len(prompt_lens), mini_batches, seed, 0):
        if sort:  # the padded layout as learner.schedule cuts it (fillers: a rank's empty slots, the shortest row)
            budget = tokens or rows * int(seq.max())  # learner.schedule's budget: 0 = rows x the batch's longest
            plan = cut_shares(deal(lengths, mb.tolist(), world, Workload()), lengths, budget, Workload(), packed=False,
                              max_rows=rows)
            shortest = mb[torch.argmin(seq[mb])].reshape(1)
            micro = [torch.tensor(m) if m else shortest for p in plan for m in p]
        else:
            share = [mb[r::world] for r in range(world)]
            micro = [s[i: i + rows] for s in share for i in range(0, len(s), rows)]
        processed += sum(len(m) * int(seq[m].max()) for m in micro)
        real += int(seq[mb].sum())
    return round(1.0 - real / processed, 4)


def padding_figures() -> dict[str, Any]:

    cfg = load_config(REPO / "ops/configs/default.yaml", [])
    task = get_task(cfg.task)
    n = cfg.learner.batch_groups * cfg.actors.group_size
    prompts = [task.train_prompt(i) for i in range(n)]
    p_len = [len(p.text) + 1 for p in prompts]  # char tokenizer: one token per character (+ BOS)
    r_len = [min(len(teacher_response(p)) + 1, cfg.actors.max_new_tokens) for p in prompts]  # + EOS
    lc = cfg.learner
    rng = np.random.default_rng(0)
    # Paper-like long tail: most responses a few hundred to a few thousand tokens, ~5% cut at 20k.
    lt_r = np.minimum(rng.lognormal(np.log(1500), 1.1, 8192).astype(int) + 1, 20000).tolist()
    lt_p = rng.integers(60, 400, 8192).tolist()
    return {
        "padding_waste_default": padding_waste(p_len, r_len, lc.mini_batches, 1, lc.micro_batch_size, 1024),
        "padding_waste_default_rows_only_sorted": padding_waste(p_len, r_len, lc.mini_batches, 1,
                                                                lc.micro_batch_size, 0),
        "padding_waste_default_old": padding_waste(p_len, r_len, lc.mini_batches, 1, lc.micro_batch_size, 0,
                                                   sort=False),
        "padding_waste_long_tail": padding_waste(lt_p, lt_r, 16, 8, 64, 32768),
        "padding_waste_long_tail_old": padding_waste(lt_p, lt_r, 16, 8, 4, 0, sort=False),
        "padding_setup": {"default": f"{n} rows, learner.micro_batch_tokens=1024, {lc.micro_batch_size} rows max; "
                                     "rows_only_sorted: micro_batch_tokens=0; old: rows in permutation order",
                          "long_tail": "8192 rows, 16 mini-batches, 8 ranks, budget 32768 tokens; old: 4 rows",
                          "long_tail_truncated_fraction": round(float(np.mean(np.array(lt_r) >= 20000)), 3)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--t", default="1024,2048,4096,8192,16384", help="response lengths")
    ap.add_argument("--vocab", default="151936,4096", help="vocabulary sizes (largest first)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--old-max-elements", type=float, default=2**28, help="skip the old path above T x V")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--embeddings", choices=("trained", "frozen"), default="trained",
                    help="frozen: the (tied) embedding gets no gradient, so the peak is activations + logits only")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0

    from common.modeling import build_char_tokenizer, build_tiny_qwen2, save_hf  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it

    ts = [int(x) for x in args.t.split(",")]
    vocabs = [int(x) for x in args.vocab.split(",")]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_char_tokenizer()
        for v in vocabs:
            model = build_tiny_qwen2(v, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                                     intermediate_size=3 * args.hidden, max_position_embeddings=max(ts) + PROMPT + 64)
            mdir = save_hf(model, tok, Path(tmp) / f"v{v}")
            del model
            for path in ("new", "old"):
                for t in ts:
                    if path == "old" and t * v > args.old_max_elements:
                        continue
                    spec = {"model": str(mdir), "root": str(Path(tmp) / "runs"), "t": t, "vocab": v, "path": path,
                            "threads": args.threads, "embeddings": args.embeddings}
                    results[f"{path}/v{v}/t{t}"] = run_child(spec)
                    print(f"{path} V={v} T={t}: {results[f'{path}/v{v}/t{t}']}", file=sys.stderr, flush=True)

    def peak(path: str, v: int, t: int) -> float | None:
        r = results.get(f"{path}/v{v}/t{t}")
        return r["peak_mib"] if r else None

    vmax, vmin, tmin, tmax = max(vocabs), min(vocabs), min(ts), max(ts)
    out: dict[str, Any] = {"bench": "memory", "hidden": args.hidden, "layers": args.layers, "t": ts, "vocab": vocabs,
                           "embeddings": args.embeddings,
                           "measure": "peak RSS of the step above RSS before it (MiB), fresh process per config"}

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    out["peak_16k_over_1k"] = ratio(peak("new", vmax, tmax), peak("new", vmax, tmin))
    out["peak_16k_over_1k_small_vocab"] = ratio(peak("new", vmin, tmax), peak("new", vmin, tmin))
    out["vocab_152k_over_4k_at_16k"] = ratio(peak("new", vmax, tmax), peak("new", vmin, tmax))
    out["new_over_old_at_16k"] = ratio(peak("new", vmin, tmax), peak("old", vmin, tmax))
    old_t = [t for t in ts if peak("old", vmax, t) is not None]
    if old_t and peak("old", vmin, tmax) is not None:
        # The old path's vocabulary-dependent part grows linearly in T (its [T, V] tensors): extrapolate it.
        t0 = max(old_t)
        extra = ((peak("old", vmax, t0) or 0.0) - (peak("old", vmin, t0) or 0.0)) * tmax / t0
        out["old_peak_at_16k_v152k_extrapolated_mib"] = round((peak("old", vmin, tmax) or 0.0) + extra, 1)
        out["new_over_old_at_16k_v152k_extrapolated"] = ratio(peak("new", vmax, tmax),
                                                              out["old_peak_at_16k_v152k_extrapolated_mib"])
        out["old_v152k_measured_at_t"] = old_t
    out.update(padding_figures())
    out["targets"] = {"peak_16k_over_1k": 20.0, "vocab_152k_over_4k_at_16k": 1.3, "new_over_old_at_16k": 0.25,
                      "padding_waste": 0.10}
    out["runs"] = results
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
