"""Shared by the tests of the benchmarks' ``--quick`` modes: run one and read its JSON line, and check the fields
every ratio benchmark shares (ops/bench/measure.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
COMMON = ("bench", "ratio_name", "ratio", "ratio_rounds", "ratio_range", "ratio_iqr", "goal", "goal_value",
          "higher_is_better", "verdict", "rounds", "quick", "machine", "load_at_start", "load_at_end")


def run_quick(args: list[str], timeout_s: float) -> dict[str, Any]:
    p = subprocess.run([sys.executable, *args, "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stdout[-2000:]  # one JSON line, nothing else on stdout
    return json.loads(lines[0])


def check_common(line: dict[str, Any], bench: str, name: str, goal: str) -> None:
    """The shared fields: the judged ratio over 2 rounds, no verdict from a quick run, machine and load."""
    assert line["bench"] == bench
    check_ratio(line, name, goal)
    assert line["quick"] is True and line["rounds"] == 2
    assert line["machine"]["cpu"] and isinstance(line["machine"]["cpu_flags"], list) and line["machine"]["cpus"] >= 1
    assert len(line["load_at_start"]) == 3 and len(line["load_at_end"]) == 3


def check_ratio(line: dict[str, Any], name: str, goal: str) -> None:
    """One judged ratio of 2 rounds: consistent median, range and quartiles; no verdict."""
    missing = [k for k in COMMON if k not in line and k not in ("bench", "rounds", "quick", "machine", "load_at_start",
                                                                "load_at_end")]
    assert not missing, missing
    assert (line["ratio_name"], line["goal"]) == (name, goal) and len(line["ratio_rounds"]) == 2
    assert all(math.isfinite(x) and x >= 0 for x in line["ratio_rounds"])
    lo, hi = line["ratio_range"]
    q1, q3 = line["ratio_iqr"]
    assert lo <= q1 <= line["ratio"] <= q3 <= hi and [lo, hi] == sorted(line["ratio_rounds"])
    assert line["verdict"] == "unclear"  # 2 rounds are too few to judge
