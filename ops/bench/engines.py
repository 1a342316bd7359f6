"""Benchmark: the two CPU engines on one workload, and the actor path over real SGLang.

    .venv/bin/python -m ops.bench.engines [--seconds 60] [--rounds 2] [--warmup 10] [key=value ...]

Needs the real server (``ops/setup.sh --sglang``). Both engines serve the same model (the config's
``model.path``, default the shipped ``ops/bases/addition-tiny``, float32) under the actors' request pattern
of the config (default ``ops/configs/default.yaml``: ``prompts_in_flight`` concurrent ``/generate`` calls of
``n = G`` samples, ``max_new_tokens``, temperature 1, log-probs), one at a time, in rounds:

1. raw ``actors.rollout_server`` (``engine.threads`` torch threads, as the launcher starts it);
2. raw SGLang (``common.sglang_args``' CPU command, as the launcher starts it);
3. the actor path on that SGLang: ``python -m actors`` with ``engine.kind=external``, a real buffer, no
   learner; samples/s committed by the buffer.

Each round measures the three phases back to back, so a change of machine load hits all of them; the JSON
line gives per-round figures and medians: ``sglang_over_rollout_server`` (tokens/s), and
``actor_over_raw_sglang`` (samples/s into the buffer over raw /generate; goal >= 0.9, as the actors meet
on rollout_server). Timings are this machine's: compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common.config import Config, load_config
from common.modeling import load_tokenizer
from common.tasks import encode_prompt, get_task
from ops.bench.actors import ENV, actor_overrides, actor_phase, raw_phase, read_line
from ops.sglang_cpu.live import REPO, LiveSGLang, skip_reason

TARGET_ACTOR_RATIO = 0.9


def start_rollout_server(cfg: Config, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    e = cfg.engine
    proc = subprocess.Popen(
        [sys.executable, "-m", "actors.rollout_server", "--model-path", str(model), "--skip-tokenizer-init",
         "--port", "0", "--threads", str(e.threads), "--max-batch-size", str(e.max_batch_size),
         "--batch-wait-ms", str(e.batch_wait_ms), "--weight-version", "0", "--log-level", "warning"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=open(log, "ab"))  # noqa: SIM115 — the child owns it
    line = read_line(proc, "rollout_server ready", 120)
    return proc, line.split("ready on ", 1)[1].split()[0]


def one_round(cfg: Config, config_path: str, overrides: list[str], urls: dict[str, str], prompts: list[list[int]],
              tmp: Path, sock: Path, args: argparse.Namespace) -> dict[str, Any]:
    raw_rs = asyncio.run(raw_phase(cfg, urls["rollout_server"], prompts, args.warmup, args.seconds))
    raw_sg = asyncio.run(raw_phase(cfg, urls["sglang"], prompts, args.warmup, args.seconds))
    act = actor_phase([config_path, *actor_overrides(overrides, tmp, sock, Path(cfg.model.path), urls["sglang"])],
                      tmp, args.warmup, args.seconds)
    return {
        "rollout_server_tokens_per_s": round(raw_rs["tokens_per_s"], 1),
        "sglang_tokens_per_s": round(raw_sg["tokens_per_s"], 1),
        "sglang_samples_per_s": round(raw_sg["samples_per_s"], 2),
        "actor_samples_per_s": round(act["samples_per_s"], 2),
        "sglang_over_rollout_server": round(raw_sg["tokens_per_s"] / max(raw_rs["tokens_per_s"], 1e-9), 3),
        "actor_over_raw_sglang": round(act["samples_per_s"] / max(raw_sg["samples_per_s"], 1e-9), 3),
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("sglang_over_rollout_server", "actor_over_raw_sglang", "rollout_server_tokens_per_s",
                "sglang_tokens_per_s"):
        vals = [r[key] for r in rounds]
        out[key] = round(statistics.median(vals), 3)
        out[f"{key}_range"] = [min(vals), max(vals)]
    lo, hi = out["actor_over_raw_sglang_range"]
    out["actor_verdict"] = "pass" if lo >= TARGET_ACTOR_RATIO else "fail" if hi < TARGET_ACTOR_RATIO else "unclear"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="key=value overrides apply to ops/configs/default.yaml (or --config)")
    ap.add_argument("--config", default=str(REPO / "ops/configs/default.yaml"))
    ap.add_argument("--seconds", type=float, default=60.0, help="measured seconds per phase (SGLang on 2 CPU cores finishes a 16 x 8-sample wave in about a minute)")
    ap.add_argument("--warmup", type=float, default=10.0, help="unmeasured seconds at the start of each phase")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the three phases")
    args, overrides = ap.parse_known_args()
    bad = [o for o in overrides if "=" not in o]
    if bad:
        ap.error(f"unrecognised arguments: {' '.join(bad)}")
    reason = skip_reason()
    if reason is not None:
        print(f"ops.bench.engines: {reason}", file=sys.stderr)
        return 2
    cfg = load_config(args.config, overrides)
    model = Path(cfg.model.path).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="vbench-engines-"))
    sock = Path(tempfile.mkdtemp(prefix="vbe", dir="/tmp"))
    rs: subprocess.Popen | None = None
    sg: LiveSGLang | None = None
    try:
        rs, rs_url = start_rollout_server(cfg, model, tmp / "rollout_server.log")
        sg = LiveSGLang.start(model, tmp, overrides=tuple(overrides))
        tok, task = load_tokenizer(model), get_task(cfg.task)
        prompts = [encode_prompt(tok, task.train_prompt(i)) for i in range(512)]
        urls = {"rollout_server": rs_url, "sglang": sg.url}
        rounds = [one_round(cfg, args.config, overrides, urls, prompts, tmp, sock, args) for _ in range(args.rounds)]
        print(json.dumps({
            "bench": "engines", **summary(rounds), "target_actor_over_raw_sglang": TARGET_ACTOR_RATIO,
            "rounds": rounds, "group_size": cfg.actors.group_size, "prompts_in_flight": cfg.actors.prompts_in_flight,
            "max_new_tokens": cfg.actors.max_new_tokens, "rollout_server_threads": cfg.engine.threads,
            "seconds": args.seconds, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
            "load_1m": round(os.getloadavg()[0], 2),
        }))
        return 0
    finally:
        if sg is not None:
            sg.stop()
        if rs is not None and rs.poll() is None:
            rs.terminate()
            rs.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
