"""Benchmark: what SGLang's radix (prefix) cache is worth on a run's rollouts (``engine.sglang_radix_cache``).

    .venv/bin/python -m ops.bench.sglang_radix [config.yaml] [--prompts 96 --rounds 2 --port 31500]

Needs the real SGLang server (``ops/setup.sh --sglang`` on CPU). Starts two SGLang engines with vapo's own
command line (``common.sglang_args.sglang_command`` for the config, default ``ops/configs/default.yaml`` with
``engine.kind=sglang``), one with ``--disable-radix-cache`` and one without, and sends each the actors'
workload: the task's training prompts, ``actors.prompts_in_flight`` requests outstanding at a time, each one
prompt with ``n = actors.group_size``, ``max_new_tokens`` and temperature of the config, log-probs returned
(as ``actors.worker`` asks). Rounds alternate between the engines, each going first every other round (both
sleep while idle: ``--sleep-on-idle``), so a shared machine's load falls on both alike. Prints one JSON line
per round, then the median of each arm (completion tokens per wall second and per CPU-second of the
engine's whole process group) and ``disabled_over_enabled``: the median over rounds of the paired ratio
(< 1: disabling the cache is slower).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from common.config import Config, load_config  # noqa: E402
from common.modeling import load_tokenizer  # noqa: E402
from common.remote import private_tmp  # noqa: E402
from common.sglang_args import sglang_command  # noqa: E402
from common.sglang_client import SGLangClient  # noqa: E402
from common.tasks import encode_prompt, get_task  # noqa: E402

START_TIMEOUT_S = 600.0


def start_engine(cfg: Config, log_path: Path, base_env: dict[str, str]) -> subprocess.Popen:
    """One SGLang server for ``cfg`` in ``base_env`` (this process's, with a ``TMPDIR`` of its own: SGLang leaves
    its ipc socket files there), its output appended to ``log_path``."""
    argv, env = sglang_command(cfg, 0)
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, cwd=REPO, env={**base_env, **env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"SGLang exited with code {proc.returncode} while starting (log {log_path})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=30) as r:  # loopback
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)  # polling the server's health with a deadline
    raise SystemExit(f"SGLang not healthy after {START_TIMEOUT_S:.0f} s (log {log_path})")


def group_cpu_s(pgid: int) -> float:
    """utime + stime of every live process in process group ``pgid`` (the server, scheduler, detokenizer)."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def workload(url: str, prompts: list[list[int]], cfg: Config) -> tuple[float, int, int]:
    """(wall seconds, completion tokens, prompt tokens) of ``prompts`` sent as the actor sends them."""
    a = cfg.actors
    sp = {"n": a.group_size, "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
          "max_new_tokens": a.max_new_tokens}
    queue = list(reversed(prompts))
    counts = [0, 0]

    async def worker(client: SGLangClient) -> None:
        while queue:
            outs = await client.generate(queue.pop(), sp, return_logprob=True)
            counts[0] += sum(o.completion_tokens for o in outs)
            counts[1] += sum(o.prompt_tokens for o in outs)

    async with SGLangClient(url, timeout_s=3600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(a.prompts_in_flight)))
        return time.perf_counter() - t0, counts[0], counts[1]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("config", nargs="?", default=str(REPO / "ops/configs/default.yaml"))
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    ap.add_argument("--prompts", type=int, default=96, help="prompts per round (each n = actors.group_size)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per arm, alternating")
    ap.add_argument("--port", type=int, default=31500, help="first of the two engines' ports")
    ap.add_argument("--log-dir", default="/tmp", help="where the engines' logs go")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    arms: dict[str, dict[str, Any]] = {}
    tmps = contextlib.ExitStack()  # each engine's TMPDIR, removed once the engines have stopped
    try:
        for i, mode in enumerate(("enabled", "disabled")):
            cfg = load_config(args.config, [*args.overrides, "engine.kind=sglang", f"engine.sglang_radix_cache={mode}",
                                            f"engine.base_port={args.port + i}", "actors.num_actors=1"])
            log = Path(args.log_dir) / f"sglang-radix-{mode}-{args.port + i}.log"
            env = tmps.enter_context(private_tmp(f"vapo-engine-radix-{mode}-"))
            arms[mode] = {"cfg": cfg, "proc": start_engine(cfg, log, env), "log": log,
                          "url": f"http://{cfg.engine.host}:{args.port + i}", "rounds": []}
        for arm in arms.values():
            wait_healthy(arm["proc"], arm["url"], arm["log"])
        cfg = arms["enabled"]["cfg"]
        task, tok = get_task(cfg.task), load_tokenizer(cfg.model.path)
        for r in range(args.rounds):
            prompts = [encode_prompt(tok, task.train_prompt(r * args.prompts + j)) for j in range(args.prompts)]
            order = list(arms.items()) if r % 2 == 0 else list(reversed(arms.items()))  # neither always first
            for mode, arm in order:  # the same prompts on both; new ones each round (no cross-round hits)
                asyncio.run(workload(arm["url"], prompts[:2], cfg))  # warm-up, not counted
                cpu0 = group_cpu_s(arm["proc"].pid)
                wall, tokens, prompt_tokens = asyncio.run(workload(arm["url"], prompts, cfg))
                cpu = group_cpu_s(arm["proc"].pid) - cpu0
                row = {"round": r, "radix_cache": mode, "wall_s": round(wall, 2), "completion_tokens": tokens,
                       "prompt_tokens": prompt_tokens, "tokens_per_s": round(tokens / wall, 1),
                       "tokens_per_engine_cpu_s": round(tokens / max(cpu, 1e-9), 1), "load1": os.getloadavg()[0]}
                arm["rounds"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        for arm in arms.values():
            try:
                os.killpg(arm["proc"].pid, signal.SIGTERM)
                arm["proc"].wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(arm["proc"].pid, signal.SIGKILL)
                arm["proc"].wait()
        tmps.close()
    med = {m: {k: statistics.median(x[k] for x in a["rounds"]) for k in ("tokens_per_s", "tokens_per_engine_cpu_s")}
           for m, a in arms.items()}
    # Per round, disabled over enabled: the pairs share the machine's load of their minute.
    paired = {k: [round(d[k] / e[k], 3) for d, e in zip(arms["disabled"]["rounds"], arms["enabled"]["rounds"], strict=True)]
              for k in ("tokens_per_s", "tokens_per_engine_cpu_s")}
    print(json.dumps({"median": med, "paired_disabled_over_enabled": paired,
                      "disabled_over_enabled": statistics.median(paired["tokens_per_s"]),
                      "disabled_over_enabled_cpu": statistics.median(paired["tokens_per_engine_cpu_s"]),
                      "config": args.config, "prompts": args.prompts, "rounds": args.rounds,
                      "cpu_count": os.cpu_count()}), flush=True)

if __name__ == "__main__":
    main()
