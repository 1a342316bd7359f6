"""Benchmark: how long a weight publish blocks the learner, disk path vs distributed push.

    .venv/bin/python ops/bench/weight_sync.py [--layers 3 --hidden 2048 --vocab 32000 --bucket-mb 256]

A synthetic fp32 Qwen2 (untied embeddings; the defaults make ~1.14 GB), one learner rank (this process,
the model in memory as the learner holds it) and two engines (real ``python -m actors.rollout_server``
processes on the same model, each with an admin API key). Versions, each the model after a perturbation
(every weight + 1e-3, so that a push that did not land would leave the engines on the old weights and
fail ``bitwise_equal``):

1. a first push (cold: fresh host buffers; ``first_push_blocked_s``), its durable copy written;
2. ``disk_blocked_s``: ``learner.weights.write_version`` (the disk path: export to safetensors, NaN check
   and sha256 re-read on rank 0's critical path), timed alone;
3. ``distributed_blocked_s``: ``learner.weight_push.WeightPusher.push`` of the same weights, as a learner
   publishing every step runs it (host buffers given back by the writer): bucket flatten, NaN check,
   broadcast to both engines (each posts its buckets through ``actors.weight_push_client.receive_push``
   with ``pause=in_place``) and the host copy handed to the background ``DurableWriter``. The final
   bucket's broadcast completes in the background (``final_broadcast_background_s``), as the writer's
   time (``durable_write_s``): both off the learner's path.

- ``engine_pause_s``: the longest pause_generation → continue_generation of the two engines.
- ``bitwise_equal``: both engines' ``/weights_digest`` after the push equal ``param_digest`` of its
  durable disk version (written by the background writer from the pushed bytes), and of the disk path's.
- ``blocked_ratio`` = distributed_blocked_s / disk_blocked_s (goal <= 0.25).

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from actors.rollout_server.dist_update import param_digest  # noqa: E402
from actors.weight_push_client import join_group, receive_push  # noqa: E402
from common.sglang_client import SGLangClient  # noqa: E402
from learner.weight_push import DurableWriter, WeightPusher  # noqa: E402


def make_model(out: Path, hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    """A random fp32 Qwen2 (untied) with the char tokenizer, saved in ``out``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.modeling import build_char_tokenizer

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=512, tie_word_embeddings=False)
    with torch.no_grad():
        model = Qwen2ForCausalLM(cfg).float().eval()
    model.save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return model


def start_engine(model_dir: Path, log_dir: Path, key: str, timeout_s: float = 600.0) -> tuple[Any, str]:
    """``python -m actors.rollout_server`` on a free port; (process, url) once it prints its ready line."""
    import select
    import subprocess

    env = {**os.environ, "VAPO_ENGINE_ADMIN_API_KEY": key, "PYTHONUNBUFFERED": "1"}
    err = open(log_dir / f"engine_{time.monotonic_ns()}.log", "w")  # noqa: SIM115 — lives with the process
    proc = subprocess.Popen([sys.executable, "-m", "actors.rollout_server", "--model-path", str(model_dir), "--port", "0",
                             "--threads", "1", "--log-level", "warning", "--max-batch-size", "4"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if "ready on " in line:
                return proc, line.split("ready on ", 1)[1].split()[0]
    proc.kill()
    raise RuntimeError(f"rollout_server did not start (see {err.name})")


async def push_version(pusher: WeightPusher, model: torch.nn.Module, version: int, clients: list[SGLangClient],
                       writer: DurableWriter | None, pause: str = "in_place") -> tuple[Any, list[Any]]:
    """One distributed push: the learner's side in a thread, every engine's posts concurrently.
    Returns (PushResult, per-engine PushReport or exception)."""
    held: list[Any] = []
    plan = [b.body() for b in (pusher.plan or [])]

    def learner() -> Any:
        res = pusher.push(model, version, sink=lambda meta, buf: held.append((meta, buf)))
        if writer is not None:
            writer.submit(version, held)
        return res

    t = asyncio.ensure_future(asyncio.to_thread(learner))
    reports = await asyncio.gather(*(receive_push(c, plan, version, pause=pause, group_name=pusher.current_name)
                                     for c in clients), return_exceptions=True)
    return await t, list(reports)


async def open_group(pusher: WeightPusher, clients: list[SGLangClient]) -> None:
    bodies = pusher.open_group(len(clients))
    joined = asyncio.ensure_future(asyncio.to_thread(pusher.join))
    await asyncio.gather(*(join_group(c, b) for c, b in zip(clients, bodies, strict=True)))
    await joined


def perturb(model: torch.nn.Module, delta: float = 1e-3) -> None:
    """A new version: every weight + ``delta`` (a push that did not land leaves the engines on the old one)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)


def disk_digest(path: Path) -> str:
    """``param_digest`` of a published version's tensors."""
    from common.generation.weights import read_state_dict

    return param_digest(read_state_dict(path).items())


async def engine_digests(clients: list[SGLangClient]) -> list[str]:
    out = []
    for c in clients:
        _, body, _ = await c._request("GET", "weights_digest", timeout_s=600)
        out.append(body["sha256"])
    return out


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from learner.weight_push import bucket_plan
    from learner.weights import write_version

    model_dir = tmp / "base"
    model = make_model(model_dir, args.hidden, args.layers, args.vocab)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    key = secrets.token_hex(16)
    engines = [start_engine(model_dir, tmp, key) for _ in range(2)]
    clients = [SGLangClient(url, api_key=key, timeout_s=600) for _, url in engines]
    try:
        root = tmp / "weights"
        pusher = WeightPusher(args.bucket_mb << 20, "gloo", timeout_s=300)
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        t0 = time.perf_counter()
        await open_group(pusher, clients)
        group_s = time.perf_counter() - t0
        done: list[Any] = []
        writer = DurableWriter(root, done.append, recycle=pusher.recycle)
        perturb(model)
        first, _ = await push_version(pusher, model, 1, clients, writer)  # cold: fresh host buffers
        pusher.settle()
        writer.wait(1200)  # as between two learner steps: the writer gave the buffers back
        perturb(model)
        t0 = time.perf_counter()
        write_version(root, 2, model, None)  # the disk path, as the learner runs it
        disk_blocked = time.perf_counter() - t0
        res, reports = await push_version(pusher, model, 3, clients, writer)
        dist_blocked = sum(res.seconds.values())  # the learner thread's whole push
        pusher.settle()  # the final bucket's broadcast, off the learner's path
        writer.wait(1200)
        errors = [str(r) for r in reports if isinstance(r, BaseException)]
        want = disk_digest(root / "v3")
        got = await engine_digests(clients)
        same_as_disk = disk_digest(root / "v2") == want
        ok = [r for r in reports if not isinstance(r, BaseException)]
        return {
            "bench": "weight_sync", "bytes": n_bytes, "bucket_bytes": pusher.bucket_bytes, "buckets": len(pusher.plan),
            "engines": len(clients), "disk_blocked_s": round(disk_blocked, 3),
            "distributed_blocked_s": round(dist_blocked, 3),
            "blocked_ratio": round(dist_blocked / disk_blocked, 3) if disk_blocked > 0 else None,
            "distributed_phases_s": {k: round(v, 3) for k, v in res.seconds.items()},
            "final_broadcast_background_s": round(res.tail_s, 3),
            "first_push_blocked_s": round(sum(first.seconds.values()), 3),
            "engine_pause_s": round(max((r.pause_s for r in ok), default=0.0), 3),
            "engine_receive_s": round(max((r.receive_s for r in ok), default=0.0), 3),
            "group_init_s": round(group_s, 3), "durable_write_s": round(writer.seconds.get(3, float("nan")), 3),
            "broadcast_ok": res.broadcast and first.broadcast, "errors": errors,
            "bitwise_equal": bool(not errors and res.broadcast and all(g == want for g in got) and same_as_disk),
            "machine": f"{os.cpu_count()} CPUs, shared with other jobs; loadavg {os.getloadavg()[0]:.1f}",
            "torch_threads": torch.get_num_threads(),
        }
    finally:
        for c in clients:
            await c.close()
        for proc, _ in engines:
            proc.terminate()
            proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bucket-mb", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="weight_sync_") as d:
        out = asyncio.run(run(args, Path(d)))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
