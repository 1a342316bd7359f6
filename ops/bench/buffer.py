"""Buffer benchmark: ZeroMQ ingest into LMDB vs raw LMDB puts of the same bytes, plus batch-serve latency.

    .venv/bin/python ops/bench/buffer.py [--groups-per-sender 600] [--senders 2] [--tokens 1000]

Prints one JSON line. Workload: groups of 16 samples with 1,000-token responses (100-token prompts),
rewards all 0 (no positives harvesting), sent by ``--senders`` processes through ``AsyncGroupSender.send``
(``--window`` concurrent sends, default 32) over TCP on 127.0.0.1 to ``python -m buffer`` (a subprocess),
acknowledged after each LMDB commit (fsync on). As in a launched run, every client authenticates with the
run's CurveZMQ key of its role (``--no-curve``: plain sockets, to measure what encryption costs) and every
group passes the ingest bounds (``common.limits``; vocabulary 151,936 as Qwen2's). Credit/admission is not exercised (the senders do not acquire). The baseline, in
the same run: one process writing the same encoded frames to a fresh LMDB with the same key layout,
``buffer.commit_batch`` groups per transaction, same sync settings. Then ``BatchClient.get_batch`` for
512 groups, timed to bytes received and to decoded ``BatchReply``.

Requirement figure: the paper's setting trains on 512 prompts x 16 = 8,192 samples per learner step; we
assume a 60 s step (long-CoT 32B steps take minutes), i.e. 137 samples/s from one buffer; the target is
100x that.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

STEP_SECONDS_ASSUMED = 60.0
PAPER_SAMPLES_PER_STEP = 512 * 16


def build_groups(n: int, seed: int, prefix: str, g: int, tokens: int) -> list[Any]:
    import numpy as np

    from common.protocol import Sample, SampleGroup

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        samples = [
            Sample(prompt_ids=rng.integers(0, 150000, 100, dtype=np.int32),
                   output_ids=rng.integers(0, 150000, tokens, dtype=np.int32),
                   output_logprobs=-rng.random(tokens, dtype=np.float32),
                   reward=0.0, finish_reason="stop", weight_version=0, response_length=tokens)
            for _ in range(g)
        ]
        out.append(SampleGroup(group_id=f"{prefix}-{i}", prompt_id=f"{prefix}-p{i}", task="bench", actor_id=seed,
                               samples=samples, created_at=time.time()))
    return out


def _keys(keys_dir: str, role: str) -> Any:
    from common.config import CurveConfig
    from common.security import client_curve_keys

    return client_curve_keys(CurveConfig(keys_dir=keys_dir), role) if keys_dir else None


def sender_main(addr: str, actor: int, n: int, g: int, tokens: int, window: int, rounds: int, ready: Any,
                starts: list[Any], results: Any, keys_dir: str = "") -> None:
    import asyncio

    from buffer.client import AsyncGroupSender

    async def send_all(s: AsyncGroupSender, groups: list[Any]) -> list[Any]:
        slots = asyncio.Semaphore(window)  # at most `window` groups unacknowledged, like an actor's loops

        async def one(group: Any) -> Any:
            async with slots:
                return await s.send(group, timeout_s=600)

        return list(await asyncio.gather(*(one(x) for x in groups)))

    async def main() -> None:
        async with AsyncGroupSender(addr, actor, ack_timeout_s=30.0, curve=_keys(keys_dir, "actor")) as s:
            for r in range(rounds):
                groups = build_groups(n, 1000 * r + actor, f"s{actor}-r{r}", g, tokens)
                ready.put(actor)
                await asyncio.get_running_loop().run_in_executor(None, starts[r].wait)
                t0 = time.perf_counter()
                acks = await send_all(s, groups)
                t1 = time.perf_counter()
                assert all(a.committed for a in acks)
                results.put((t0, t1, n, s.resent))
                del groups

    asyncio.run(main())


def raw_lmdb(frames: list[bytes], commit_batch: int, path: Path) -> float:
    import lmdb

    env = lmdb.open(str(path), map_size=1 << 30, max_dbs=8, sync=True, metasync=True, readahead=False,
                    meminit=False)
    db = env.open_db(b"groups")
    key = struct.Struct(">QQI")
    t0 = time.perf_counter()
    for i in range(0, len(frames), commit_batch):
        while True:
            try:
                with env.begin(write=True) as txn:
                    for j, f in enumerate(frames[i:i + commit_batch]):
                        txn.put(key.pack(0, i + j, 16), f, db=db)
                break
            except lmdb.MapFullError:
                env.set_mapsize(env.info()["map_size"] * 2)
    dt = time.perf_counter() - t0
    env.close()
    return dt


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--groups-per-sender", type=int, default=400, help="per sender and round")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--serve-groups", type=int, default=512)
    ap.add_argument("--commit-batch", type=int, default=64)
    ap.add_argument("--window", type=int, default=32, help="unacknowledged groups per sender")
    ap.add_argument("--rounds", type=int, default=3, help="alternating ingest/raw rounds (medians reported)")
    ap.add_argument("--no-curve", action="store_true", help="plain sockets (no CurveZMQ), to measure its cost")
    args = ap.parse_args()
    if args.senders * args.groups_per_sender * args.rounds < 2 * args.serve_groups:
        ap.error("need at least 2 x --serve-groups groups in total")
    return args


def start_buffer(args: argparse.Namespace, work: Path, ingest: str, serve: str,
                 keys_dir: str) -> subprocess.Popen[bytes]:
    """``python -m buffer`` on ``ingest``/``serve`` in ``work``, returned once it printed BUFFER READY."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "buffer", f"buffer.path={work / 'buffer'}", f"buffer.ingest_addr={ingest}",
         f"buffer.serve_addr={serve}", "buffer.metrics_port=0", f"buffer.commit_batch={args.commit_batch}",
         "buffer.capacity_groups=1000000", "run.log_level=WARNING", f"buffer.curve.keys_dir={keys_dir}",
         "buffer.vocab_size=151936", f"actors.max_new_tokens={args.tokens}", f"model.path={work / 'no-model'}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(b"BUFFER READY"):
        message = f"buffer failed to start: {proc.stderr.read().decode() if proc.stderr else ''}"
        stop_buffer(proc)
        raise SystemExit(message)
    return proc


def stop_buffer(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def ingest_rounds(args: argparse.Namespace, ingest: str, keys_dir: str, work: Path) -> dict[str, Any]:
    """Alternating rounds of sender ingest and raw LMDB puts of the same bytes: their times, the mean group
    size and the senders' re-sends."""
    from common.protocol import encode

    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    starts = [ctx.Event() for _ in range(args.rounds)]
    senders = [ctx.Process(target=sender_main, args=(ingest, a, args.groups_per_sender, args.group_size,
                                                     args.tokens, args.window, args.rounds, ready, starts,
                                                     results, keys_dir))
               for a in range(args.senders)]
    for p in senders:
        p.start()
    # The baseline's frames: same shapes and sizes (built once, not timed).
    frames = [encode(g) for a in range(args.senders)
              for g in build_groups(args.groups_per_sender, 100 + a, f"r{a}", args.group_size, args.tokens)]
    ingest_times, raw_times = [], []
    for r in range(args.rounds):  # alternate, so load from other processes hits both sides alike
        for _ in senders:
            ready.get(timeout=600)  # every sender has built this round's groups
        starts[r].set()
        res = [results.get(timeout=900) for _ in senders]
        ingest_times.append(max(x[1] for x in res) - min(x[0] for x in res))
        raw_times.append(raw_lmdb(frames, args.commit_batch, work / f"raw{r}"))
        shutil.rmtree(work / f"raw{r}", ignore_errors=True)
        print(f"round {r}: ingest {ingest_times[-1]:.2f}s raw {raw_times[-1]:.2f}s", file=sys.stderr)
    for p in senders:
        p.join(timeout=60)
    return {"ingest_times": ingest_times, "raw_times": raw_times, "group_bytes": sum(len(f) for f in frames) / len(frames),
            "resent": sum(x[3] for x in res)}


def serve_latency(args: argparse.Namespace, serve: str, keys_dir: str, n_stored: int) -> dict[str, Any]:
    """One batch request timed to its bytes and to its decoded reply, then one ``get_batch``."""
    from buffer.client import BatchClient
    from common.protocol import BatchReply, BatchRequest, decode, encode

    with BatchClient(serve, request_timeout_s=120, curve=_keys(keys_dir, "learner")) as c:
        stats = c.stats()
        assert stats["depth_groups"] == n_stored, stats
        t0 = time.perf_counter()
        req = BatchRequest(learner_version=0, n_groups=args.serve_groups, timeout_ms=60000)
        raw_reply = c._request(encode(req), 180, retries=0)  # bytes only: time the transfer alone
        t_bytes = time.perf_counter() - t0
        reply = decode(raw_reply, 1 << 40)
        t_decoded = time.perf_counter() - t0
        assert isinstance(reply, BatchReply) and len(reply.groups) == args.serve_groups
        t1 = time.perf_counter()
        reply2 = c.get_batch(0, args.serve_groups, 60)
        t_get_batch = time.perf_counter() - t1
        assert len(reply2.groups) > 0
    return {"stats": stats, "reply_bytes": len(raw_reply), "t_bytes": t_bytes, "t_decoded": t_decoded,
            "t_get_batch": t_get_batch}


def report(args: argparse.Namespace, ingested: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """The JSON line: ingest and raw throughput (medians over rounds), against the paper's need, and serving."""
    n_total = args.senders * args.groups_per_sender
    ingest_times, raw_times, group_bytes = ingested["ingest_times"], ingested["raw_times"], ingested["group_bytes"]
    ingest_gps = n_total / statistics.median(ingest_times)
    raw_gps = n_total / statistics.median(raw_times)
    need = PAPER_SAMPLES_PER_STEP / STEP_SECONDS_ASSUMED
    return {
        "bench": "buffer",
        "senders": args.senders, "groups_per_round": n_total, "group_size": args.group_size, "tokens": args.tokens,
        "group_bytes": round(group_bytes),
        "ingest_groups_per_s": round(ingest_gps, 1),
        "ingest_samples_per_s": round(ingest_gps * args.group_size, 1),
        "ingest_mb_per_s": round(ingest_gps * group_bytes / 1e6, 1),
        "raw_lmdb_groups_per_s": round(raw_gps, 1),
        "raw_lmdb_mb_per_s": round(raw_gps * group_bytes / 1e6, 1),
        "ingest_vs_raw": round(ingest_gps / raw_gps, 3),
        "target_vs_raw": 0.5,
        "paper_need_samples_per_s": round(need, 1),
        "assumed_step_s": STEP_SECONDS_ASSUMED,
        "ingest_vs_paper_need": round(ingest_gps * args.group_size / need, 1),
        "target_vs_paper_need": 100,
        "serve_groups": args.serve_groups,
        "serve_reply_mb": round(served["reply_bytes"] / 1e6, 1),
        "serve_latency_bytes_s": round(served["t_bytes"], 3),
        "serve_latency_decoded_s": round(served["t_decoded"], 3),
        "get_batch_s": round(served["t_get_batch"], 3),
        "rounds": args.rounds,
        "ingest_s_rounds": [round(t, 3) for t in ingest_times],
        "raw_s_rounds": [round(t, 3) for t in raw_times],
        "resent": ingested["resent"],
        "curve": not args.no_curve,
        "ingest_commits": int(served["stats"]["ingest_commits"]),
        "cpus": os.cpu_count(),
    }


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="vapo-bench-buffer-"))
    from common.ports import free_port

    ingest, serve = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    keys_dir = ""
    if not args.no_curve:
        from common.security import generate_run_keys

        keys_dir = str(generate_run_keys(work / "keys"))
    proc = None
    try:
        proc = start_buffer(args, work, ingest, serve, keys_dir)
        n_total = args.senders * args.groups_per_sender
        print(f"buffer up; building {n_total} groups in {args.senders} senders", file=sys.stderr)
        ingested = ingest_rounds(args, ingest, keys_dir, work)
        served = serve_latency(args, serve, keys_dir, n_total * args.rounds)
        print(json.dumps(report(args, ingested, served)))
        return 0
    finally:
        if proc is not None:
            stop_buffer(proc)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
