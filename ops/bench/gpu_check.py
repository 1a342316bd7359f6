"""GPU check: the whole pipeline (bootstrap, SGLang-API engine, actor, buffer, DeepSpeed learner) on one GPU
with a larger embedded model and, when 2+ GPUs are visible, again with a 2-rank ZeRO-3 learner, in one
command; prints one JSON line of figures.

    ops/setup.sh --cuda && .venv/bin/python -m ops.bench.gpu_check   # CUDA: hidden 512, 8 layers, 20 RL steps
    .venv/bin/python -m ops.bench.gpu_check --device cpu --hidden 32 --layers 1 --sft-steps 20 --steps 2
                                                                      # the same steps on CPU (checks this script)

It runs ``ops/launch.sh ops/configs/default.yaml`` with ``run.device``, the placement (engine and learner on
GPU 0, ``placement.share_gpus``; the 2-rank run puts learner ranks on GPUs 0 and 1, ZeRO-3, evaluation on the
engine) and the bootstrap size overridden, under ``--root`` (default ``runs/gpu_check``), then reads the run
directory: SFT speed,
learner seconds per step by phase and tokens/s, the actor's samples/s and weight-sync latency, held-out
accuracy before and after, and whether the engine and learner really ran on the device (engine command
line, SFT record). The figures go into an issue note; there is no same-run baseline because the reference
is the CPU default run (``docs/RESULTS.md``), which this machine class cannot repeat at this model size.
Exit code 0 only when the pipeline finished on the requested device.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ops.report import load_records  # metrics.jsonl, crash-cut lines skipped

ROOT = Path(__file__).resolve().parents[2]


def overrides(a: argparse.Namespace, ranks: int = 1) -> list[str]:
    base = f"{a.device}-h{a.hidden}-l{a.layers}"
    name = base if ranks == 1 else f"{base}-r{ranks}"
    heads = max(1, a.hidden // 64)
    placement = []
    if a.device == "cuda":
        placement = [f"placement.gpus_per_host={max(ranks, 1)}", "placement.engine_gpus=0",
                     f"placement.learner_gpus=0-{ranks - 1}" if ranks > 1 else "placement.learner_gpus=0",
                     "placement.share_gpus=true"]
    # ZeRO-3 refuses a whole frozen base model per rank: the default critic reads its surprise features from the
    # behaviour log-probs there.
    multi = (["learner.zero_stage=3", "learner.eval_via=engine", "learner.value_head_surprise_source=behaviour"]
             if ranks > 1 else [])
    return [
        f"run.root={a.root}", f"run.name={name}", f"run.device={a.device}", f"run.seed={a.seed}",
        f"model.path={a.root}/_base/{base}", *placement, *multi, f"model.dtype={'bfloat16' if a.device == 'cuda' else 'float32'}",
        f"model.bootstrap.hidden_size={a.hidden}", f"model.bootstrap.num_layers={a.layers}",
        f"model.bootstrap.num_heads={heads}", f"model.bootstrap.num_kv_heads={max(1, heads // 2)}",
        f"model.bootstrap.intermediate_size={3 * a.hidden}", f"model.bootstrap.max_steps={a.sft_steps}",
        f"model.bootstrap.seconds={a.sft_seconds}", "model.bootstrap.eval_k=2",
        f"learner.total_steps={a.steps}", f"learner.eval_every={a.steps}", "learner.checkpoint_every=0",
        f"learner.precision={'bf16' if a.device == 'cuda' else 'fp32'}", f"value_pretrain.steps={a.value_steps}",
        "value_pretrain.allow_untrained_critic=true",  # a check of the path: its short pretraining need not converge
        *a.extra,
    ]


def _tagged(log: Path, tag: str) -> dict[str, Any]:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    return {}


def figures(run_dir: Path, model_dir: Path, device: str) -> dict[str, Any]:
    """What the note needs, read back from the run directory."""
    recs = load_records(run_dir)
    steps = [r for r in recs if r.get("kind") == "learner_step"]
    evals = [r for r in recs if r.get("kind") == "eval"] + [
        {"step": r["step"], **r["eval"]} for r in steps if isinstance(r.get("eval"), dict)]
    timed = steps[1:] or steps  # the first step includes warm-up (allocator, kernels)
    phases: dict[str, float] = {}
    for r in timed:
        for k, v in (r.get("phase_seconds") or {}).items():
            phases[k] = phases.get(k, 0.0) + v / len(timed)
    info = json.loads((model_dir / "vapo_info.json").read_text()).get("bootstrap", {})
    actor = _tagged(run_dir / "logs" / "actor-0.log", "ACTOR DONE")
    engine_cmd = next((ln for ln in (run_dir / "logs" / "engine-0.log").read_text(errors="replace").splitlines()
                       if "start:" in ln and "rollout_server" in ln), "")
    engine_device = (re.search(r"--device (\S+)", engine_cmd) or [None, None])[1]
    syncs = actor.get("weight_sync_latency_s") or []
    return {
        "parameters": info.get("parameters"), "sft_device": info.get("device", "cpu"),
        "sft_seconds": info.get("sft_seconds"), "sft_steps_per_s": info.get("steps_per_s"),
        "engine_device": engine_device, "learner_steps": len(steps),
        "learner_step_seconds": round(sum(v for k, v in phases.items() if k not in ("fetch", "eval")), 3),
        "learner_phase_seconds": {k: round(v, 3) for k, v in phases.items()},
        "learner_tokens_per_s": round(sum(r["tokens_per_second"] for r in timed) / len(timed), 1) if timed else None,
        "actor_samples_per_s": round(actor["samples"] / actor["elapsed_s"], 1) if actor.get("elapsed_s") else None,
        "weight_sync_latency_s_mean": round(sum(syncs) / len(syncs), 4) if syncs else None,
        "heldout_avg_at_k": [(e["step"], round(e["avg_at_k"], 4)) for e in evals if "avg_at_k" in e],
        "ok": bool(steps) and engine_device == device and info.get("device", "cpu").startswith(device),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--hidden", type=int, default=512, help="bootstrap model hidden size")
    ap.add_argument("--layers", type=int, default=8, help="bootstrap model decoder layers")
    ap.add_argument("--sft-steps", type=int, default=400, help="bootstrap SFT steps")
    ap.add_argument("--sft-seconds", type=float, default=240, help="bootstrap SFT time cap")
    ap.add_argument("--steps", type=int, default=20, help="RL steps")
    ap.add_argument("--value-steps", type=int, default=10, help="value pretraining steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default="runs/gpu_check", help="run root (the base model is built under it)")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds before the launch is stopped")
    ap.add_argument("extra", nargs="*", help="more config key=value overrides")
    a = ap.parse_args(argv)
    out: dict[str, Any] = {"bench": "gpu_check", "device": a.device, "hidden": a.hidden, "layers": a.layers}
    import torch  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it

    if a.device == "cuda":
        if not torch.cuda.is_available():
            out.update(ok=False, error=f"torch {torch.__version__} sees no CUDA device (a CPU build, or no GPU)")
            print(json.dumps(out))
            return 2
        out["gpu"] = torch.cuda.get_device_name(0)
    out.update(launch(a, 1))
    n_gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    if n_gpus >= 2 and out.get("ok"):
        # Two learner ranks: NCCL + gloo process group, ZeRO-3 partitions, rank-0-only weight export,
        # evaluation on the engine (the paths a multi-GPU run takes that one GPU cannot show).
        two = launch(a, 2)
        out["two_ranks"] = {k: two.get(k) for k in ("ok", "launch_rc", "wall_seconds", "learner_steps",
                                                    "learner_step_seconds", "learner_tokens_per_s",
                                                    "heldout_avg_at_k", "launch_tail") if k in two}
        out["ok"] = bool(out["ok"]) and bool(two.get("ok"))
    elif a.device == "cuda":
        out["two_ranks"] = f"skipped: {n_gpus} GPU visible"
    print(json.dumps(out))
    return 0 if out["ok"] else 1


def launch(a: argparse.Namespace, ranks: int) -> dict[str, Any]:
    """One ``ops/launch.sh`` run with ``ranks`` learner ranks; its figures (``ok`` = finished on the device)."""
    out: dict[str, Any] = {}
    ov = overrides(a, ranks)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # the launcher sets it per process
    t0 = time.time()
    try:
        p = subprocess.run([str(ROOT / "ops" / "launch.sh"), "ops/configs/default.yaml", *ov], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=a.timeout)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = 124, str(e.stdout or "")[-3000:]
    out["launch_rc"], out["wall_seconds"] = rc, round(time.time() - t0, 1)
    name = next(x.split("=", 1)[1] for x in ov if x.startswith("run.name="))
    base = next(x.split("=", 1)[1] for x in ov if x.startswith("model.path="))
    run_dir, model_dir = Path(a.root) / name, Path(base)
    if not run_dir.is_absolute():
        run_dir, model_dir = ROOT / run_dir, ROOT / model_dir
    try:
        out.update(figures(run_dir, model_dir, a.device))
    except (OSError, ValueError, KeyError) as e:
        out.update(ok=False, error=f"could not read the run: {type(e).__name__}: {e}")
    out["ok"] = bool(out.get("ok")) and rc == 0
    if not out["ok"]:
        out["launch_tail"] = tail
    return out


if __name__ == "__main__":
    sys.exit(main())
