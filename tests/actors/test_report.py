"""actors.report: the ``ACTOR READY``/``ACTOR DONE`` lines (one write each, so sibling workers sharing a pipe
never run their lines together) and the ACTOR DONE counters: their order, each counter's one meaning, the
push counters once a push arrived."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from actors.report import ZEROED_METRICS, GroupCounts, LinkCounts, done_counters
from common.metrics import Metrics

_EMITTER = """
import sys
from actors.report import emit_tagged
sys.stdin.readline()  # start together, so the writes of all siblings overlap
for n in range(4000):
    emit_tagged("ACTOR READY", {"actor_id": int(sys.argv[1]), "n": n, "engine_url": "http://127.0.0.1:41013" * 3})
"""


def test_sibling_workers_sharing_an_unbuffered_stdout_never_run_their_lines_together() -> None:
    # `python -m actors` starts its workers with the parent's stdout; PYTHONUNBUFFERED (set by the launcher) makes
    # each write reach the pipe at once, so a tagged line must be one write or siblings' lines interleave.
    rd, wr = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _EMITTER, str(i)], stdin=subprocess.PIPE, stdout=wr, env=env)
             for i in range(3)]
    os.close(wr)
    for p in procs:
        p.stdin.write(b"go\n")
        p.stdin.close()
    with os.fdopen(rd, "rb") as out:
        lines = out.read().decode().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    seen = [json.loads(line.removeprefix("ACTOR READY ")) for line in lines if line.startswith("ACTOR READY {")]
    assert len(seen) == len(lines) == 3 * 4000
    assert sorted((d["actor_id"], d["n"]) for d in seen) == [(i, n) for i in range(3) for n in range(4000)]


def test_actor_done_counters_keep_their_order_and_show_push_counters_after_a_push() -> None:
    link = LinkCounts(engine_restarts=1, weight_loads=2)
    assert list(done_counters(GroupCounts(groups=3), link)) == [
        "groups", "samples", "tokens", "positives", "resubmits", "engine_restarts", "weight_loads",
        "weight_sync_failures", "skipped", "duplicates", "not_served", "reward_errors"]
    link.weight_pushes, link.push_pause_ms = 1, 40
    counters = done_counters(GroupCounts(groups=3), link)
    assert list(counters)[-3:] == ["weight_pushes", "push_pause_ms", "reward_errors"]
    assert counters["groups"] == 3 and counters["weight_loads"] == 2 and counters["push_pause_ms"] == 40


def test_link_counts_show_push_counters_only_once_a_push_arrived() -> None:
    assert LinkCounts(weight_loads=3, weight_sync_failures=1).as_dict() == {
        "engine_restarts": 0, "weight_loads": 3, "weight_sync_failures": 1}
    pushed = LinkCounts(weight_loads=1, weight_pushes=2, push_pause_ms=55)
    assert pushed.as_dict() == {"engine_restarts": 0, "weight_loads": 1, "weight_sync_failures": 0,
                                "weight_pushes": 2, "push_pause_ms": 55}  # loads and pushes counted apart


def test_every_series_shown_from_the_start_is_an_actor_metric() -> None:
    metrics = Metrics("actor")
    for name in ZEROED_METRICS:
        series = getattr(metrics, name).labels(actor="0")  # a declared metric with only the actor label
        assert series is not None
