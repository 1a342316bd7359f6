"""``python -m actors [config.yaml] [key=value ...] [--actor-id I]``: run rollout workers.

With ``--actor-id I`` this process is worker I (``actors.worker``): it starts or reaches its engine, loads
the newest published weights, and streams verified groups into the buffer until SIGTERM/SIGINT or
``actors.max_prompts``. ``ops/launch.sh`` starts one such process per actor so it can restart them one by
one. Without ``--actor-id`` this process starts all ``actors.num_actors`` workers as children, restarts a
crashed one up to ``actors.max_worker_restarts`` times, forwards SIGTERM/SIGINT, and exits 0 when every
worker ended cleanly, 1 otherwise.

Exit codes: 0 done or stopped, 1 a worker failed for good, 2 bad command line or config.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from actors.worker import run_worker
from common import lifeline
from common.allocator import keep_freed_memory
from common.cli import config_from_argv, setup_logging

USAGE = """usage: python -m actors [config.yaml] [key=value ...] [--actor-id I]

Rollout actors: prompts from the task registry (sharded by actor id) -> G samples per prompt with behaviour
logprobs from the engine -> verifier rewards -> version-stamped SampleGroups -> buffer (credit first,
ack after commit). Weight updates from the learner are checksum-verified and loaded into the engine.

  --actor-id I   run only worker I (0 <= I < actors.num_actors); without it, run all workers as children

Relevant config (python -m common.config --help lists all): actors.* (num_actors, group_size,
prompts_in_flight, weight_sync=wait|abort, max_prompts, metrics_base_port), engine.* (kind=rollout_server|
sglang|external, base_port, urls, max_restarts), buffer.ingest_addr, learner.publish_addr/query_addr.

examples:
  python -m actors ops/configs/default.yaml --actor-id 0
  python -m actors ops/configs/smoke.yaml actors.num_actors=2 actors.max_prompts=20
"""


def parse_args(argv: list[str]) -> tuple[str | None, list[str], int | None]:
    actor_id: int | None = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--actor-id" or a.startswith("--actor-id="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in a else 2
            try:
                actor_id = int(value)
            except ValueError:
                raise SystemExit(f"actors: --actor-id needs an integer, got {value!r}\n\n{USAGE}") from None
            if actor_id < 0:
                raise SystemExit(f"actors: --actor-id must be >= 0, got {actor_id}")
            continue
        if a.startswith("-"):
            raise SystemExit(f"actors: unknown option {a}\n\n{USAGE}")
        rest.append(a)
        i += 1
    path = rest[0] if rest and "=" not in rest[0] else None
    return path, rest[1:] if path else rest, actor_id


def run_all(argv: list[str], num_actors: int, max_restarts: int) -> int:
    """Start one child per actor; restart crashed ones; forward stop signals; the overall exit code."""
    def start(i: int) -> subprocess.Popen:
        # Workers (and their engines) die with this process even when it is SIGKILLed.
        return subprocess.Popen([sys.executable, "-m", "actors", *argv, "--actor-id", str(i)], **lifeline.popen_kwargs())

    procs = {i: start(i) for i in range(num_actors)}
    restarts = dict.fromkeys(procs, 0)
    results: dict[int, int] = {}
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while procs:
        for i, p in list(procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            del procs[i]
            if rc != 0 and not stopping and restarts[i] < max_restarts:
                restarts[i] += 1
                print(f"actors: worker {i} exited with code {rc}; restart {restarts[i]}/{max_restarts}",
                      file=sys.stderr, flush=True)
                procs[i] = start(i)
                continue
            results[i] = rc
            if rc != 0:
                print(f"actors: worker {i} failed for good (code {rc}); the others keep going", file=sys.stderr, flush=True)
        if procs:
            time.sleep(0.2)  # child supervision poll
    return 0 if all(rc == 0 or rc == -signal.SIGTERM for rc in results.values()) else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    path, overrides, actor_id = parse_args(argv)
    cfg = config_from_argv("actors", USAGE, ([path] if path else []) + overrides)
    if isinstance(cfg, int):
        return cfg
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if actor_id is None:
        passthrough = [a for a in ([path] if path else []) + overrides]
        return run_all(passthrough, cfg.actors.num_actors, cfg.actors.max_worker_restarts)
    if actor_id >= cfg.actors.num_actors:
        print(f"actors: --actor-id {actor_id} outside [0, actors.num_actors={cfg.actors.num_actors})", file=sys.stderr)
        return 2
    setup_logging(cfg.run.log_level, f"actor-{actor_id} %(name)s")
    keep_freed_memory()  # every group it sends is encoded and copied here
    return run_worker(cfg, actor_id)


if __name__ == "__main__":
    sys.exit(main())
