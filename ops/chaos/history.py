"""A chaos run's history, read from what the run wrote, and the invariants checked on it.

Not a CLI; ``ops.bench.chaos`` reads the history of its run directory with :func:`read_history` and checks
it with :func:`check`. Where each part comes from:

- acknowledged groups: the buffer's ``gindex`` (a group is acknowledged only after the transaction that
  recorded it committed), the groups still waiting and every take (groups served, groups dropped as stale,
  the learner version and staleness floor it was served under) from the ``served`` record that
  ``buffer.record_served=true`` keeps (``buffer.directory.ledger``);
- published versions: ``metrics.jsonl``'s ``learner_step`` records in the order written, across every start,
  with the learner's "republishing the checkpoint's weights as vN" lines (a resume) merged in by time;
- each engine's last version: the last "serving weights vN" line (or ``ACTOR DONE``'s ``weight_version``)
  in each ``logs/actor-I.log``;
- the end: ``learner_done.json``, ``summary.json`` (held-out accuracy, the base's).

:func:`check` is pure (a :class:`History` in, one verdict per invariant out) so that hand-made histories test
each check's failure too.
"""

from __future__ import annotations

import datetime
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer.directory import ledger
from buffer.layout import GROUP_KEY, STORED
from ops.report import load_records

Key = tuple[int, int]  # a stored group: (weight_version, seq)

_SERVING = re.compile(r"serving weights v(\d+)|\"weight_version\": (\d+)")
# Rank 0's line only (it alone publishes; every rank logs the same), behind pdsh's "<host>: " on several hosts.
_REPUBLISH = re.compile(r"^(?:\S+: )?(\d{4}-\d\d-\d\d \S+) learner\[0\] .*republishing the checkpoint's weights as v(\d+)")


@dataclass
class History:
    """Everything the invariants are checked on; each field says where it was read."""

    stored: set[Key]  # acknowledged and stored (gindex outcome S)
    waiting: set[Key]  # still in the buffer at the end
    takes: list[dict[str, Any]]  # buffer.directory.ledger's takes: learner_version, min_version, served, dropped
    max_staleness: int
    published: list[int]  # versions in the order published, across restarts
    engine_versions: dict[str, int | None]  # actor-I -> the version its engine served last
    total_steps: int
    learner_done: bool
    accuracy: float | None = None
    reference_accuracy: float | None = None  # the fault-free run's, or the base's in short mode
    tolerance: float = 0.05
    leftovers: list[str] = field(default_factory=list)  # processes, ports, files left behind
    acked_other: int = 0  # acknowledged but never stored (filtered, stale on arrival)


def _stored_keys(acked: dict[str, tuple[bytes, bytes]]) -> tuple[set[Key], int]:
    stored, other = set(), 0
    for fate, key in acked.values():
        if fate == STORED and len(key) == GROUP_KEY.size:
            stored.add(GROUP_KEY.unpack(key)[:2])
        else:
            other += 1
    return stored, other


def _log_time(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def published_versions(run_dir: Path) -> list[int]:
    """Learner step versions and resume republishes, in the order they were published (by wall time)."""
    events = [(float(r.get("time", 0.0)), int(r["weight_version"])) for r in load_records(run_dir)
              if r.get("kind") == "learner_step"]
    log = run_dir / "logs" / "learner.log"
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if (m := _REPUBLISH.match(line)) is not None:
            events.append((_log_time(m.group(1)), int(m.group(2))))
    return [v for _, v in sorted(events, key=lambda e: e[0])]


def engine_versions(run_dir: Path) -> dict[str, int | None]:
    """Per actor log, the weight version its engine served last (None: never served one)."""
    out: dict[str, int | None] = {}
    for log in sorted((run_dir / "logs").glob("actor-*.log")):
        last = None
        for m in _SERVING.finditer(log.read_text(errors="replace")):
            last = int(m.group(1) or m.group(2))
        out[log.stem] = last
    return out


def read_history(run_dir: Path, buffer_dir: Path, *, max_staleness: int, total_steps: int) -> History:
    """The history of a finished (or stopped) run from its run directory and buffer directory."""
    led = ledger(buffer_dir)
    stored, other = _stored_keys(led["acked"])
    waiting = {GROUP_KEY.unpack(k)[:2] for k in led["waiting"]}
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    return History(stored=stored, waiting=waiting, takes=led["takes"], max_staleness=max_staleness,
                   published=published_versions(run_dir), engine_versions=engine_versions(run_dir),
                   total_steps=total_steps, learner_done=(run_dir / "learner_done.json").is_file(),
                   accuracy=summary.get("final_accuracy"), reference_accuracy=summary.get("base_accuracy"),
                   acked_other=other)


# ------------------------------------------------------------------------------------------ the checks


def _verdict(ok: bool, **detail: Any) -> dict[str, Any]:
    return {"pass": bool(ok), **detail}


def check_groups(h: History) -> dict[str, dict[str, Any]]:
    """No acknowledged group lost, none served twice, nothing served that was never acknowledged."""
    served = Counter(tuple(k) for t in h.takes for k in t["served"])
    dropped = {tuple(k) for t in h.takes for k in t["dropped"]}
    accounted = set(served) | dropped | h.waiting
    lost = sorted(h.stored - accounted)
    twice = sorted(k for k, n in served.items() if n > 1)
    both = sorted((set(served) | dropped) & h.waiting)  # served yet still waiting: it could be served again
    phantom = sorted(accounted - h.stored)
    return {
        "no_acked_group_lost": _verdict(not lost and not phantom, acked=len(h.stored), lost=len(lost),
                                        never_acked=len(phantom), examples=(lost + phantom)[:5]),
        "none_served_twice": _verdict(not twice and not both, served=sum(served.values()), twice=len(twice),
                                      served_and_waiting=len(both), examples=(twice + both)[:5]),
    }


def check_staleness(h: History) -> dict[str, Any]:
    """Every served group's weight version within ``max_staleness`` of the learner version it was served to."""
    bad = [(t["learner_version"], k) for t in h.takes for k in t["served"]
           if k[0] < t["learner_version"] - h.max_staleness or k[0] < t["min_version"]]
    worst = max((t["learner_version"] - k[0] for t in h.takes for k in t["served"]), default=0)
    return _verdict(not bad, max_staleness=h.max_staleness, worst=worst, violations=len(bad), examples=bad[:5])


def check_versions(h: History) -> dict[str, dict[str, Any]]:
    """Published versions strictly increasing (never reused across restarts); each engine ends on the last."""
    back = [(a, b) for a, b in zip(h.published, h.published[1:], strict=False) if b <= a]
    final = h.published[-1] if h.published else None
    off = {name: v for name, v in h.engine_versions.items() if v != final}
    return {
        "versions_strictly_increasing": _verdict(not back, published=len(h.published), not_increasing=back[:5]),
        "engines_on_final_version": _verdict(bool(h.engine_versions) and not off and final is not None,
                                             final=final, engines=h.engine_versions),
    }


def check_end(h: History) -> dict[str, dict[str, Any]]:
    """The run reached its last step; its accuracy is within tolerance; nothing was left behind."""
    last = h.published[-1] if h.published else None
    acc_ok = (h.accuracy is not None and h.reference_accuracy is not None
              and h.accuracy >= h.reference_accuracy - h.tolerance)
    return {
        "reached_total_steps": _verdict(h.learner_done and last == h.total_steps, last=last,
                                        total_steps=h.total_steps, learner_done=h.learner_done),
        "accuracy_within_tolerance": _verdict(acc_ok, accuracy=h.accuracy, reference=h.reference_accuracy,
                                              tolerance=h.tolerance),
        "nothing_left_behind": _verdict(not h.leftovers, leftovers=h.leftovers[:10]),
    }


def check(h: History) -> dict[str, dict[str, Any]]:
    """Every invariant: name -> {"pass": bool, ...what was counted}."""
    return {**check_groups(h), "served_within_staleness": check_staleness(h), **check_versions(h), **check_end(h)}
