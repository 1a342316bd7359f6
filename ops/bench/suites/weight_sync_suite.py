"""Not draining the engines on a weight update, measured: ``wait`` (the disk path, in-flight requests finish
on the old weights before the engine loads: a drain) against ``in_place`` (the distributed push, running
requests paused with their KV cache and continued on the new weights) on ``ops/configs/long.yaml``
(responses 49-400 tokens), 2 seeds each at equal samples. Run by

    .venv/bin/python -m ops.bench.suites.experiments --suite weight_sync           # run what is missing, then summarise
    .venv/bin/python -m ops.bench.suites.experiments --suite weight_sync --list
    .venv/bin/python -m ops.bench.suites.experiments --suite weight_sync --report-only

Root ``runs/exp-weight-sync``; every run is a plain ``ops/launch.sh`` as in the other suites (resumable the
same way). Hours of compute on 2 cores (4 runs of ``STEPS`` steps). The summary is one JSON line, per arm:
the final held-out avg@8 (mean and each seed), trained samples per second, the engines' update stall as a
fraction of their wall time (``wait``: publish → serving, summed over versions, which bounds the drain;
``in_place``: the pauses the actors measured) and the learner's mean and max sample staleness (a sample's
staleness counts from its oldest token). Goal: ``in_place``'s stall at most half of ``wait``'s, with no
loss in held-out accuracy outside the seed spread.

In that setting the engines wait for the learner (the actors' prompts spend ~10x the wall time waiting for
buffer credit), so an update lands on a mostly idle engine and the drain's cost cannot show. The
engine-bound pair (``ENGINE_BOUND``, opt-in: not run unless named) makes generation the bottleneck:

- ``buffer.max_staleness=4``: the admission capacity is ``max_staleness x batch_groups + pending`` groups
  (``buffer.credits.admission_capacity``), 4 x 32 + 32 = 160 instead of 64, so credit runs out only once
  the buffer holds four steps of data, which a learner faster than the engine never lets happen;
- ``learner.off_policy=decoupled``: samples up to 4 versions old are trained with AReaL's recomputed
  proximal policy instead of the raw behaviour ratio;
- ``actors.prompts_in_flight=32`` (credit per actor then up to 64): 256 sequences at the engine at once
  (``engine.max_batch_size`` 256), so the engine has work whenever credit allows.

    .venv/bin/python -m ops.bench.suites.experiments --suite weight_sync --only ws_long_wait_engine_bound ws_long_in_place_engine_bound
    .venv/bin/python -m ops.bench.suites.experiments --suite weight_sync --only ws_long_wait_engine_bound ws_long_in_place_engine_bound --list

Measured (4 runs, 8-9.5 min each on 2 lightly loaded cores): the pair did not make the engines the
bottleneck here either. Each actor's prompts still waited for credit ~22x the wall time (summed over its 64
prompts in flight), because on 2 shared cores VAPO's learner, not generation, sets the pace even 4 versions
ahead; the stall fractions stayed at 0.12-0.14% for both arms. What a saturated engine loses per update is
measured directly by ``ops/bench/update_stall.py`` (docs/RESULTS.md).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ops.bench.reports.run_records import read_records

STEPS = 40
SEEDS = (0, 1)
CONFIG = "ops/configs/long.yaml"
ARMS: dict[str, tuple[str, ...]] = {
    "wait": ("learner.weight_transport=disk", "actors.weight_sync=wait"),
    "in_place": ("learner.weight_transport=distributed", "actors.push_pause=in_place"),
}
# Generation the bottleneck (module docstring); the same overrides for both arms of the pair.
ENGINE_BOUND_OVERRIDES = ("buffer.max_staleness=4", "learner.off_policy=decoupled", "actors.prompts_in_flight=32")
ENGINE_BOUND: dict[str, tuple[str, ...]] = {f"{a}_engine_bound": (*ov, *ENGINE_BOUND_OVERRIDES) for a, ov in ARMS.items()}
ALL_ARMS = {**ARMS, **ENGINE_BOUND}


def name(arm: str) -> str:
    return f"ws_long_{arm}"


# Run only when named (``--only``): their cost is not measured yet.
OPT_IN = frozenset(name(a) for a in ENGINE_BOUND)


def experiments(Experiment: Any) -> list[Any]:
    return [Experiment(name(a), "weight_sync", f"VAPO on long, weight updates {a}", CONFIG, ov, seeds=SEEDS, steps=STEPS)
            for a, ov in ALL_ARMS.items()]


def _actor_done(d: Path) -> list[dict[str, Any]]:
    out = []
    for log in sorted((d / "logs").glob("actor-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("ACTOR DONE "):
                out.append(json.loads(line.split(" ", 2)[2]))
    return out


def summary(root: Path, load_run: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in ALL_ARMS:
        accs, rates, stalls, st_mean, st_max = [], [], [], [], []
        for s in SEEDS:
            d = root / f"{name(arm)}-s{s}"
            run = load_run(d)
            if run is None:
                continue
            accs.append(run.final(STEPS)["acc"])
            steps = read_records(d / "metrics.jsonl", "learner_step")
            if steps:
                span = steps[-1]["time"] - steps[0]["time"]
                rates.append(sum(r.get("samples", 0) for r in steps[1:]) / span if span > 0 else 0.0)
                st_mean.append(statistics.fmean(r.get("staleness_mean", 0.0) for r in steps))
                st_max.append(max(r.get("staleness_max", r.get("staleness_mean", 0.0)) for r in steps))
            for a in _actor_done(d):
                stall = a.get("push_pause_ms", 0) / 1000 if arm.startswith("in_place") else sum(a.get("weight_sync_latency_s", []))
                if a.get("elapsed_s"):
                    stalls.append(stall / a["elapsed_s"])
        out[arm] = {"seeds_done": len(accs), "final_avg_at_8": round(statistics.fmean(accs), 4) if accs else None,
                    "per_seed": [round(x, 4) for x in accs],
                    "samples_per_s": round(statistics.fmean(rates), 3) if rates else None,
                    "engine_update_stall_fraction": round(statistics.fmean(stalls), 4) if stalls else None,
                    "staleness_mean": round(statistics.fmean(st_mean), 3) if st_mean else None,
                    "staleness_max": max(st_max) if st_max else None}
    return out
