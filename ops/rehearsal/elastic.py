"""The rehearsal's engine-host check: every process of one engine host killed mid-run and the host brought
back, inside the ssh route's run (its engines and actors already on h2 and h3, so no run of its own).

While the host is down the learner keeps stepping on the other engine's groups (how many steps, at what rate
against the rate before); once it is back the launcher's probe restarts its engine and actor, which load the
newest weights and deliver groups again (within ``DELIVER_BOUND_S``); the run finishes with exit 0 and no
acknowledged group is lost (the buffer's own counters and group index, read-only while it runs).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import lmdb

from buffer.directory import inspect
from ops.rehearsal.cluster import Cluster
from ops.rehearsal.runs import Run

VICTIM = "h3"  # engine 1 and actor 1 (engine 0 on h2 serves the held-out evaluation)
VICTIM_ACTOR = 1
DOWN_STEPS = 3  # learner steps the run must make while the host is down
RATE_STEPS = 3  # steps at full strength before the kill, for the rate to compare with
# From the host's return to its actor's first group: the launcher's probe backoff (<= 30 s once the host has
# been down a while; ~8 s here), ssh, the actor's and its engine's start, the weights loaded from disk, one
# generation. SGLang's start alone takes 40-120 s on 2 busy cores.
DELIVER_BOUND_S = {"rollout_server": 120.0, "sglang": 300.0}
# The ssh route's run, long enough for the host's actor to deliver again inside it (56 s measured, bound 120 s)
# at ~1 step/s: the steps are the learner's, and one engine keeps up with it here.
TOTAL_STEPS = {"rollout_server": 120, "sglang": 200}


def overrides(engine: str) -> list[str]:
    """The ssh route's run with room for the check: more steps, evaluation and checkpoints only at the end."""
    n = TOTAL_STEPS[engine]
    return [f"learner.total_steps={n}", f"learner.eval_every={n}", f"learner.checkpoint_every={n}"]


def actor_groups(buffer_dir: Path, actor: int) -> int:
    """Groups the buffer has acknowledged from ``actor`` (its group index: every group_id ever acked)."""
    env = lmdb.open(str(buffer_dir), readonly=True, lock=True, max_dbs=8, subdir=True, readahead=False, map_size=0)
    try:
        prefix = f"a{actor}-".encode()
        with env.begin() as txn:
            cur = txn.cursor(db=env.open_db(b"gindex", txn=txn, create=False))
            n = 0
            if cur.set_range(prefix):
                for key in cur.iternext(values=False):
                    if not key.startswith(prefix):
                        break
                    n += 1
        return n
    finally:
        env.close()


def acked_lost(buffer_dir: Path) -> dict[str, int]:
    """Acknowledged groups unaccounted for: every stored group was served, is waiting, or was dropped stale
    (``stale_dropped`` less the groups refused stale on arrival, which were never stored)."""

    counters = inspect(buffer_dir)["counters"]
    env = lmdb.open(str(buffer_dir), readonly=True, lock=True, max_dbs=8, subdir=True, readahead=False, map_size=0)
    try:
        with env.begin() as txn:
            cur = txn.cursor(db=env.open_db(b"gindex", txn=txn, create=False))
            refused_stale = sum(1 for v in cur.iternext(keys=False) if v[:1] == b"X")
    finally:
        env.close()
    stored_stale = counters["stale_dropped"] - refused_stale
    lost = counters["accepted_groups"] - counters["served_groups"] - counters["depth_groups"] - stored_stale
    return {"accepted": counters["accepted_groups"], "served": counters["served_groups"],
            "waiting": counters["depth_groups"], "stale_dropped_stored": stored_stale, "lost": lost}


def _step_times(run: Run) -> list[tuple[int, float]]:
    return [(int(r.get("weight_version", r.get("step", 0))), float(r["time"])) for r in run.records("learner_step")
            if isinstance(r.get("time"), int | float)]


def _rate(steps: list[tuple[int, float]], first: int, last: int) -> float | None:
    """Learner steps per second from step ``first`` to step ``last`` (the steps' own times)."""
    inside = [(s, t) for s, t in steps if first <= s <= last]
    if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
        return None
    return round((inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1]), 3)


def _said(run: Run, pattern: str) -> str | None:
    m = re.search(pattern, run.log.read_text(errors="replace"))
    return m.group(0) if m else None


def engine_host_down(c: Cluster, run: Run, wait: Any, engine: str) -> dict[str, Any]:
    """Kill every process of ``VICTIM`` mid-run, bring it back once the learner has made ``DOWN_STEPS``
    steps without it, and time its actor's return. ``wait(what, ok, timeout_s)`` polls against the run."""
    buffer_dir = run.buffer_path()
    s0 = run.steps()
    wait("steps at full strength before the kill", lambda: run.steps() >= s0 + RATE_STEPS, 240)
    t_kill = time.time()
    s_kill = run.steps()
    killed = c.kill_host(VICTIM)
    wait(f"{DOWN_STEPS} steps with {VICTIM} down", lambda: run.steps() >= s_kill + DOWN_STEPS, 240)
    wait("the launcher's word that the host is lost", lambda: _said(run, f"LOST ENGINE HOST {VICTIM}"), 60)
    t_back = time.time()
    s_back = run.steps()
    groups_back = actor_groups(buffer_dir, VICTIM_ACTOR)
    c.restart_host(VICTIM)
    bound = DELIVER_BOUND_S[engine]
    delivered_s: float | None = None
    try:
        wait(f"actor {VICTIM_ACTOR} on {VICTIM} to deliver again",
             lambda: actor_groups(buffer_dir, VICTIM_ACTOR) > groups_back, bound)
        delivered_s = round(time.time() - t_back, 1)
    except RuntimeError:
        pass  # reported below (delivered_after_return_s None)
    steps = _step_times(run)
    return {
        "host": VICTIM, "processes_killed": killed, "steps_at_kill": s_kill, "steps_while_down": s_back - s_kill,
        "down_s": round(t_back - t_kill, 1),
        "step_rate_before": _rate(steps, s0, s_kill), "step_rate_while_down": _rate(steps, s_kill, s_back),
        "delivered_after_return_s": delivered_s, "deliver_bound_s": bound,
        "launcher_said_lost": (_said(run, f"LOST ENGINE HOST {VICTIM}[^\n]*") or "")[:300] or None,
        "launcher_said_back": (_said(run, f"engine host {VICTIM} answers again[^\n]*") or "")[:300] or None,
        "buffer_dir": str(buffer_dir),
        # What the buffer did with the lost actor's credit (released when its connection closed, or when
        # the restarted actor's first request came on a new connection).
        "buffer_said": _buffer_said(run),
    }


def _buffer_said(run: Run) -> list[str]:
    try:
        text = (run.dir / "logs" / "buffer.log").read_text(errors="replace")
    except OSError:
        return []
    return [ln[:200] for ln in text.splitlines() if "releas" in ln][:10]


def verdict(check: dict[str, Any], run: Run, total: int) -> dict[str, Any]:
    """The check's figures completed once the run is over: exit 0, every step, nothing acked lost."""
    check.update(rc=run.rc, steps=run.steps(), total_steps=total)
    buffer_dir = check.pop("buffer_dir", None)
    check["acked"] = acked_lost(Path(buffer_dir)) if buffer_dir else None
    check["ok"] = (run.rc == 0 and run.steps() >= total and check.get("steps_while_down", 0) >= DOWN_STEPS
                   and check.get("delivered_after_return_s") is not None and check["acked"] is not None
                   and check["acked"]["lost"] == 0)
    return check
