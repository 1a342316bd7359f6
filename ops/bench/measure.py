"""The measuring discipline every ratio benchmark under ``ops/bench`` shares: baseline and subject interleaved
in rounds, the ratio judged by the median of per-round ratios and its spread, the machine and its load.

A ratio measured once on a shared machine mostly measures the machine's mood (one round of raw LMDB puts
varied 3.6x within a run), and a verdict that flips between two runs on the same commit cannot tell a
regression from noise. So every ratio benchmark:

- runs its baseline and its subject alternately (``interleave``: ABBA order, so neither side always runs
  first), ``MIN_ROUNDS`` rounds or more, each round long enough to average out the machine (``min_round_s``:
  a side is repeated until it has run that long);
- reports the median of the per-round ratios, their range and interquartile range (``summarise``);
- gives a ``verdict``: ``pass`` when the whole interquartile range meets the goal, ``fail`` when none of it
  does, ``unclear`` when it straddles the goal (or when there were fewer than ``MIN_ROUNDS`` rounds, as in
  a ``--quick`` run, which only checks that the benchmark runs);
- prints the machine (CPU model, vector flags, cores) and the load at start and end (``common_fields``).

Pure functions, no imports from the roles, so every benchmark (and the engines' receivers) can use it.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIN_ROUNDS = 5
FLAGS = ("sse4_2", "fma", "avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
VERDICT_RULE = ("pass: the interquartile range of the per-round ratios meets the goal; fail: none of it does; "
                f"unclear: it straddles the goal, or fewer than {MIN_ROUNDS} rounds")


@dataclass(frozen=True)
class Timed:
    """One side of one round: ``work`` units (groups, samples, bytes, pushes) done in ``seconds``."""

    work: float
    seconds: float

    @property
    def rate(self) -> float:
        return self.work / self.seconds if self.seconds > 0 else 0.0

    def __add__(self, other: Timed) -> Timed:
        return Timed(self.work + other.work, self.seconds + other.seconds)


@dataclass
class Rounds:
    """Both sides of every round, and which side ran first in each."""

    baseline: list[Timed] = field(default_factory=list)
    subject: list[Timed] = field(default_factory=list)
    first: list[str] = field(default_factory=list)

    def rate_ratios(self) -> list[float]:
        """Per round: the subject's rate over the baseline's (throughput; higher is better)."""
        return [s.rate / b.rate if b.rate > 0 else 0.0 for b, s in zip(self.baseline, self.subject, strict=True)]

    def time_ratios(self) -> list[float]:
        """Per round: the subject's seconds per unit of work over the baseline's (latency; lower is better)."""
        return [b.rate / s.rate if s.rate > 0 else float("inf") for b, s in zip(self.baseline, self.subject, strict=True)]


@dataclass
class EventWindow:
    """A rate from completion events ``(time, amount)``, with both edges on events: work completes in waves (a
    batch of requests, a commit of groups), so a window with fixed edges counts one wave more or less by where
    they fall. The window opens at the first event at or after ``start`` (its amount not counted: its work
    began before) and closes at the first event at least ``seconds`` later (counted)."""

    start: float
    seconds: float
    first: float | None = None
    last: float | None = None
    work: float = 0.0

    @property
    def done(self) -> bool:
        return self.first is not None and self.last is not None and self.last >= self.first + self.seconds

    def add(self, t: float, amount: float) -> bool:
        """Record one event; True once the window is closed (later events are ignored)."""
        if self.done or t < self.start:
            return self.done
        if self.first is None:
            self.first = t
        else:
            self.work += amount
            self.last = t
        return self.done

    def timed(self, now: float) -> Timed:
        """The work and its span; a window not closed by ``now`` spans from its opening (or ``start``) to now."""
        if self.done:
            assert self.first is not None and self.last is not None
            return Timed(self.work, self.last - self.first)
        return Timed(self.work, now - (self.first if self.first is not None else self.start))


def run_for(side: Callable[[int], Timed], r: int, min_s: float) -> Timed:
    """``side(r)`` once, then again until the calls together ran ``min_s`` seconds; their sum."""
    total = side(r)
    while total.seconds < min_s:
        total = total + side(r)
    return total


def interleave(baseline: Callable[[int], Timed], subject: Callable[[int], Timed], rounds: int,
               min_round_s: float = 0.0, on_round: Callable[[int, Timed, Timed], None] | None = None) -> Rounds:
    """``rounds`` rounds of both sides, baseline first in even rounds and subject first in odd ones (ABBA), so
    a drift of the machine's load during a round hits both alike; each side runs at least ``min_round_s``."""
    out = Rounds()
    for r in range(rounds):
        if r % 2 == 0:
            b = run_for(baseline, r, min_round_s)
            s = run_for(subject, r, min_round_s)
        else:
            s = run_for(subject, r, min_round_s)
            b = run_for(baseline, r, min_round_s)
        out.baseline.append(b)
        out.subject.append(s)
        out.first.append("baseline" if r % 2 == 0 else "subject")
        if on_round is not None:
            on_round(r, b, s)
    return out


def rotate(sides: dict[str, Callable[[int], Timed]], rounds: int, min_round_s: float = 0.0,
           on_round: Callable[[int, dict[str, Timed]], None] | None = None) -> list[dict[str, Timed]]:
    """``interleave`` for any number of sides: ``rounds`` rounds, the order rotated by one each round so a
    drift of the machine's load hits every side alike; each side runs at least ``min_round_s``."""
    names = list(sides)
    out = []
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        timed = {n: run_for(sides[n], r, min_round_s) for n in order}
        out.append({n: timed[n] for n in names})
        if on_round is not None:
            on_round(r, out[-1])
    return out


def quartiles(values: list[float]) -> tuple[float, float]:
    """First and third quartiles (inclusive method: for 1..5, (2, 4)); one value is its own quartiles."""
    if len(values) == 1:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def goal_text(goal: float, higher_is_better: bool) -> str:
    return f"{'>=' if higher_is_better else '<='} {goal:g}"


def verdict(ratios: list[float], goal: float, higher_is_better: bool = True, min_rounds: int = MIN_ROUNDS) -> str:
    """``pass``/``fail``/``unclear`` from the interquartile range against the goal (see ``VERDICT_RULE``)."""
    if len(ratios) < min_rounds:
        return "unclear"
    q1, q3 = quartiles(ratios)
    meets = [x >= goal if higher_is_better else x <= goal for x in (q1, q3)]
    return "pass" if all(meets) else "fail" if not any(meets) else "unclear"


def summarise(ratios: list[float], goal: float, higher_is_better: bool = True, name: str = "ratio",
              min_rounds: int = MIN_ROUNDS) -> dict[str, Any]:
    """The judged ratio: its name, median, per-round values, range, interquartile range, goal and verdict
    (no rounds, as when none measured anything: no figures, verdict ``unclear``)."""
    goal_fields = {"goal": goal_text(goal, higher_is_better), "goal_value": goal, "higher_is_better": higher_is_better}
    if not ratios:
        return {"ratio_name": name, "ratio": None, "ratio_rounds": [], "ratio_range": None, "ratio_iqr": None,
                **goal_fields, "verdict": "unclear", "verdict_rule": VERDICT_RULE}
    q1, q3 = quartiles(ratios)
    return {
        "ratio_name": name, "ratio": round(statistics.median(ratios), 4),
        "ratio_rounds": [round(x, 4) for x in ratios],
        "ratio_range": [round(min(ratios), 4), round(max(ratios), 4)], "ratio_iqr": [round(q1, 4), round(q3, 4)],
        "goal": goal_text(goal, higher_is_better), "goal_value": goal, "higher_is_better": higher_is_better,
        "verdict": verdict(ratios, goal, higher_is_better, min_rounds), "verdict_rule": VERDICT_RULE,
    }


def figures(rounds: list[dict[str, Any]], digits: int = 4) -> dict[str, Any]:
    """Median and [min, max] of every number every round has (booleans and strings left out)."""
    out: dict[str, Any] = {}
    for key in rounds[0] if rounds else []:
        vals = [r[key] for r in rounds if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
        if vals and len(vals) == len(rounds):
            out[key] = round(statistics.median(vals), digits)
            out[f"{key}_range"] = [min(vals), max(vals)]
    return out


def combined_verdict(verdicts: list[str]) -> str:
    """Several judged rows as one: pass when all pass, fail when any fails, else unclear."""
    if verdicts and all(v == "pass" for v in verdicts):
        return "pass"
    return "fail" if "fail" in verdicts else "unclear"


def cpu_model_and_flags(cpuinfo: str, fallback: str) -> tuple[str, list[str]]:
    """The first ``model name`` and the vector flags of ``FLAGS`` present, from /proc/cpuinfo's text."""
    model, flags = fallback, set()
    for line in cpuinfo.splitlines():
        if line.startswith("model name") and model == fallback:
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return model, [f for f in FLAGS if f in flags]


def machine() -> dict[str, Any]:
    """The CPU (model, the vector flags that matter to torch and SGLang's CPU kernels) and its cores."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model, flags = cpu_model_and_flags(text, platform.processor() or platform.machine())
    return {"cpu": model, "cpu_flags": flags, "cpus": os.cpu_count()}


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class Run:
    """What every ratio benchmark's JSON line carries besides its figures: started at construction."""

    quick: bool = False
    load_at_start: list[float] = field(default_factory=load)
    started: float = field(default_factory=time.monotonic)

    def common_fields(self) -> dict[str, Any]:
        return {"quick": self.quick, "machine": machine(), "load_at_start": self.load_at_start,
                "load_at_end": load(), "wall_s": round(time.monotonic() - self.started, 1)}
