"""Benchmark: how much generation one weight update costs a saturated engine, drain (disk) vs in-place pause.

    .venv/bin/python -m ops.bench.update_stall [--batch 32 --updates 6 --interval-s 4 --reps 2]

The training runs on this machine cannot show it: there the learner is the bottleneck and engines are idle
when an update lands. Here generation is the bottleneck: one ``python -m actors.rollout_server`` on the
shipped base ``ops/bases/chain-tiny`` (0.6M params, char tokenizer) with ``--max-batch-size`` C, and a client
that keeps C requests in flight at all times (a new one as soon as one finishes). Responses are long and of
varied length (``max_new_tokens`` uniform in [--min-tokens, --max-tokens], ``ignore_eos``, temperature 1),
so a drain has to wait for the longest running request. New versions: chain-tiny's weights, every weight
+ 1e-4 per version.

Three modes, each a phase of the same length with the same number of updates (the first after a warm-up,
then one every --interval-s), interleaved (baseline, wait, in_place, repeated --reps times) because timings
on this shared machine are noisy:
- ``baseline``: no updates.
- ``wait``: ``POST /update_weights_from_disk`` of a version written beforehand (``learner.weights.write_version``,
  off the clock). The engine drains: the update waits for the running requests, new ones wait behind it
  (SGLang's model-update writer lock).
- ``in_place``: a distributed push (``weight_sync.push_version``, ``pause="in_place"``): running requests keep
  their KV and continue on the new weights.

Per mode (each rep and the mean over reps):
- ``tokens_per_s``: output tokens generated during the phase / its length. At the end of a phase the running
  requests are aborted so that their partial outputs count too.
- ``lost_s_per_update`` = (baseline_rate x duration - tokens) / baseline_rate / updates: seconds of full-engine
  generation each update cost (baseline_rate: the same rep's baseline).
  On this shared machine the rate drifts by ~10% between phases, as much as the effect: read it with
- ``lost_s_per_update_occupancy`` = (idle_whole - baseline's idle_whole) x duration / updates: the same loss
  from the engine's occupancy, free of that drift (but blind to a part-empty batch stepping faster).
- ``idle_after_update``: mean of 1 - running_requests / C (1 while paused: paused requests count as running but
  generate nothing) over [update start, update start + 3 s], from ``GET /get_server_info`` sampled every
  ~50 ms; ``idle_whole``: the same over the whole phase.
- ``min_running_during_update``: the fewest running requests seen while an update call was in flight. A drain
  empties the engine for one scheduler iteration only (the update applies and the waiting requests are
  admitted at once), so the sampling sees it run down, rarely the 0 itself; that no request spans a disk
  update (below) is the proof that it emptied.
- ``update_latency_s``: mean update call (start to return).
- ``requests_spanning_versions``: requests (finished or cut at the phase end) whose tokens came from more than one weight version.

``idle_ratio`` = in_place's lost_s_per_update / wait's, ``idle_ratio_occupancy`` the same from
occupancy, both from the means over reps (null when wait's mean loss is not positive). Judged as every ratio
benchmark here (``ops/bench/measure.py``): ``in_place_over_wait_lost_occupancy`` = in_place's
``lost_s_per_update_occupancy`` over wait's, per rep (reps where the drain lost nothing measurable left out),
**goal <= 0.5**: median, range, interquartile range and verdict (``unclear`` when the interquartile range
straddles the goal or under 5 judged reps); the same per rep from tokens beside it (``ratio_tokens_rounds``,
not judged). Occupancy, because on CPU the token loss is noise: the baseline rate moved by up to a third between
the phases of one run (5,900-7,860 tokens/s; 2-core EPYC, four runs of the defaults), while a drain cost
0.31-0.59 s of occupancy per update, 7-13 % of a phase, and a part-empty CPU batch steps faster, so fewer
tokens are lost than slots stood empty. One run's token losses per update read -0.65 to +0.18 s for the drain;
the token ratios -17.9 to 3.6 (most reps left out as not positive); occupancy ratios -0.01 to 0.10. On a GPU a
decode step costs about the same with one request or 32 (memory-bound), so an empty slot is a lost token and
the two agree. ``loadavg``: the
machine's 1-minute load at the end; ``machine``, ``load_at_start``/``load_at_end`` as every ratio benchmark.
Prints one JSON line.

The engine is started through ``actors.rollout_server.process.RolloutServerProcess`` (the worker's own
launcher) rather than ``weight_sync.start_engine``, which fixes the batch at 4: a saturated engine here
needs C slots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from actors.rollout_server.process import RolloutServerProcess
from common.config import load_config
from common.modeling import load_model
from common.sglang_client import GenerateOutput, SGLangClient
from learner.weight_push import WeightPusher, bucket_plan
from learner.weights import write_version
from ops.bench import weight_sync
from ops.bench.measure import MIN_ROUNDS, Run, summarise

GOAL = 0.5  # an in-place update costs at most half the generation a drain costs

BASE = weight_sync.REPO / "ops" / "bases" / "chain-tiny"
PROMPT = [1, 10, 11, 12, 13]  # any chars: ignore_eos makes the length max_new_tokens
MODES = ("baseline", "wait", "in_place")
WINDOW_S = 3.0  # the idle window after each update start

Update = Callable[[int], Awaitable[None]]


@dataclass
class Phase:
    """What one mode's phase saw; times are seconds from the phase start."""

    tokens: int = 0
    elapsed: float = 0.0
    outs: list[GenerateOutput] = field(default_factory=list)
    samples: list[tuple[float, int, bool]] = field(default_factory=list)  # (t, running_requests, paused)
    updates: list[tuple[float, float]] = field(default_factory=list)  # (start, latency)


async def keep_full(client: SGLangClient, stop: asyncio.Event, rng: random.Random, lo: int, hi: int,
                    phase: Phase) -> None:
    """One of C request slots: a new request whenever the last finishes, until ``stop``."""
    while not stop.is_set():
        params = {"max_new_tokens": rng.randint(lo, hi), "temperature": 1.0, "ignore_eos": True}
        out = (await client.generate([PROMPT], params, return_logprob=False))[0]
        phase.tokens += out.completion_tokens
        phase.outs.append(out)


async def sample_running(client: SGLangClient, stop: asyncio.Event, t0: float, every_s: float, phase: Phase) -> None:
    while not stop.is_set():
        _, info, _ = await client._request("GET", "get_server_info", timeout_s=30)
        phase.samples.append((time.monotonic() - t0, int(info["running_requests"]), bool(info.get("paused"))))
        await asyncio.sleep(every_s)


async def run_updates(update: Update, t0: float, args: argparse.Namespace, phase: Phase) -> None:
    for k in range(args.updates):
        await asyncio.sleep(max(0.0, t0 + args.warmup_s + k * args.interval_s - time.monotonic()))
        start = time.monotonic()
        await update(k)
        phase.updates.append((start - t0, time.monotonic() - start))


async def run_phase(client: SGLangClient, args: argparse.Namespace, update: Update | None, seed: int) -> Phase:
    """Keep the engine full for the phase's length (longer if an update is still in flight), then abort the
    running requests so that their partial outputs count."""
    phase, stop, rng = Phase(), asyncio.Event(), random.Random(seed)  # same seed: same lengths in every mode
    t0 = time.monotonic()
    workers = [asyncio.ensure_future(keep_full(client, stop, rng, args.min_tokens, args.max_tokens, phase))
               for _ in range(args.batch)]
    sampler = asyncio.ensure_future(sample_running(client, stop, t0, args.sample_s, phase))
    updater = asyncio.ensure_future(run_updates(update, t0, args, phase)) if update else None
    try:
        await asyncio.sleep(phase_length(args))
        if updater is not None:
            await updater  # a drain still in progress ends the phase late; the rate uses the real length
        stop.set()
        phase.elapsed = time.monotonic() - t0
        while not all(w.done() for w in workers):  # a worker may have sent its request after the abort
            await client.abort_request(abort_all=True)
            await asyncio.wait(workers, timeout=0.5)
        for w in workers:
            w.result()  # a failed request fails the bench
        await sampler
    finally:
        stop.set()
        for t in (*workers, sampler, *([updater] if updater else [])):
            t.cancel()
    return phase


def phase_length(args: argparse.Namespace) -> float:
    """Warm-up, the updates, and one interval after the last so that its cost lands inside the phase."""
    return args.warmup_s + args.updates * args.interval_s


def summarize(phase: Phase, c: int, base: dict[str, Any] | None, n_updates: int) -> dict[str, Any]:
    """One phase's figures; ``base``: the same rep's baseline summary (None for the baseline itself)."""
    rate = phase.tokens / phase.elapsed
    # A paused engine's requests count as running but generate nothing: idle while paused.
    idle = [(t, 1.0 if paused else 1 - r / c) for t, r, paused in phase.samples]
    in_window = [x for t, x in idle if any(s <= t <= s + WINDOW_S for s, _ in phase.updates)]
    during = [r for t, r, _ in phase.samples if any(s <= t <= s + lat for s, lat in phase.updates)]
    idle_whole = statistics.fmean(x for _, x in idle)
    out: dict[str, Any] = {
        "tokens": phase.tokens, "seconds": round(phase.elapsed, 2), "tokens_per_s": round(rate, 1),
        "requests": len(phase.outs), "idle_whole": round(idle_whole, 4),
        "requests_spanning_versions": sum(len({v for v, _ in o.version_spans or []}) > 1 for o in phase.outs),
    }
    if base is not None:
        lost = (base["tokens_per_s"] * phase.elapsed - phase.tokens) / base["tokens_per_s"] / n_updates
        out.update({
            "updates": len(phase.updates), "lost_s_per_update": round(lost, 3),
            # The same loss from occupancy: free of the rate's drift on a shared machine, blind to a fuller
            # batch stepping slower.
            "lost_s_per_update_occupancy": round((idle_whole - base["idle_whole"]) * phase.elapsed / n_updates, 3),
            "update_latency_s": round(statistics.fmean(lat for _, lat in phase.updates), 3),
            "idle_after_update": round(statistics.fmean(in_window), 3) if in_window else None,
            "min_running_during_update": min(during) if during else None,
        })
    return out


def mean_of(reps: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Field-wise mean over reps of one mode (numeric fields only; one that some rep lacks is left out)."""
    rows = [r[mode] for r in reps]
    out: dict[str, Any] = {}
    for k, v in rows[0].items():
        vals = [row.get(k) for row in rows]
        if isinstance(v, int | float) and all(isinstance(x, int | float) for x in vals):
            out[k] = round(statistics.fmean(vals), 3)
    return out


async def start(tmp: Path, batch: int, key: str) -> tuple[RolloutServerProcess, SGLangClient]:
    cfg = load_config(None, [f"engine.max_batch_size={batch}", "engine.threads=1", "engine.base_port=0",
                             "engine.batch_wait_ms=0", "engine.startup_timeout_s=300"])
    proc = RolloutServerProcess(cfg, 0, tmp / "engine.log")
    url = await proc.start(str(BASE), 0, api_key=key)
    return proc, SGLangClient(url, api_key=key, timeout_s=600)


class Versions:
    """The new versions, numbered on from the engine's 0, and the two ways of delivering them."""

    def __init__(self, model: torch.nn.Module, client: SGLangClient, pusher: WeightPusher, root: Path) -> None:
        self.model, self.client, self.pusher, self.root = model, client, pusher, root
        self.version = 0

    def disk(self, n: int) -> Update:
        """``n`` versions written now (off the clock: only the engine's load is timed), loaded from disk."""
        first = self.version + 1
        for _ in range(n):
            self.version += 1
            weight_sync.perturb(self.model, 1e-4)
            write_version(self.root, self.version, self.model, None)

        async def update(k: int) -> None:
            await self.client.update_weights_from_disk(str(self.root / f"v{first + k}"), weight_version=first + k)
        return update

    def push(self, n: int) -> Update:
        """``n`` versions, each pushed with the in-place pause."""
        first, self.version = self.version + 1, self.version + n

        async def update(k: int) -> None:
            weight_sync.perturb(self.model, 1e-4)  # ~1 ms on 0.6M params; small enough for a dozen versions
            res, reports = await weight_sync.push_version(self.pusher, self.model, first + k, [self.client], None)
            bad = [r for r in reports if isinstance(r, BaseException)]
            if bad or not res.broadcast:
                raise RuntimeError(f"push of v{first + k} failed: {bad or res}")
            await asyncio.to_thread(self.pusher.settle)  # the final bucket's broadcast, before the next push
        return update


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    measured = Run()
    model = load_model(BASE)
    key = secrets.token_hex(16)
    proc, client = await start(tmp, args.batch, key)
    pusher: WeightPusher | None = None
    try:
        pusher = WeightPusher(4 << 20, "gloo", timeout_s=300)  # one bucket holds the whole model
        pusher.plan = bucket_plan(model, pusher.bucket_bytes)
        await weight_sync.open_group(pusher, [client])
        versions = Versions(model, client, pusher, tmp / "weights")
        reps: list[dict[str, Any]] = []
        for rep in range(args.reps):
            row: dict[str, Any] = {}
            for mode in MODES:
                make = {"baseline": None, "wait": versions.disk, "in_place": versions.push}[mode]
                update = make(args.updates) if make is not None else None
                phase = await run_phase(client, args, update, seed=args.seed + rep)
                row[mode] = summarize(phase, args.batch, row.get("baseline"), args.updates)
            reps.append(row)
        return report(args, reps, measured)
    finally:
        if pusher is not None:
            pusher.close()
        await client.close()
        await proc.stop()


def rep_ratios(reps: list[dict[str, Any]], key: str) -> list[float]:
    """in_place's ``key`` over wait's, per rep; a rep whose drain lost nothing measurable (wait's ``key`` not
    positive) is left out: a ratio of two noise terms says nothing."""
    return [r["in_place"][key] / r["wait"][key] for r in reps
            if (r["wait"].get(key) or 0) > 0 and r["in_place"].get(key) is not None]


def report(args: argparse.Namespace, reps: list[dict[str, Any]], run: Run) -> dict[str, Any]:
    mean = {m: mean_of(reps, m) for m in MODES}

    def ratio(key: str) -> float | None:
        """The same ratio of the means over reps; None unless the drain lost something measurable."""
        of_means = rep_ratios([mean], key)
        return round(of_means[0], 3) if of_means else None

    per_rep = rep_ratios(reps, "lost_s_per_update_occupancy")
    judged = summarise(per_rep, GOAL, higher_is_better=False, name="in_place_over_wait_lost_occupancy")
    return {
        "bench": "update_stall", **judged, "rounds": len(per_rep), **run.common_fields(),
        "ratio_tokens_rounds": [round(x, 4) for x in rep_ratios(reps, "lost_s_per_update")],
        "model": "ops/bases/chain-tiny", "batch": args.batch, "updates": args.updates,
        "interval_s": args.interval_s, "warmup_s": args.warmup_s, "tokens": [args.min_tokens, args.max_tokens],
        "phase_s": phase_length(args), "reps": reps, "mean": mean,
        "idle_ratio": ratio("lost_s_per_update"), "idle_ratio_occupancy": ratio("lost_s_per_update_occupancy"),
        "loadavg": round(os.getloadavg()[0], 2), "engine_torch_threads": 1,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="engine --max-batch-size = requests kept in flight")
    ap.add_argument("--updates", type=int, default=6, help="updates per phase")
    ap.add_argument("--interval-s", type=float, default=4.0, help="seconds between update starts")
    ap.add_argument("--warmup-s", type=float, default=3.0, help="seconds of generation before the first update")
    ap.add_argument("--min-tokens", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--reps", type=int, default=MIN_ROUNDS, help="times the three modes run, interleaved")
    ap.add_argument("--sample-s", type=float, default=0.05, help="/get_server_info sampling period")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the bench, print and return its JSON line."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="update_stall_") as d:
        out = asyncio.run(run(args, Path(d)))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
