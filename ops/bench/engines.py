"""Benchmark: the two CPU engines on one workload, and the actor path over real SGLang.

    .venv/bin/python -m ops.bench.engines [--seconds 60] [--rounds 5] [--warmup 10] [--quick] [key=value ...]

Needs the real server (``ops/setup.sh --sglang``). Both engines serve the same model (the config's
``model.path``, default the shipped ``ops/bases/addition-tiny``, float32) under the actors' request pattern
of the config (default ``ops/configs/default.yaml``: ``prompts_in_flight`` concurrent ``/generate`` calls of
``n = G`` samples, ``max_new_tokens``, temperature 1, log-probs), one at a time, in rounds:

1. raw ``actors.rollout_server`` (``engine.threads`` torch threads, as the launcher starts it);
2. raw SGLang (``common.sglang_args``' CPU command, as the launcher starts it);
3. the actor path on that SGLang: ``python -m actors`` with ``engine.kind=external``, a real buffer, no
   learner; samples/s committed by the buffer.

Each round measures the three phases back to back (in reverse order every other round, so neither side
always runs first), so a change of machine load hits all of them; ``--rounds`` rounds (``ops/bench/measure.py``).
Judged: ``actor_over_raw_sglang`` (samples/s into the buffer over raw SGLang /generate, the limit of the same
engine), **goal >= 0.9** as on rollout_server: median, range, interquartile range and verdict (``unclear``
when the interquartile range straddles the goal). Also per round and as medians:
``sglang_over_rollout_server`` (tokens/s; no goal). Timings are this machine's: compare ratios, not absolute
figures. ``--quick``: 2 short rounds of short responses (a check that it runs; verdict always ``unclear``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common.config import Config, load_config
from common.modeling import load_tokenizer
from common.tasks import encode_prompt, get_task
from ops.bench.actors import ENV, actor_overrides, actor_phase, raw_phase, read_line
from ops.bench.measure import MIN_ROUNDS, Run, figures, summarise
from ops.sglang_cpu.live import REPO, LiveSGLang, skip_reason

TARGET_ACTOR_RATIO = 0.9
QUICK = {"seconds": 5.0, "warmup": 2.0, "rounds": 2}
QUICK_OVERRIDES = ["actors.max_new_tokens=16"]


def start_rollout_server(cfg: Config, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    e = cfg.engine
    proc = subprocess.Popen(
        [sys.executable, "-m", "actors.rollout_server", "--model-path", str(model), "--skip-tokenizer-init",
         "--port", "0", "--threads", str(e.threads), "--max-batch-size", str(e.max_batch_size),
         "--batch-wait-ms", str(e.batch_wait_ms), "--weight-version", "0", "--log-level", "warning"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=open(log, "ab"))  # the child owns it
    line = read_line(proc, "rollout_server ready", 120)
    return proc, line.split("ready on ", 1)[1].split()[0]


def one_round(r: int, cfg: Config, config_path: str, overrides: list[str], urls: dict[str, str],
              prompts: list[list[int]], tmp: Path, sock: Path, args: argparse.Namespace) -> dict[str, Any]:
    got: dict[str, Any] = {}
    for phase in ("rollout_server", "sglang", "actor")[::1 if r % 2 == 0 else -1]:
        if phase == "actor":
            got[phase] = actor_phase([config_path, *actor_overrides(overrides, tmp, sock, Path(cfg.model.path),
                                                                    urls["sglang"], name=f"bench{r}")],
                                     tmp, args.warmup, args.seconds)
        else:
            got[phase] = asyncio.run(raw_phase(cfg, urls[phase], prompts, args.warmup, args.seconds))
    raw_rs, raw_sg, act = got["rollout_server"], got["sglang"], got["actor"]
    return {
        "order": ",".join(got),
        "rollout_server_tokens_per_s": round(raw_rs["tokens_per_s"], 1),
        "sglang_tokens_per_s": round(raw_sg["tokens_per_s"], 1),
        "sglang_samples_per_s": round(raw_sg["samples_per_s"], 2),
        "actor_samples_per_s": round(act["samples_per_s"], 2),
        "sglang_over_rollout_server": round(raw_sg["tokens_per_s"] / max(raw_rs["tokens_per_s"], 1e-9), 3),
        "actor_over_raw_sglang": round(act["samples_per_s"] / max(raw_sg["samples_per_s"], 1e-9), 3),
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The judged ratio (actor over raw SGLang) and every figure's median and range."""
    judged = summarise([r["actor_over_raw_sglang"] for r in rounds], TARGET_ACTOR_RATIO, name="actor_over_raw_sglang")
    return {**judged, **{k: v for k, v in figures(rounds, 3).items() if k != "actor_over_raw_sglang"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="key=value overrides apply to ops/configs/default.yaml (or --config)")
    ap.add_argument("--config", default=str(REPO / "ops/configs/default.yaml"))
    ap.add_argument("--seconds", type=float, default=60.0, help="measured seconds per phase (SGLang on 2 CPU cores finishes a 16 x 8-sample wave in about a minute)")
    ap.add_argument("--warmup", type=float, default=10.0, help="unmeasured seconds at the start of each phase")
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="rounds of the three phases")
    ap.add_argument("--quick", action="store_true", help=f"a check that it runs, no verdict: {QUICK} {QUICK_OVERRIDES}")
    args, overrides = ap.parse_known_args()
    bad = [o for o in overrides if "=" not in o]
    if bad:
        ap.error(f"unrecognised arguments: {' '.join(bad)}")
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        overrides = [*QUICK_OVERRIDES, *overrides]
    run = Run(quick=args.quick)
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
        rounds = [one_round(r, cfg, args.config, overrides, urls, prompts, tmp, sock, args) for r in range(args.rounds)]
        print(json.dumps({
            "bench": "engines", **summary(rounds), "rounds": args.rounds, "per_round": rounds,
            "group_size": cfg.actors.group_size, "prompts_in_flight": cfg.actors.prompts_in_flight,
            "max_new_tokens": cfg.actors.max_new_tokens, "rollout_server_threads": cfg.engine.threads,
            "seconds": args.seconds, "warmup_s": args.warmup, **run.common_fields(),
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
