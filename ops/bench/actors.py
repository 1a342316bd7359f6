"""Benchmark: end-to-end actor throughput (verified samples/s into the buffer) vs the engine's raw /generate.

    .venv/bin/python -m ops.bench.actors [--rounds 5] [--seconds 8] [--model DIR] [--quick] [key=value ...]

One ``actors.rollout_server`` engine serves both sides, with the run's config (default
``ops/configs/default.yaml``: G = 8, prompts_in_flight = 16, max_new_tokens = 96, temperature 1):

- baseline, raw ``/generate`` (the limit of the same engine): ``prompts_in_flight`` concurrent asyncio loops
  POST ``/generate`` (n = G, return_logprob) for this actor's prompts through ``common.sglang_client``, and
  count samples: the engine's throughput with no verification, no buffer, no credit;
- subject, the actors: ``python -m actors --actor-id 0`` with ``engine.kind=external`` pointing at the same
  engine, a real buffer (``python -m buffer``, LMDB) and no learner, a fresh run directory each round;
  throughput is the growth of the buffer's committed ``accepted_samples`` counter (read every 0.1 s).

Each side warms up (``--warmup`` s) and is then measured for at least ``--seconds``, from a completion to a
completion (``measure.EventWindow``: requests finish in batches, so a window with fixed edges would count a
batch more or less by where they fall); the two run interleaved
(``ops/bench/measure.py``: ``--rounds`` rounds, ABBA order). Judged: ``actor_over_raw_generate`` = actor
samples/s over raw samples/s per round, **goal >= 0.9**: median, range, interquartile range and verdict
(``unclear`` when the interquartile range straddles the goal). Model: ``--model`` or a random Qwen2 of the
config's bootstrap size (char tokenizer). ``--quick``: 2 short rounds of short responses (a check that it
runs; its verdict is always ``unclear``). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

from buffer.client import BatchClient  # noqa: E402
from common.config import Config, load_config  # noqa: E402
from common.sglang_client import SGLangClient  # noqa: E402
from common.tasks import encode_prompt, get_task  # noqa: E402
from ops.bench.measure import MIN_ROUNDS, EventWindow, Run, Timed, interleave, summarise  # noqa: E402

GOAL = 0.9  # the actors deliver at least 90% of what the engine generates
QUICK = {"seconds": 1.5, "warmup": 0.5, "rounds": 2}
QUICK_OVERRIDES = ["actors.max_new_tokens=16"]

ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def read_line(p: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    """The first stdout line of ``p`` starting with ``prefix``."""
    assert p.stdout is not None
    deadline, buf = time.monotonic() + timeout_s, b""
    while time.monotonic() < deadline:
        r, _, _ = select.select([p.stdout], [], [], 1.0)
        if not r:
            if p.poll() is not None:
                break
            continue
        ch = os.read(p.stdout.fileno(), 1)
        if not ch:
            break
        buf += ch
        if ch == b"\n":
            line, buf = buf.decode(), b""
            if line.startswith(prefix):
                return line
    cmd = p.args if isinstance(p.args, list | tuple) else [p.args]  # Popen also takes one program, unsplit
    raise RuntimeError(f"no {prefix!r} line from {' '.join(map(str, cmd))} (rc={p.poll()})")


def read_tagged(p: subprocess.Popen, tag: str, timeout_s: float) -> dict[str, Any]:
    """The JSON payload of the ``TAG {json}`` line (``BUFFER READY``, ``ACTOR DONE``, ...)."""
    return json.loads(read_line(p, tag + " ", timeout_s)[len(tag) + 1:])


def build_model(cfg: Config, out: Path) -> Path:
    from common.modeling import build_char_tokenizer, build_tiny_qwen2, save_hf  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it

    b = cfg.model.bootstrap
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(len(tok), hidden_size=b.hidden_size, num_layers=b.num_layers, num_heads=b.num_heads,
                             num_kv_heads=b.num_kv_heads, intermediate_size=b.intermediate_size,
                             max_position_embeddings=b.max_position_embeddings, seed=0)
    return save_hf(model, tok, out)


def actor_overrides(overrides: list[str], tmp: Path, sock: Path, model: Path, url: str, name: str = "bench") -> list[str]:
    """One actor on the engine at ``url`` (``engine.kind=external``), a buffer in ``tmp``, sockets in ``sock``;
    a fresh ``name`` starts from an empty buffer and prompt cursor (a restarted actor would re-send groups)."""
    return [
        *overrides, f"run.root={tmp / 'runs'}", f"run.name={name}", f"model.path={model}", "engine.kind=external",
        f"engine.urls=[{url}]", "actors.num_actors=1", f"buffer.ingest_addr=ipc://{sock}/in",
        f"buffer.serve_addr=ipc://{sock}/serve", "buffer.metrics_port=0", "actors.metrics_base_port=0",
        f"learner.publish_addr=ipc://{sock}/pub", f"learner.query_addr=ipc://{sock}/query",
        "learner.batch_groups=100000", "buffer.capacity_groups=100000", "run.log_level=WARNING",
        "actors.weight_query_timeout_s=0.5",
    ]


async def raw_phase(cfg: Config, url: str, prompts: list[list[int]], warmup_s: float, seconds: float) -> dict[str, float]:
    """Samples/s of the engine alone under the actors' request pattern, over at least ``seconds`` after
    ``warmup_s`` with both edges on completions (``measure.EventWindow``; given up after 4x ``seconds``)."""
    a = cfg.actors
    sp = {"n": a.group_size, "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
          "max_new_tokens": a.max_new_tokens}
    t_start = time.monotonic()
    samples, tokens = EventWindow(t_start + warmup_s, seconds), EventWindow(t_start + warmup_s, seconds)
    give_up = t_start + warmup_s + 4 * seconds
    nxt = 0

    async def loop(client: SGLangClient) -> None:
        nonlocal nxt
        while not samples.done and time.monotonic() < give_up:
            ids = prompts[nxt % len(prompts)]
            nxt += 1
            outs = await client.generate(ids, sp, return_logprob=True)
            now = time.monotonic()
            samples.add(now, len(outs))
            tokens.add(now, sum(len(o.output_ids) for o in outs))

    async with SGLangClient(url) as client:
        await asyncio.gather(*(loop(client) for _ in range(a.prompts_in_flight)))
    s, tok = samples.timed(time.monotonic()), tokens.timed(time.monotonic())
    return {"samples_per_s": s.rate, "tokens_per_s": tok.rate, "samples": s.work, "seconds": s.seconds}


def committed(bc: Any, warmup_s: float, seconds: float, every_s: float = 0.1) -> tuple[Timed, Timed]:
    """Samples and groups the buffer committed over at least ``seconds`` after ``warmup_s``, both edges on a
    growth of its counters, read every ``every_s`` (``measure.EventWindow``; given up after 4x ``seconds``)."""
    t_start = time.monotonic()
    samples, groups = EventWindow(t_start + warmup_s, seconds), EventWindow(t_start + warmup_s, seconds)
    give_up = t_start + warmup_s + 4 * seconds
    last = bc.stats()
    while not samples.done and (now := time.monotonic()) < give_up:
        s = bc.stats()
        if s["accepted_samples"] > last["accepted_samples"]:
            samples.add(now, s["accepted_samples"] - last["accepted_samples"])
            groups.add(now, s["accepted_groups"] - last["accepted_groups"])
        last = s
        time.sleep(every_s)  # the counters' sampling period, not synchronisation
    now = time.monotonic()
    return samples.timed(now), groups.timed(now)


def actor_phase(overrides: list[str], tmp: Path, warmup_s: float, seconds: float) -> dict[str, Any]:
    buf = subprocess.Popen([sys.executable, "-m", "buffer", *overrides], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=open(tmp / "buffer.log", "ab"))
    procs = [buf]
    try:
        read_tagged(buf, "BUFFER READY", 60)
        act = subprocess.Popen([sys.executable, "-m", "actors", *overrides, "--actor-id", "0"], cwd=REPO, env=ENV,
                               stdout=subprocess.PIPE, stderr=open(tmp / "actor.log", "ab"))
        procs.append(act)
        read_tagged(act, "ACTOR READY", 120)
        serve = next(o.split("=", 1)[1] for o in overrides if o.startswith("buffer.serve_addr="))
        with BatchClient(serve) as bc:
            samples, groups = committed(bc, warmup_s, seconds)
        act.send_signal(signal.SIGTERM)
        done = read_tagged(act, "ACTOR DONE", 60)
        act.wait(timeout=60)
        return {"samples_per_s": samples.rate, "groups_per_s": groups.rate, "samples": samples.work,
                "seconds": samples.seconds, "credit_wait_s": done["credit_wait_s"], "resubmits": done["resubmits"],
                "tokens_per_sample": done["tokens"] / max(done["samples"], 1)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="key=value overrides apply to ops/configs/default.yaml (or --config)")
    ap.add_argument("--config", default=str(REPO / "ops/configs/default.yaml"))
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="interleaved raw/actor rounds")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per side and round")
    ap.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds at the start of each side")
    ap.add_argument("--model", default="", help="HF model dir (default: a random model of the bootstrap size)")
    ap.add_argument("--quick", action="store_true", help=f"a check that it runs, no verdict: {QUICK} {QUICK_OVERRIDES}")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        ap.error(f"unrecognised arguments: {' '.join(bad)}")
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        overrides = [*QUICK_OVERRIDES, *overrides]
    return args, overrides


def start_engine(cfg: Config, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    e = cfg.engine
    engine = subprocess.Popen(
        [sys.executable, "-m", "actors.rollout_server", "--model-path", str(model), "--skip-tokenizer-init",
         "--port", "0", "--threads", str(e.threads), "--max-batch-size", str(e.max_batch_size),
         "--batch-wait-ms", str(e.batch_wait_ms), "--weight-version", "0", "--log-level", "warning"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=open(log, "ab"))
    line = read_line(engine, "rollout_server ready", 120)
    return engine, line.split("ready on ", 1)[1].split()[0]


def measure(args: argparse.Namespace, overrides: list[str], cfg: Config, model: Path, url: str, tmp: Path,
            sock: Path) -> dict[str, Any]:
    """The interleaved rounds: their figures and the judged ratio."""
    from common.modeling import load_tokenizer  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it

    tok, task = load_tokenizer(model), get_task(cfg.task)
    prompts = [encode_prompt(tok, task.train_prompt(i)) for i in range(512)]
    acts: list[dict[str, Any]] = []
    raws: list[dict[str, float]] = []

    def raw(r: int) -> Timed:
        raws.append(asyncio.run(raw_phase(cfg, url, prompts, args.warmup, args.seconds)))
        return Timed(raws[-1]["samples"], raws[-1]["seconds"])

    def actor(r: int) -> Timed:
        run_overrides = [args.config, *actor_overrides(overrides, tmp, sock, model, url, name=f"bench{r}")]
        acts.append(actor_phase(run_overrides, tmp, args.warmup, args.seconds))
        return Timed(acts[-1]["samples"], acts[-1]["seconds"])

    def say(r: int, b: Timed, s: Timed) -> None:
        print(f"round {r}: raw {b.rate:.2f} samples/s, actor {s.rate:.2f}", file=sys.stderr)

    rounds = interleave(raw, actor, args.rounds, on_round=say)
    return {
        "bench": "actors", **summarise(rounds.rate_ratios(), GOAL, name="actor_over_raw_generate"),
        "rounds": args.rounds, "seconds": args.seconds, "warmup_s": args.warmup,
        "actor_samples_per_s": round(statistics.median(t.rate for t in rounds.subject), 2),
        "raw_samples_per_s": round(statistics.median(t.rate for t in rounds.baseline), 2),
        "actor_samples_per_s_rounds": [round(t.rate, 2) for t in rounds.subject],
        "raw_samples_per_s_rounds": [round(t.rate, 2) for t in rounds.baseline],
        "raw_tokens_per_sample": round(sum(x["tokens_per_s"] for x in raws) / max(sum(x["samples_per_s"] for x in raws), 1e-9), 2),
        "actor_tokens_per_sample": round(statistics.median(a["tokens_per_sample"] for a in acts), 2),
        "actor_credit_wait_s": round(sum(a["credit_wait_s"] for a in acts), 2),
        "actor_resubmits": sum(a["resubmits"] for a in acts),
        "group_size": cfg.actors.group_size, "prompts_in_flight": cfg.actors.prompts_in_flight,
        "max_new_tokens": cfg.actors.max_new_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    run = Run(quick=args.quick)
    tmp = Path(tempfile.mkdtemp(prefix="vbench-actors-"))
    sock = Path(tempfile.mkdtemp(prefix="vba", dir="/tmp"))
    engine: subprocess.Popen | None = None
    try:
        cfg = load_config(args.config, overrides)
        model = Path(args.model) if args.model else build_model(cfg, tmp / "model")
        engine, url = start_engine(cfg, model, tmp / "engine.log")
        out = measure(args, overrides, cfg, model, url, tmp, sock)
        print(json.dumps({**out, **run.common_fields()}))
        return 0
    finally:
        if engine is not None and engine.poll() is None:
            engine.terminate()
            engine.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
