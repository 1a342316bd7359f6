"""Which critic the actor's advantages read: ``algo.actor_values=post_update`` (the critic just fitted to this
batch, the current default) against ``pre_update`` (the values from before the critic update, verl's order),
on the default task and on the long-horizon one, 2 seeds each at equal samples (40 steps x 32 prompts x
G = 8 = 10,240 trained samples per run; value pretraining is the same in both arms). Run by

    .venv/bin/python -m ops.bench.suites.experiments --suite actor_values           # run what is missing, then summarise
    .venv/bin/python -m ops.bench.suites.experiments --suite actor_values --list
    .venv/bin/python -m ops.bench.suites.experiments --suite actor_values --report-only

Root ``runs/exp-actor-values``; every run is a plain ``ops/launch.sh`` as in the other suites (resumable the
same way). Both arms are run here, on the same code, rather than compared with older runs of the default.
The summary is one JSON line: per task and arm the final held-out avg@8 (mean, and each seed), the mean
critic EV the learner reported (with ``pre_update`` it is the EV of values no update has seen; with
``post_update`` it is read from the critic update's own forwards, so the two arms' EVs are not measured
the same way) and the mean engine/learner mismatch KL. The default flips to whichever arm wins on both
tasks by more than the seed spread; otherwise ``post_update`` stays.

The suite also measures each other learner-maths default on the default task against the run that turns it off
(2 seeds, same budget, the ``post_update`` arm as the reference): ``no_dual_clip`` (``algo.clip_ratio_c=0``,
no cap on the ratio for negative advantages) and ``truncated_keep`` (``algo.truncated=keep``: a response cut at
``actors.max_new_tokens`` keeps its reward and can be a positive), so no default change regresses silently.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ops.bench.reports.run_records import read_records

STEPS = 40
SEEDS = (0, 1)
TASKS = {"default": "ops/configs/default.yaml", "long": "ops/configs/long.yaml"}
ARMS = ("post_update", "pre_update")
# Default-task-only arms: one learner-maths default turned off each (the reference is post_update, all defaults on).
# The reference arm's actor_values is pinned so that these arms compare with it whatever the default is.
DEFAULT_CHANGES: dict[str, tuple[str, ...]] = {
    "no_dual_clip": ("algo.actor_values=post_update", "algo.clip_ratio_c=0"),
    "truncated_keep": ("algo.actor_values=post_update", "algo.truncated=keep"),
}


def name(task: str, arm: str) -> str:
    return f"av_{task}_{arm}"


def experiments(Experiment: Any) -> list[Any]:
    """The 2 tasks x 2 arms, then the default-task change arms, each with seeds 0 and 1."""
    arms = [Experiment(name(t, a), "actor_values", f"VAPO on {t}, algo.actor_values={a}", cfg,
                       (f"algo.actor_values={a}",), seeds=SEEDS, steps=STEPS)
            for t, cfg in TASKS.items() for a in ARMS]
    return arms + [Experiment(name("default", a), "actor_values", f"VAPO on default, {' '.join(ov)}",
                              TASKS["default"], ov, seeds=SEEDS, steps=STEPS) for a, ov in DEFAULT_CHANGES.items()]


def summary(root: Path, load_run: Any) -> dict[str, Any]:
    """Per ``<task>/<arm>``: seeds done, final avg@8 (mean, per seed), mean reported EV, mean mismatch KL."""
    out: dict[str, Any] = {}
    arms = [(t, a) for t in TASKS for a in ARMS] + [("default", a) for a in DEFAULT_CHANGES]
    for t, a in arms:
        accs, evs, kls = [], [], []
        for s in SEEDS:
            d = root / f"{name(t, a)}-s{s}"
            run = load_run(d)
            if run is None:
                continue
            accs.append(run.final(STEPS)["acc"])
            evs += [r["ev"] for r in run.steps if r.get("ev") is not None]
            kls += [float(rec["mismatch_kl"]) for rec in read_records(d / "metrics.jsonl", "learner_step")
                    if rec.get("mismatch_tokens", 0) > 0]
        out[f"{t}/{a}"] = {
            "seeds_done": len(accs), "final_avg_at_8": round(statistics.fmean(accs), 4) if accs else None,
            "per_seed": [round(x, 4) for x in accs],
            "ev_mean": round(statistics.fmean(evs), 4) if evs else None,
            "mismatch_kl_mean": round(statistics.fmean(kls), 6) if kls else None,
        }
    return out
