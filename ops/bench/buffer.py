"""Buffer benchmark: ZeroMQ ingest into LMDB vs raw LMDB puts of the same bytes, plus batch-serve latency.

    .venv/bin/python -m ops.bench.buffer [--rounds 5] [--min-round-s 5] [--senders 2] [--no-curve] [--quick]
        [--max-wall-s 900] [--capacity-bytes N]

Prints one JSON line. Workload: groups of 16 samples with 1,000-token responses (100-token prompts), rewards all
0 (no positives harvesting), sent by ``--senders`` processes through ``AsyncGroupSender.send`` (``--window``
concurrent sends, default 128 as ``ops/configs/paper.yaml``'s ``actors.prompts_in_flight``: an actor awaits each
group's ack in one of its prompt loops) over TCP on 127.0.0.1 to ``python -m buffer`` (a subprocess),
acknowledged after each LMDB commit (fsync on). As in a launched run, every client authenticates with the run's
CurveZMQ key of its role (``--no-curve``: plain sockets, to measure what encryption costs) and every group passes
the ingest bounds (``common.limits``; vocabulary 151,936 as Qwen2's). Credit/admission is not exercised (the
senders do not acquire). Each sender builds ``--groups-per-sender`` groups once and, per call, sends
``--groups-per-call`` of them (cycling through them, under fresh group_ids), as many calls as a round needs. A
call is long (1,000 groups a sender) because each starts with an empty pipeline and ends draining it, a cost a
stream of groups does not have and the raw side never pays. (On a 2-core EPYC: medians 0.59-0.65 over three
runs with calls of 200 groups, 0.60-0.65 over five with 1,000, a difference inside the run-to-run spread.)

The baseline, the limit of the same resource: this process putting the same encoded frames, as many per call as
an ingest call sends, into an LMDB opened with the buffer store's settings (sync and metasync: an fsync per
commit), ``buffer.commit_batch`` groups per transaction (``RawLMDB``). A third side measures the transport's
limit: the same senders sending the same groups to a sink (``sink_main``: the buffer's CurveZMQ setup, an ack as
soon as the group_id is read, nothing validated or stored; it and the senders are in ``ops/bench/buffer_peers.py``).
The three run in rounds, the order rotated each round (``ops/bench/measure.py``): ``--rounds`` rounds, each side
repeated until it ran ``--min-round-s`` seconds. Judged: ``ingest_over_raw_lmdb`` = ingest groups/s over raw
groups/s per round, **goal >= 0.6**, its median, range and interquartile range, and the verdict (``unclear``
when the interquartile range straddles the goal). Beside it, not judged: ``sink_over_raw_lmdb``, ``ingest_over_sink``, and ``ceiling_over_raw_lmdb``, the
best any buffer could do on these cores (``ceiling_rate``: the sink's transport cost plus the raw side's measured
CPU per group for the same writes, shared perfectly over the cores). Then ``BatchClient.get_batch`` for 512
groups, timed to bytes received and to decoded ``BatchReply``. Every process here (buffer, senders, sink, this
one's raw side) keeps freed memory for reuse as the buffer and actors do (``common.allocator``). ``--quick``:
tiny groups, 2 rounds (a check that it runs; its verdict is always ``unclear``).

Bounded on any disk. Each store holds at most one call's groups (2 x 1,000, ~270 MB), however fast the disk:
before each ingest call the groups the last one stored are served, untimed, as a learner takes them
(``drain``: ``BatchClient.get_batch``, which deletes them), and before each raw call the raw side deletes the
entries of its last call in one transaction, untimed. The buffer's capacity is one call:
``buffer.capacity_groups`` its groups, ``buffer.capacity_bytes`` their frames (``--capacity-bytes`` overrides
it), so a store that did not drain is refused at once. Before, both stores grew for the whole run: on a disk syncing
6-7k raw groups/s (Intel Xeon) the buffer reached its 8 GiB ``capacity_bytes`` by round 4, the raw LMDB grew
to 17 GB (past the page cache), and the senders re-sent refused groups without end. Fair: per group both sides
do the same disk work, one put (timed) and one delete (untimed) in an LMDB of the same settings, transaction
size and size on disk, so after the first call each side's timed puts land in pages LMDB freed, alike (a store
made afresh each round instead measured the disk's reuse of its own deleted files: 950 -> 3,200 groups/s over
6 rounds on a virtual disk); the raw side stays the limit of the same resource. Fails with exit 1 and the reason
(``BenchError``), never a retry loop: a refused send (any ``IngestAck`` with ``committed=False``: ``full``,
``storage``, ``invalid``; ``AsyncGroupSender.send`` re-sends ``full``/``storage`` until its timeout, right for
an actor whose learner drains the buffer, endless here), a sender's error or exit, or ``--max-wall-s`` passed.
The line carries ``disk_peak_mb``, the most the temp dir held on disk (sampled after every call). On an Intel
Xeon with a disk syncing fast, 2 cores of which another benchmark held one: 0.10 and 0.12, fail twice (raw
7,900-8,400 groups/s, ingest 830-920, sink 1,500-1,600: the transport alone reaches 0.2 of raw there), ~590 MB
on disk, 124-133 s a run; two more under a load of 3-7, 0.14 and 0.20, fail, 135-157 s (docs/BENCHMARKS.md).

Requirement figure: the paper's setting trains on 512 prompts x 16 = 8,192 samples per learner step; we
assume a 60 s step (long-CoT 32B steps take minutes), i.e. 137 samples/s from one buffer; the target is
100x that.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from buffer.client import BatchClient
from common.allocator import keep_freed_memory
from common.ports import free_port
from common.protocol import BatchReply, BatchRequest, decode, encode
from common.security import generate_run_keys
from ops.bench.buffer_peers import BenchError, build_groups, client_keys, sender_main, sink_main
from ops.bench.measure import MIN_ROUNDS, Run, Timed, rotate, summarise

REPO = Path(__file__).resolve().parents[2]

GOAL = 0.6  # ingest at least 0.6 of the raw LMDB rate
QUICK = {"groups_per_sender": 8, "groups_per_call": 8, "group_size": 4, "tokens": 50, "serve_groups": 8, "rounds": 2, "min_round_s": 0.0}
STEP_SECONDS_ASSUMED = 60.0
PAPER_SAMPLES_PER_STEP = 512 * 16
KEY = struct.Struct(">QQI")  # the raw side's keys, shaped as the store's (weight version, sequence, samples)
DRAIN_GROUPS = 1024  # groups one drain request takes (the buffer runs with buffer.max_batch_groups at this)


@dataclasses.dataclass
class Deadline:
    """``--max-wall-s`` from the start of the run, checked wherever the benchmark waits or loops."""

    limit_s: float
    start: float = dataclasses.field(default_factory=time.monotonic)

    def check(self, doing: str) -> None:
        if time.monotonic() - self.start > self.limit_s:
            raise BenchError(f"past --max-wall-s {self.limit_s:g} s while {doing}")


class RawLMDB:
    """The baseline: this process putting ``call`` (the frames of one ingest call, in the senders' order) into
    an LMDB opened as the buffer's store opens it (sync and metasync on: an fsync per commit), ``commit_batch``
    groups per transaction, after deleting, untimed, what its last call put (as ``drain`` empties the buffer).

    One store for the whole run, holding one call at most, as the buffer's does: on a virtual disk, writes into
    blocks a deleted file just freed ran up to 3x faster than writes that grow a file (a store made afresh each
    round sped up 950 -> 3,200 groups/s over 6 rounds), so a baseline remade each round measured the disk's reuse
    of its own deleted files, not the work the buffer does."""

    def __init__(self, call: list[bytes], commit_batch: int, path: Path) -> None:
        self.call, self.commit_batch, self.path = call, commit_batch, path
        self.env: Any = None
        self.written = 0  # keys continue across calls, as the store's sequence does
        self.held = 0  # entries the last call left
        self.cpu_s: dict[int, float] = {}  # per round: this process's CPU seconds (user + system) in the puts

    def open(self) -> None:
        self.env = lmdb.open(str(self.path), map_size=1 << 30, max_dbs=8, subdir=True, sync=True, metasync=True,
                             readahead=False, meminit=False, max_readers=256)
        self.db = self.env.open_db(b"groups")

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
            shutil.rmtree(self.path, ignore_errors=True)

    def _write(self, fn: Callable[[Any], object]) -> None:
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def _put(self, first: int, frames: list[bytes], txn: Any) -> None:
        for j, f in enumerate(frames):
            txn.put(KEY.pack(0, first + j, 16), f, db=self.db)

    def put_all(self, r: int) -> Timed:
        """The last call's entries deleted (untimed), then every frame of ``call`` put once (timed)."""
        if self.env is None:
            self.open()
        old = range(self.written - self.held, self.written)
        self._write(lambda txn: [txn.delete(KEY.pack(0, i, 16), db=self.db) for i in old])
        cpu0, t0 = time.process_time(), time.perf_counter()
        frames, b, base = self.call, self.commit_batch, self.written
        for i in range(0, len(frames), b):
            self._write(functools.partial(self._put, base + i, frames[i:i + b]))
        t1 = time.perf_counter()
        self.written, self.held = base + len(frames), len(frames)
        self.cpu_s[r] = self.cpu_s.get(r, 0.0) + time.process_time() - cpu0
        return Timed(len(frames), t1 - t0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--groups-per-sender", type=int, default=200, help="distinct groups each sender builds")
    ap.add_argument("--groups-per-call", type=int, default=1000, help="groups each sender sends per call")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--serve-groups", type=int, default=512)
    ap.add_argument("--commit-batch", type=int, default=64)
    ap.add_argument("--window", type=int, default=128,
                    help="unacknowledged groups per sender (128: paper.yaml's actors.prompts_in_flight)")
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="rounds of the three sides (raw, ingest, sink)")
    ap.add_argument("--min-round-s", type=float, default=5.0, help="each side of a round repeats until it ran this long")
    ap.add_argument("--no-curve", action="store_true", help="plain sockets (no CurveZMQ), to measure its cost")
    ap.add_argument("--max-wall-s", type=float, default=900.0, help="past this the benchmark fails (exit 1)")
    ap.add_argument("--capacity-bytes", type=int, default=0,
                    help="buffer.capacity_bytes (0: one call's frames; less makes a send refused, exit 1)")
    ap.add_argument("--quick", action="store_true", help=f"a check that it runs, no verdict: {QUICK}")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


def start_buffer(args: argparse.Namespace, work: Path, ingest: str, serve: str, keys_dir: str,
                 capacity_bytes: int) -> subprocess.Popen[bytes]:
    """``python -m buffer`` on ``ingest``/``serve`` in ``work``, holding one call's groups, returned once it
    printed BUFFER READY."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "buffer", f"buffer.path={work / 'buffer'}", f"buffer.ingest_addr={ingest}",
         f"buffer.serve_addr={serve}", "buffer.metrics_port=0", f"buffer.commit_batch={args.commit_batch}",
         f"buffer.capacity_groups={args.senders * args.groups_per_call}", f"buffer.capacity_bytes={capacity_bytes}",
         f"buffer.max_batch_groups={DRAIN_GROUPS}",
         "run.log_level=WARNING", f"buffer.curve.keys_dir={keys_dir}",
         "buffer.vocab_size=151936", f"actors.max_new_tokens={args.tokens}", f"model.path={work / 'no-model'}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(b"BUFFER READY"):
        message = f"buffer failed to start: {proc.stderr.read().decode() if proc.stderr else ''}"
        stop_buffer(proc)
        raise BenchError(message)
    return proc


def stop_buffer(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_sink(ctx: Any, keys_dir: str) -> tuple[Any, str]:
    """``sink_main`` in its own process, returned once it is bound, and its address."""
    addr, ready = f"tcp://127.0.0.1:{free_port()}", ctx.Event()
    sink = ctx.Process(target=sink_main, args=(addr, keys_dir, ready), daemon=True)
    sink.start()
    if not ready.wait(60):
        sink.kill()
        raise BenchError("the transport sink did not start")
    return sink, addr


def disk_use(path: Path) -> int:
    """Bytes the files under ``path`` take on disk (allocated blocks)."""
    total = 0
    for f in path.rglob("*"):
        try:
            total += f.stat().st_blocks * 512 if f.is_file() else 0
        except FileNotFoundError:
            pass
    return total


def drain(client: BatchClient, chunk: int, deadline: Deadline) -> None:
    """Serve every group the buffer holds, ``chunk`` a request, as a learner takes them (which deletes them)."""
    while (depth := int(client.stats()["depth_groups"])) > 0:
        deadline.check("draining the buffer")
        client.get_batch(0, min(depth, chunk), 60)


def collect(results: Any, senders: list[Any], deadline: Deadline) -> list[tuple[float, float, int, int]]:
    """Every sender's report of the call, or ``BenchError``: a sender's error, a sender gone, the deadline."""
    got: list[tuple[float, float, int, int]] = []
    while len(got) < len(senders):
        deadline.check("waiting for the senders' call")
        try:
            item = results.get(timeout=1.0)
        except queue.Empty:
            if gone := [p.exitcode for p in senders if not p.is_alive()]:
                raise BenchError(f"a sender exited (code {gone[0]}) in the middle of a call") from None
            continue
        if item[0] == "error":
            raise BenchError(item[1])
        got.append(item)
    return got


def ingest_rounds(args: argparse.Namespace, frames: list[bytes], ingest: str, serve: str, keys_dir: str,
                  work: Path, deadline: Deadline) -> dict[str, Any]:
    """Rounds of raw LMDB puts, sender ingest into the buffer and the same sends into the transport sink, the
    order rotated each round (``measure.rotate``); the buffer drained before each ingest call."""
    ctx = mp.get_context("spawn")
    sink, sink_addr = start_sink(ctx, keys_dir)
    addrs = {"buffer": ingest, "sink": sink_addr}
    commands = [ctx.Queue() for _ in range(args.senders)]
    barrier, results = ctx.Barrier(args.senders), ctx.Queue()
    senders = [ctx.Process(target=sender_main, args=(addrs, a, args.groups_per_sender, args.group_size, args.tokens,
                                                     args.window, commands[a], barrier, results, keys_dir),
                           daemon=True)
               for a in range(args.senders)]
    for p in senders:
        p.start()
    n = args.groups_per_sender  # the raw side's call: what the senders send, in their order
    raw = RawLMDB([frames[a * n + i % n] for a in range(args.senders) for i in range(args.groups_per_call)],
                  args.commit_batch, work / "raw")
    learner = BatchClient(serve, request_timeout_s=120, curve=client_keys(keys_dir, "learner"))
    calls, resent, peak = [0], [0], [0]

    def sends_to(target: str) -> Callable[[int], Timed]:
        def send_all(r: int) -> Timed:
            if target == "buffer":
                drain(learner, min(DRAIN_GROUPS, len(raw.call)), deadline)
            for q in commands:
                q.put((f"r{r}c{calls[0]}", target, args.groups_per_call))
            calls[0] += 1
            res = collect(results, senders, deadline)
            resent[0] += sum(x[3] for x in res)
            return Timed(sum(x[2] for x in res), max(x[1] for x in res) - min(x[0] for x in res))

        return send_all

    def sampled(name: str, side: Callable[[int], Timed]) -> Callable[[int], Timed]:
        def call(r: int) -> Timed:
            deadline.check(f"round {r}, {name}" if r >= 0 else f"the warm-up, {name}")
            t = side(r)
            peak[0] = max(peak[0], disk_use(work))  # after a call, before the next drain: the stores at their most
            return t

        return call

    def say(r: int, t: dict[str, Timed]) -> None:
        print(f"round {r}: " + ", ".join(f"{n} {x.work:.0f} groups in {x.seconds:.2f}s" for n, x in t.items())
              + f"; ingest/raw {t['ingest'].rate / t['raw'].rate:.3f}, sink/raw {t['sink'].rate / t['raw'].rate:.3f}"
              + f"; disk peak {peak[0] / 1e6:.0f} MB", file=sys.stderr)

    sides = {name: sampled(name, side) for name, side in
             {"raw": raw.put_all, "ingest": sends_to("buffer"), "sink": sends_to("sink")}.items()}
    try:
        # One untimed call of each side first: the first writes of a run land in blocks the last run's deleted
        # files freed, which a virtual disk takes up to 3x faster (``RawLMDB``); whichever side ran first got them.
        for side in sides.values():
            side(-1)
        rounds = rotate(sides, args.rounds, args.min_round_s, on_round=say)
    finally:
        learner.close()
        raw.close()
        for q in commands:
            q.put(None)
        for p in senders:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        sink.kill()
    return {"rounds": rounds, "group_bytes": sum(len(f) for f in frames) / len(frames), "resent": resent[0],
            "stored": len(raw.call), "disk_peak_bytes": peak[0],
            "raw_cpu_s_per_group": [raw.cpu_s[r] / t["raw"].work for r, t in enumerate(rounds)]}


def ceiling_rate(sink_rate: float, lmdb_cpu_s: float, cores: int) -> float:
    """Groups/s of a buffer that did nothing but the raw side's LMDB writes, its transport costing what the sink
    arm's did: each group takes ``cores / sink_rate`` CPU-seconds of transport (the sink arm keeps every core
    busy) plus ``lmdb_cpu_s`` of writes, shared perfectly over ``cores``. An upper bound for any buffer."""
    return cores / (cores / sink_rate + lmdb_cpu_s)


def serve_latency(args: argparse.Namespace, serve: str, keys_dir: str, n_stored: int) -> dict[str, Any]:
    """One batch request timed to its bytes and to its decoded reply, then one ``get_batch``."""
    n = min(args.serve_groups, n_stored // 2)
    with BatchClient(serve, request_timeout_s=120, curve=client_keys(keys_dir, "learner")) as c:
        stats = c.stats()
        if stats["depth_groups"] != n_stored:
            raise BenchError(f"the buffer holds {stats['depth_groups']} groups after the rounds, not {n_stored}")
        t0 = time.perf_counter()
        req = BatchRequest(learner_version=0, n_groups=n, timeout_ms=60000)
        raw_reply = c._request(encode(req), 180, retries=0)  # bytes only: time the transfer alone
        t_bytes = time.perf_counter() - t0
        reply = decode(raw_reply, 1 << 40)
        t_decoded = time.perf_counter() - t0
        assert isinstance(reply, BatchReply) and len(reply.groups) == n
        t1 = time.perf_counter()
        reply2 = c.get_batch(0, n, 60)
        t_get_batch = time.perf_counter() - t1
        assert len(reply2.groups) > 0
    return {"stats": stats, "serve_groups": n, "reply_bytes": len(raw_reply), "t_bytes": t_bytes,
            "t_decoded": t_decoded, "t_get_batch": t_get_batch}


def report(args: argparse.Namespace, ingested: dict[str, Any], served: dict[str, Any], run: Run) -> dict[str, Any]:
    """The JSON line: the judged ratio, per-round throughputs (medians), against the paper's need, serving."""
    rounds: list[dict[str, Timed]] = ingested["rounds"]
    group_bytes = ingested["group_bytes"]
    ingest_gps, raw_gps, sink_gps = (statistics.median(t[n].rate for t in rounds) for n in ("ingest", "raw", "sink"))
    need = PAPER_SAMPLES_PER_STEP / STEP_SECONDS_ASSUMED
    sink = summarise([t["sink"].rate / t["raw"].rate for t in rounds], GOAL, name="sink_over_raw_lmdb")
    cores = os.cpu_count() or 1
    ceiling = [ceiling_rate(t["sink"].rate, c, cores) / t["raw"].rate
               for t, c in zip(rounds, ingested["raw_cpu_s_per_group"], strict=True)]
    return {
        "bench": "buffer", **summarise([t["ingest"].rate / t["raw"].rate for t in rounds], GOAL,
                                       name="ingest_over_raw_lmdb"),
        "rounds": args.rounds, "min_round_s": args.min_round_s, **run.common_fields(),
        "sink_over_raw_lmdb": sink["ratio"], "sink_over_raw_lmdb_iqr": sink["ratio_iqr"],
        "ingest_over_sink": round(statistics.median(t["ingest"].rate / t["sink"].rate for t in rounds), 4),
        "sink_groups_per_s": round(sink_gps, 1),
        "ceiling_over_raw_lmdb": round(statistics.median(ceiling), 4),
        "ceiling_over_raw_lmdb_range": [round(min(ceiling), 4), round(max(ceiling), 4)],
        "raw_cpu_ms_per_group": round(statistics.median(ingested["raw_cpu_s_per_group"]) * 1e3, 4),
        "senders": args.senders, "groups_per_call": args.senders * args.groups_per_call,
        "group_size": args.group_size, "tokens": args.tokens, "group_bytes": round(group_bytes),
        "curve": not args.no_curve, "commit_batch": args.commit_batch,
        "ingest_groups_per_s": round(ingest_gps, 1),
        "ingest_samples_per_s": round(ingest_gps * args.group_size, 1),
        "ingest_mb_per_s": round(ingest_gps * group_bytes / 1e6, 1),
        "raw_lmdb_groups_per_s": round(raw_gps, 1),
        "raw_lmdb_mb_per_s": round(raw_gps * group_bytes / 1e6, 1),
        **{f"{n}_s_rounds": [round(t[n].seconds, 6) for t in rounds] for n in ("ingest", "raw", "sink")},
        **{f"{n}_groups_rounds": [int(t[n].work) for t in rounds] for n in ("ingest", "raw", "sink")},
        "paper_need_samples_per_s": round(need, 1), "assumed_step_s": STEP_SECONDS_ASSUMED,
        "ingest_vs_paper_need": round(ingest_gps * args.group_size / need, 1), "target_vs_paper_need": 100,
        "serve_groups": served["serve_groups"], "serve_reply_mb": round(served["reply_bytes"] / 1e6, 1),
        "serve_latency_bytes_s": round(served["t_bytes"], 3),
        "serve_latency_decoded_s": round(served["t_decoded"], 3), "get_batch_s": round(served["t_get_batch"], 3),
        "resent": ingested["resent"], "ingest_commits": int(served["stats"]["ingest_commits"]),
        "capacity_groups": ingested["stored"], "capacity_bytes": ingested["capacity_bytes"],
        "disk_peak_mb": round(ingested["disk_peak_bytes"] / 1e6, 1), "max_wall_s": args.max_wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keep_freed_memory()  # the raw side's process allocates as the buffer's does
    run, deadline = Run(quick=args.quick), Deadline(args.max_wall_s)
    work = Path(tempfile.mkdtemp(prefix="vapo-bench-buffer-"))
    ingest, serve = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    keys_dir = "" if args.no_curve else str(generate_run_keys(work / "keys"))
    # The baseline's frames: the senders' groups, built alike and encoded once (not timed).
    frames = [encode(g) for a in range(args.senders)
              for g in build_groups(args.groups_per_sender, a, f"s{a}", args.group_size, args.tokens)]
    # One call's frames, each with room for its longer group_id at send time: the buffer holds one call.
    capacity_bytes = args.capacity_bytes or args.senders * args.groups_per_call * (max(map(len, frames)) + 256)
    proc = None
    try:
        proc = start_buffer(args, work, ingest, serve, keys_dir, capacity_bytes)
        print(f"buffer up; {args.senders} senders building {args.groups_per_sender} groups each", file=sys.stderr)
        ingested = ingest_rounds(args, frames, ingest, serve, keys_dir, work, deadline)
        served = serve_latency(args, serve, keys_dir, ingested["stored"])
        print(json.dumps(report(args, {**ingested, "capacity_bytes": capacity_bytes}, served, run)))
        return 0
    except BenchError as e:
        print(f"buffer benchmark failed after {time.monotonic() - deadline.start:.1f} s (buffer capacity: "
              f"{args.senders * args.groups_per_call} groups, {capacity_bytes} bytes): {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            stop_buffer(proc)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
