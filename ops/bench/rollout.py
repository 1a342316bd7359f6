"""Benchmark: rollout_server tokens/s under concurrent clients vs HF ``model.generate`` on the same work.

    .venv/bin/python -m ops.bench.rollout [--clients 16 --prompts 64 --samples 8 --max-new-tokens 64] [--rounds 5] [--quick]

Model: ``ops/bases/addition-tiny`` (the shipped base) when it exists, else a random Qwen2 of the default bootstrap size
(hidden 128, 3 layers, char tokenizer). Both sides sample at temperature 1 with EOS ignored and a fixed
``max_new_tokens``, so they generate exactly the same number of tokens:

- server: ``python -m actors.rollout_server`` as a subprocess; ``clients`` concurrent asyncio clients each
  POST one /generate of ``prompts`` prompts with ``n = samples`` and ``return_logprob`` (through
  ``common.sglang_client``, as the actors do);
- baseline: the same ``clients`` batches, one after another, through ``model.generate`` (left-padded batch
  of ``prompts`` prompts, ``num_return_sequences = samples``), in this process with the same torch threads.

The two sides run interleaved (``ops/bench/measure.py``: ``--rounds`` rounds, ABBA order). Judged:
``server_over_hf_generate`` = server tokens/s over HF generate tokens/s per round, **goal >= 1.5**: median,
range, interquartile range and verdict (``unclear`` when the interquartile range straddles the goal). Also
tokens per CPU-second (server process + client, vs the generate process; medians over rounds) as
``speedup_cpu``: the development machines are shared, and CPU time is far less sensitive to the other
tenants than wall time. ``--quick``: a tiny workload, 2 rounds (a check that it runs; no verdict). Prints
one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import subprocess  # noqa: E402

import torch  # noqa: E402

from common.config import BootstrapConfig  # noqa: E402
from common.modeling import build_char_tokenizer, build_tiny_qwen2, load_model, save_hf  # noqa: E402
from common.sglang_client import SGLangClient  # noqa: E402
from ops.bench.measure import MIN_ROUNDS, Run, Timed, interleave, summarise  # noqa: E402

GOAL = 1.5
QUICK = {"clients": 2, "prompts": 2, "samples": 2, "max_new_tokens": 8, "rounds": 2}


def model_dir(tmp: Path) -> tuple[Path, str]:
    base = REPO / "ops" / "bases" / "addition-tiny"
    if (base / "config.json").exists():
        return base, str(base.relative_to(REPO))
    b = BootstrapConfig()
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(len(tok), hidden_size=b.hidden_size, num_layers=b.num_layers, num_heads=b.num_heads,
                             num_kv_heads=b.num_kv_heads, intermediate_size=b.intermediate_size,
                             max_position_embeddings=b.max_position_embeddings, seed=0)
    return save_hf(model, tok, tmp / "random-qwen2"), f"random-qwen2(h{b.hidden_size},l{b.num_layers})"


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(12, 28, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def start_server(path: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "actors.rollout_server", "--model-path", str(path), "--port", "0",
           "--threads", str(args.threads), "--max-batch-size", str(args.max_batch_size), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    args.server_pid = proc.pid
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the ready line (or EOF if it died)
    if "ready on " not in line:
        proc.wait()
        raise SystemExit(f"rollout_server failed to start (exit {proc.returncode})")
    return proc, line.split("ready on ", 1)[1].split()[0]


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_clients(url: str, batches: list[list[list[int]]], samples: int, max_new: int,
                      pid: int) -> tuple[float, float, int]:
    sp = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": max_new, "ignore_eos": True, "n": samples}
    async with SGLangClient(url, timeout_s=3600) as c:
        await c.generate(batches[0][:2], {**sp, "n": 2, "max_new_tokens": 4})  # warm-up
        c0, s0, t0 = time.process_time(), proc_cpu_s(pid), time.perf_counter()
        results = await asyncio.gather(*(c.generate(b, sp) for b in batches))
        dt = time.perf_counter() - t0
        cpu = proc_cpu_s(pid) - s0 + time.process_time() - c0
    tokens = sum(o.completion_tokens for outs in results for o in outs)
    assert all(len(o.output_logprobs or []) == max_new for outs in results for o in outs)
    return dt, cpu, tokens


def run_hf(path: Path, batches: list[list[list[int]]], samples: int, max_new: int) -> tuple[float, float, int]:
    model: Any = load_model(path).eval()  # nn.Module's __getattr__ types an HF model's generate as Tensor | Module
    gen_kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new,
                      min_new_tokens=max_new, num_return_sequences=samples, pad_token_id=0, eos_token_id=None)

    def one(batch: list[list[int]], n: int, new: int) -> int:
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **{**gen_kwargs, "num_return_sequences": n,
                                                                         "max_new_tokens": new, "min_new_tokens": new})
        return int(out.shape[0] * (out.shape[1] - width))

    one(batches[0][:2], 2, 4)  # warm-up
    c0, t0 = time.process_time(), time.perf_counter()
    tokens = sum(one(b, samples, max_new) for b in batches)
    return time.perf_counter() - t0, time.process_time() - c0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (one /generate each)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per client request")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (n)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per sample (EOS ignored)")
    ap.add_argument("--max-batch-size", type=int, default=512, help="rollout_server --max-batch-size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved server/HF rounds (ABBA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"a check that it runs, no verdict: {QUICK}")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    run = Run(quick=args.quick)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path, name = model_dir(Path(tmp))
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        prompts = make_prompts(args.clients * args.prompts, vocab, args.seed)
        batches = [prompts[i * args.prompts:(i + 1) * args.prompts] for i in range(args.clients)]
        print(f"[bench] model={name} clients={args.clients} prompts={args.prompts} samples={args.samples} "
              f"max_new_tokens={args.max_new_tokens}", file=sys.stderr, flush=True)
        s_runs, h_runs = [], []
        proc, url = start_server(path, args)
        try:
            def server(r: int) -> Timed:
                s_runs.append(asyncio.run(run_clients(url, batches, args.samples, args.max_new_tokens, proc.pid)))
                return Timed(s_runs[-1][2], s_runs[-1][0])

            def hf(r: int) -> Timed:
                h_runs.append(run_hf(path, batches, args.samples, args.max_new_tokens))
                return Timed(h_runs[-1][2], h_runs[-1][0])

            def say(r: int, h: Timed, s: Timed) -> None:
                print(f"[bench] round {r}: server {s.work:.0f} tokens in {s.seconds:.1f} s, hf generate "
                      f"{h.seconds:.1f} s", file=sys.stderr, flush=True)

            rounds = interleave(hf, server, args.rounds, on_round=say)
        finally:
            proc.terminate()
            proc.wait()
        med = statistics.median
        s_dt, s_cpu, s_tok = med(x[0] for x in s_runs), med(x[1] for x in s_runs), s_runs[0][2]
        h_dt, h_cpu, h_tok = med(x[0] for x in h_runs), med(x[1] for x in h_runs), h_runs[0][2]
        n_params = sum(p.numel() for p in load_model(path).parameters())
    assert s_tok == h_tok, (s_tok, h_tok)
    s_tps, h_tps = s_tok / s_dt, h_tok / h_dt
    print(json.dumps({
        "bench": "rollout", **summarise(rounds.rate_ratios(), GOAL, name="server_over_hf_generate"),
        "rounds": args.rounds, **run.common_fields(), "model": name, "params": n_params, "clients": args.clients,
        "prompts_per_client": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
        "threads": args.threads, "max_batch_size": args.max_batch_size, "tokens": s_tok,
        "server_seconds": round(s_dt, 2), "hf_generate_seconds": round(h_dt, 2),
        "server_tokens_per_s": round(s_tps, 1), "hf_generate_tokens_per_s": round(h_tps, 1),
        "server_cpu_seconds": round(s_cpu, 2), "hf_generate_cpu_seconds": round(h_cpu, 2),
        "speedup_of_medians": round(s_tps / h_tps, 2), "speedup_cpu": round(h_cpu / s_cpu, 2),
    }))


if __name__ == "__main__":
    main()
