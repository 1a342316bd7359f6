"""GPU learner check: the packed and the padded VAPO learner step of a randomly initialised 1.5B Qwen2 on one GPU,
in one command that prints one JSON line. It has never run on a GPU: every figure it has printed so far is from
``--cpu-dry``.

    # here (a CPU machine with network): the packages a bare CUDA PyTorch machine lacks, as wheels in the ignored .whl/gpu/
    .venv/bin/python -m ops.bench.gpu_learner --prepare-wheels .whl/gpu
    # on the GPU machine (CUDA torch + transformers 5, tested with 5.25; no DeepSpeed; .whl/gpu/ carried along):
    python -m ops.bench.gpu_learner --wheels .whl/gpu       # installs what is missing (pip --no-index), then runs
    # here: the same code path on the CPU with a tiny config (hidden 64, 2 layers, short rows), ~1 minute
    .venv/bin/python -m ops.bench.gpu_learner --cpu-dry

``--prepare-wheels DIR`` builds DeepSpeed 0.19.8's wheel from its sdist (``pip wheel --no-deps --no-build-isolation``,
``DS_BUILD_OPS=0``: pure Python, ops JIT-built if ever needed; vapo needs none) and downloads, pinned to this venv's
versions, the binary wheels of DeepSpeed's other requirements and of vapo's own that torch and transformers do not
bring (``CARRIED``) for CPython 3.10-3.13 on manylinux x86_64 (16 MiB). ``--wheels DIR`` runs
``DS_BUILD_OPS=0 pip install --no-index --find-links DIR`` of ``REQUIRED`` when one of them does not import, then
re-runs itself without the flag.

What runs: the model (``--size 1.5b``: hidden 1536, 28 layers, 12 heads, 2 key/value heads, intermediate 8960, vocab
151936, tied embeddings, as Qwen2.5-1.5B; ``7b``: Qwen2.5-7B's shape) is made by ``transformers`` with random weights,
bf16, and saved into a temporary directory (no download), with vapo's char tokenizer (token ids are random anyway).
One ``learner.train.Learner`` (one rank, DeepSpeed, ``learner.zero_stage=3``, bf16, activation checkpointing on
every layer, critic + policy, the default algorithm, ``run.device=cuda``) steps on synthetic groups whose rows hold
4k-24k tokens (prompt ~1k; response log-normal, mean 8k, ``common.microplan.synthetic_lengths``, each row's total
clipped to [4096, 24576]) within a 24,576-token micro-batch budget (paper.yaml's): packed (``learner.packing=true``)
and padded (``false``, at most 4 rows a micro-batch, the same budget), one warm-up step each, then rounds of one step
of each, the first side alternating (ABBA). The layout is switched on the one learner between steps (its models use
the ``vapo_packed`` attention, which is SDPA itself for padded calls): two learners of 1.5B would not fit one GPU.

Why ZeRO-3 on one rank: the paper-scale runs are ZeRO-3, so its paths (the partitioned build, the prefetch trace per
pass kind, one LM-head gather per forward) are what the first GPU hour should exercise, and only ZeRO-3 has trace
invalidations to count (``ops.bench.zero3_traffic.Traffic``); on one rank it partitions nothing, so its model states
cost what ZeRO-0's do (16 bytes a parameter: 46 GiB for the 1.5B policy and critic, of an H100's 79). ``--zero-stage 0``
runs the same without it. ``--size 7b`` needs ~219 GiB of model states and is refused on one GPU (the JSON line says
so); it is there for a larger device.

Sizing for 10 minutes on one H100 (arithmetic, not measured): a step's model FLOPs are ~2.5e10 a token (policy
forward + backward, critic forward + backward + the fresh value pass: 7 x 2 x 1.31e9 body parameters, the LM head
on responses, attention at ~8k-token rows), and a step is 12 rows of 4k-22k tokens (~100k tokens with seed 0):
~2.5e15 FLOPs, ~8 s at 30 % MFU, ~25 s at 10 %, plus the recompute (~+25 %). Two warm-up and ``--rounds 2`` x 2
measured steps are 6 steps: 1-3.5 minutes, beside ~1-2 minutes of imports, random init, saving 3 GB and two DeepSpeed
builds. ``--deadline-s`` (480) starts no round that would not finish by then (a round's estimate: 2.2 x the slowest
step so far).

Printed: per layout the step seconds, real tokens/s (prompt + response tokens of the rows, never padding), model
TFLOP/s and MFU (``learner.step_stats.Throughput``: against ``learner.peak_tflops``, else the known-GPU table of
``common.device_peak``, H100 SXM 989 bf16; on the CPU a measured matmul ceiling), model calls and padding share, the
phase seconds, trace invalidations (ZeRO-3) and ``torch.cuda.max_memory_allocated``; ``packed_over_padded`` with
``ops/bench/measure.py``'s fields (fewer than 5 rounds: ``unclear``); device name; torch, CUDA, transformers and
DeepSpeed versions. Exit code 0 when every step ran.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from ops.bench.measure import Run, summarise

try:  # a bare GPU machine lacks DeepSpeed, msgpack, pyzmq, prometheus-client until --wheels installs them
    from common.config import load_config
    from common.gpu_memory import count_parameters, model_state_bytes
    from common.microplan import SIGMA, Rows, synthetic_lengths
    from common.modeling import build_char_tokenizer
    from learner.train import Learner
    from ops.bench.packing import Calls, make_groups
    from ops.bench.zero3_traffic import Traffic
    MISSING: str | None = None
except ImportError as e:
    MISSING = f"{type(e).__name__}: {e}"

DS_VERSION = "0.19.8"
REQUIRED = (f"deepspeed=={DS_VERSION}", "msgpack>=1.0", "pyzmq>=26", "prometheus-client>=0.20")
IMPORTS = ("deepspeed", "msgpack", "zmq", "prometheus_client")
CARRIED = ("einops", "hjson", "msgpack", "ninja", "psutil", "py-cpuinfo", "pydantic", "pydantic-core", "annotated-types",
           "typing-inspection", "typing-extensions", "prometheus-client", "pyzmq")
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# pip matches a wheel's platform tag only against those it is given, not the older manylinux tags they include
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64")
SIZES: dict[str, dict[str, Any]] = {  # HF config.json fields: Qwen2Config's keywords, count_parameters' input
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True},
    "7b": {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 192, "vocab_size": 0, "tie_word_embeddings": True},  # vocab 0: the tokenizer's
}
GPU_ROWS = {"groups": 3, "group_size": 4, "mean": 8000, "prompt": 1024, "lo": 4096, "hi": 24576, "budget": 24576}
DRY_ROWS = {"groups": 2, "group_size": 4, "mean": 96, "prompt": 32, "lo": 48, "hi": 256, "budget": 512}
PADDED_ROWS = 4
GOAL = 1.15  # as ops.bench.packing's: packed over padded real tokens/s
FIT = 0.85  # model states beyond this share of the device's memory leave too little for activations


# ------------------------------------------------------------------------------------------- packages


def missing_imports() -> list[str]:
    return [m for m in IMPORTS if importlib.util.find_spec(m) is None]


def install(wheels: Path) -> int:
    """``pip install --no-index --find-links wheels`` of ``REQUIRED`` (what is already there stays)."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *REQUIRED]
    return subprocess.run(cmd, env={**os.environ, "DS_BUILD_OPS": "0"}, stdout=sys.stderr).returncode


def prepare_wheels(out: Path) -> dict[str, Any]:
    """DeepSpeed's wheel built from its sdist and the ``CARRIED`` wheels, pinned to this venv, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    failed = []
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), f"deepspeed=={DS_VERSION}"]
    if subprocess.run(build, env={**os.environ, "DS_BUILD_OPS": "0"}, stdout=sys.stderr).returncode:
        failed.append("deepspeed")
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED]
    for py in PYTHONS:
        get = [*pip, "download", "--no-deps", "--only-binary=:all:", *(x for p in PLATFORMS for x in ("--platform", p)),
               "--python-version", py, "-d", str(out), *pins]
        if subprocess.run(get, stdout=sys.stderr).returncode:
            failed.append(f"python {py}")
    files = sorted(p.name for p in out.iterdir())
    return {"bench": "gpu_learner", "prepared": str(out), "ok": not failed, "failed": failed, "files": files,
            "mib": round(sum(p.stat().st_size for p in out.iterdir()) / 2**20, 1)}


# ------------------------------------------------------------------------------------------- model and rows


def make_model(out: Path, size: str, device: str) -> dict[str, Any]:
    """A randomly initialised bf16 Qwen2 of ``size`` made on ``device`` and saved with the char tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415 - only this function builds a model

    tok = build_char_tokenizer()
    shape = {**SIZES[size]}
    shape["vocab_size"] = shape["vocab_size"] or len(tok)
    # transformers 5 takes rope_theta only through **kwargs (its typed fields leave it out); the older
    # transformers on the GPU machines need it by this name
    legacy: dict[str, Any] = {"rope_theta": 1e6}
    cfg = Qwen2Config(**shape, max_position_embeddings=32768, **legacy, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):  # random init where it is fast (1.5B on the CPU: minutes), in the saved dtype
        model = Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    n = count_parameters(cfg.to_dict())
    return {**shape, "policy_params": n["policy"], "critic_params": n["critic"]}


def make_rows(n: int, group_size: int, spec: dict[str, int], seed: int) -> Rows:
    """``n`` rows, one prompt length a group, responses log-normal, each row's total clipped to [lo, hi]."""
    drawn = synthetic_lengths(n, spec["mean"], spec["hi"] - spec["prompt"], SIGMA, spec["prompt"], seed=seed)
    prompts = np.minimum(np.repeat(drawn.prompts[::group_size], group_size)[:n], spec["lo"] // 2)
    responses = np.clip(drawn.responses, spec["lo"] - prompts, spec["hi"] - prompts)
    return Rows(prompts, responses, responses >= spec["hi"] - prompts, drawn.mu, drawn.sigma)


# ------------------------------------------------------------------------------------------- the steps


class Check:
    """The learner, its counters, and the records of each layout's measured steps."""

    def __init__(self, learner: Learner, device: str, zero3: bool) -> None:
        self.learner, self.device = learner, device
        self.calls = Calls(learner)
        self.traffic: Traffic | None = None
        if zero3:
            self.traffic = Traffic()
            self.traffic.install()
            self.traffic.watch("policy", learner.policy)
            self.traffic.watch("critic", learner.critic)
        self.records: dict[str, list[dict[str, Any]]] = {"packed": [], "padded": []}
        self.warm: dict[str, dict[str, Any]] = {}  # each layout's warm-up step
        self.ratios: list[float] = []  # per round: packed real tokens/s over padded

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def step(self, layout: str, groups: list[Any], measured: bool) -> dict[str, Any]:
        # The learner builds its micro-batch limits once at start; the layout is switched there.
        self.learner.cfg.learner.packing = layout == "packed"
        self.learner.limits = replace(self.learner.limits, packed=layout == "packed")
        if self.traffic is not None:
            self.traffic.measuring = measured
        inval0 = sum(self.traffic.invalidations.values()) if self.traffic else 0
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        c0 = self.calls.snapshot()
        self._sync()
        t0 = time.perf_counter()
        st = self.learner.step(groups)
        self._sync()
        wall = time.perf_counter() - t0
        calls, run, real = (a - b for a, b in zip(self.calls.snapshot(), c0, strict=True))
        rec = {"wall": wall, "tokens": st["tokens"], "model_flops": st.get("model_flops", 0.0), "mfu": st.get("mfu"),
               "calls": calls, "tokens_run": run, "real_run": real, "phases": st["phase_seconds"],
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if self.device == "cuda" else None,
               "invalidations": (sum(self.traffic.invalidations.values()) - inval0) if self.traffic else None}
        if measured:
            self.records[layout].append(rec)
        return rec


def layout_figures(recs: list[dict[str, Any]], warmup: dict[str, Any] | None) -> dict[str, Any]:
    """A layout's measured steps (medians; every step's seconds), its warm-up step's seconds and memory."""
    if not recs or warmup is None:
        return {"steps": 0, "warmup_step_s": round(warmup["wall"], 3) if warmup else None}
    run, real = sum(r["tokens_run"] for r in recs), sum(r["real_run"] for r in recs)
    seconds = sum(r["wall"] for r in recs)
    mfu = [r["mfu"] for r in recs if r["mfu"] is not None]
    peaks = [r["peak_gib"] for r in [*recs, warmup] if r["peak_gib"] is not None]
    return {
        "steps": len(recs), "step_s": round(statistics.median(r["wall"] for r in recs), 3),
        "step_s_all": [round(r["wall"], 3) for r in recs], "warmup_step_s": round(warmup["wall"], 3),
        "real_tokens_per_step": recs[0]["tokens"],
        "real_tokens_per_s": round(sum(r["tokens"] for r in recs) / seconds, 1),
        "model_tflops": round(sum(r["model_flops"] for r in recs) / seconds / 1e12, 4),
        "mfu": round(statistics.median(mfu), 4) if mfu else None,
        "model_calls_per_step": round(statistics.mean(r["calls"] for r in recs), 1),
        "padding_share": round(1 - real / run, 4) if run else 0.0,
        "trace_invalidations": (sum(r["invalidations"] for r in recs) if recs[0]["invalidations"] is not None
                                else None),
        "warmup_trace_invalidations": warmup["invalidations"],
        "peak_memory_gib": round(max(peaks), 2) if peaks else None,
        "phase_s": {k: round(statistics.median(r["phases"].get(k, 0.0) for r in recs), 3) for k in recs[0]["phases"]},
    }


def overrides(model: Path, args: argparse.Namespace, spec: dict[str, int], device: str) -> list[str]:
    return [f"model.path={model}", f"run.device={device}", f"learner.zero_stage={args.zero_stage}",
            "learner.precision=bf16", "model.dtype=bfloat16",
            "learner.activation_checkpointing=true", "learner.packing=true", f"learner.micro_batch_size={PADDED_ROWS}",
            f"learner.micro_batch_tokens={spec['budget']}", f"learner.batch_groups={spec['groups']}",
            f"actors.group_size={spec['group_size']}", f"actors.max_new_tokens={spec['hi']}",
            "metrics.prometheus=false", *args.overrides]


def run_steps(check: Check, batches: list[list[Any]], deadline: float) -> None:
    """Warm-ups (batch 0), then ABBA rounds of one step a layout while a round fits before ``deadline``; what ran
    is in ``check`` (a step that raises leaves the steps before it there)."""
    for layout in ("packed", "padded"):
        check.warm[layout] = check.step(layout, batches[0], measured=False)
    longest = max(r["wall"] for r in check.warm.values())
    for r, groups in enumerate(batches[1:]):
        if time.monotonic() + 2.2 * longest > deadline:
            break
        order = ("padded", "packed") if r % 2 == 0 else ("packed", "padded")
        done = {layout: check.step(layout, groups, measured=True) for layout in order}
        longest = max(longest, *(d["wall"] for d in done.values()))
        check.ratios.append((done["packed"]["tokens"] / done["packed"]["wall"])
                            / (done["padded"]["tokens"] / done["padded"]["wall"]))


# ------------------------------------------------------------------------------------------- main


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "deepspeed"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def model_states_gib(size: str, zero_stage: int) -> float:
    """Policy + critic weights, gradients and AdamW states on one bf16 rank (``common.gpu_memory``), GiB."""
    n = count_parameters(SIZES[size])
    return sum(model_state_bytes(n[m], zero_stage, 1, "bf16") for m in ("policy", "critic")) / 2**30


def refusal(args: argparse.Namespace, device: str) -> str | None:
    """Why this machine cannot run the check (no GPU; model states that leave no room), or None."""
    if device == "cuda" and not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CPU build, or no GPU); --cpu-dry runs on the CPU"
    if device == "cuda":
        need, have = model_states_gib(args.size, args.zero_stage), torch.cuda.get_device_properties(0).total_memory / 2**30
        if need > FIT * have:
            return (f"--size {args.size}: policy + critic model states need {need:.0f} GiB on one rank, more "
                    f"than {FIT:.0%} of the {have:.0f} GiB of {torch.cuda.get_device_name(0)}")
    return None


def measure(args: argparse.Namespace, out: dict[str, Any]) -> bool:
    """Build the model and the learner, run the steps; the figures go into ``out``. True when every step ran."""
    device = "cpu" if args.cpu_dry else "cuda"
    spec = DRY_ROWS if args.cpu_dry else GPU_ROWS
    deadline = time.monotonic() + args.deadline_s if args.deadline_s > 0 else float("inf")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out["model"] = make_model(Path(tmp) / "model", "tiny" if args.cpu_dry else args.size, device)
        n_rows = spec["groups"] * spec["group_size"]
        draws = [make_rows(n_rows, spec["group_size"], spec, seed=args.seed + i) for i in range(args.rounds + 1)]
        vocab = out["model"]["vocab_size"]
        batches = [make_groups(d, spec["group_size"], vocab, spec["hi"], seed=1000 + i) for i, d in enumerate(draws)]
        learner = Learner(load_config(None, overrides(Path(tmp) / "model", args, spec, device)), None)
        check = Check(learner, device, args.zero_stage == 3)
        out["setup_s"] = round(time.perf_counter() - t0, 1)
        try:
            run_steps(check, batches, deadline)
        finally:  # what ran is reported, also when a step raised
            out.update(figures(check, draws, spec, args.rounds))
    return len(check.ratios) == args.rounds


def figures(check: Check, draws: list[Rows], spec: dict[str, int], rounds: int) -> dict[str, Any]:
    """The JSON line's figures from what ``check`` ran: the judged ratio's fields, the rows, each layout's."""
    lengths = np.concatenate([d.prompts + d.responses for d in draws])
    throughput = check.learner.throughput
    return {
        **summarise(check.ratios, GOAL, name="packed_over_padded"), "rounds": len(check.ratios), "rounds_asked": rounds,
        "rows": {"per_step": len(draws[0].prompts), "groups": spec["groups"], "group_size": spec["group_size"],
                 "tokens_min": int(lengths.min()), "tokens_max": int(lengths.max()),
                 "tokens_mean": round(float(lengths.mean()), 1), "response_mean_asked": spec["mean"],
                 "prompt_asked": spec["prompt"], "clip": [spec["lo"], spec["hi"]]},
        "micro_batch_tokens": spec["budget"], "padded_micro_batch_size": PADDED_ROWS,
        "peak_tflops": throughput.peak, "peak_source": throughput.peak_source,
        **{layout: layout_figures(check.records[layout], check.warm.get(layout)) for layout in ("packed", "padded")},
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ops.bench.gpu_learner", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-dry", action="store_true", help="the same code path on the CPU: tiny model, short rows")
    ap.add_argument("--size", choices=("1.5b", "7b"), default="1.5b", help="the Qwen2 shape (default 1.5b)")
    ap.add_argument("--zero-stage", type=int, choices=(0, 3), default=3, help="DeepSpeed ZeRO stage (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds, one step of each layout (default 2)")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="start no round that would end later (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads on the CPU (default 2)")
    ap.add_argument("--wheels", type=Path, default=None, help="install missing packages from this folder first")
    ap.add_argument("--prepare-wheels", type=Path, default=None, help="put the wheels a GPU machine lacks here, exit")
    ap.add_argument("overrides", nargs="*", help="more config overrides key=value")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.prepare_wheels is not None:
        res = prepare_wheels(args.prepare_wheels)
        print(json.dumps(res))
        return 0 if res["ok"] else 1
    device = "cpu" if args.cpu_dry else "cuda"
    os.environ["DS_ACCELERATOR"] = device  # DeepSpeed picks its accelerator once, at its import
    out: dict[str, Any] = {"bench": "gpu_learner", "cpu_dry": args.cpu_dry, "size": "tiny" if args.cpu_dry else args.size,
                           "zero_stage": args.zero_stage, "versions": versions()}
    if MISSING is not None or missing_imports():
        if args.wheels is not None and install(args.wheels) == 0:  # then again, importing what it installed
            rest = [a for i, a in enumerate(argv) if a != "--wheels" and not a.startswith("--wheels=")
                    and (i == 0 or argv[i - 1] != "--wheels")]
            os.execv(sys.executable, [sys.executable, "-m", "ops.bench.gpu_learner", *rest])
        out.update(ok=False, error=f"missing packages ({MISSING or missing_imports()}): run with --wheels DIR, DIR "
                                   "made by --prepare-wheels DIR on a machine with network")
        print(json.dumps(out))
        return 2
    why = refusal(args, device)
    if why:
        out.update(ok=False, error=why)
        print(json.dumps(out))
        return 2
    run = Run(quick=args.cpu_dry)
    torch.set_num_threads(args.threads)
    out["device"] = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    try:
        out["ok"] = measure(args, out)
    except Exception as e:  # a failed check still prints its line: the failure is the finding
        out.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])
    if device == "cuda":  # the peak is reset before every step: the layouts' peaks, warm-ups included
        out["peak_memory_gib"] = max((out.get(layout, {}).get("peak_memory_gib") or 0.0 for layout in ("packed", "padded")),
                                     default=0.0) or round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out.update(run.common_fields())
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
