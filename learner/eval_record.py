"""The metrics.jsonl ``eval`` record of one evaluation over its sets, its gauges and its log line.

Not a CLI. ``learner.evaluate.evaluate_sets`` (in-process) and ``learner.engine_eval.evaluate_sets_on_engines``
(on engines) end with ``eval_record``; the learner sets the gauges with ``set_eval_gauges``; the learner's log,
the launcher's progress line and ``ops/report.py`` read the sets back with ``record_sets``::

    rec = eval_record([(heldout_set, report), (aime_set, report)])
    rec["avg_at_k"]                  # the held-out slice's figures stay at the top level (old readers)
    rec["sets"]["aime"]["pass_at_k"]  # every set's, when sets other than the held-out slice are evaluated
    eval_line(rec)                   # "eval heldout avg@8 0.412 pass@8 0.750 | eval aime avg@4 0.310 ..."

An evaluation of the held-out slice alone (no ``task.eval_sets``) is recorded as before: no ``sets`` key.
Stdlib only, so the launcher can read records without the learner's imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

HELDOUT = "heldout"  # common.tasks.eval_sets.HELDOUT, repeated to keep this module free of the task imports
_TABLES = ("by_bucket", "by_data_source", "by_response_length")
_ENGINE = ("engine_urls", "prompts_per_engine")
SET_FIELDS = ("avg_at_k", "pass_at_k", "greedy_accuracy", "n_prompts", "k", "max_new_tokens", "mean_response_length",
              "truncated_fraction", "seconds", "by_data_source")


class _Set(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def max_new_tokens(self) -> int: ...


def _flat(rep: dict[str, Any]) -> dict[str, Any]:
    """Scalars, tables and engine lists of a report; the per-prompt lists stay out of metrics.jsonl."""
    return {k: v for k, v in rep.items() if isinstance(v, int | float | str) or k in _TABLES + _ENGINE}


def eval_record(results: Sequence[tuple[_Set, dict[str, Any]]]) -> dict[str, Any]:
    """One record for the reports of an evaluation's sets (``learner.eval_score.score`` reports, in set order).

    Top level: the held-out slice's report as before (absent with ``task.eval_heldout=false``), and
    ``weight_versions_evaluated`` over every set when engines generated. ``sets``: per set ``SET_FIELDS``,
    unless the held-out slice was the only set."""
    rec: dict[str, Any] = {}
    for s, rep in results:
        if s.name == HELDOUT:
            rec.update(_flat(rep))
    if any("weight_versions_evaluated" in rep for _, rep in results):  # generated on engines
        versions = [v for _, rep in results for v in (rep.get("weight_versions_evaluated") or [])]
        rec["weight_versions_evaluated"] = [min(versions), max(versions)] if versions else None
    if [s.name for s, _ in results] != [HELDOUT]:
        rec["sets"] = {s.name: {k: v for k, v in {**rep, "max_new_tokens": s.max_new_tokens}.items() if k in SET_FIELDS}
                       for s, rep in results}
    return rec


def record_sets(rec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> figures of every set an ``eval`` record (or a step record's ``eval``) holds; a record of the
    held-out slice alone (and any record older than sets) gives ``{"heldout": <its top level>}``."""
    if isinstance(rec.get("sets"), dict):
        return rec["sets"]
    return {HELDOUT: rec} if isinstance(rec.get("avg_at_k"), int | float) else {}


def _num(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, int | float) else "-"


def eval_line(rec: dict[str, Any]) -> str:
    """One short part per set: ``eval <name> avg@<k> <x> pass@<k> <y>``, joined by `` | ``."""
    return " | ".join(f"eval {name} avg@{s.get('k', 'k')} {_num(s.get('avg_at_k'))} "
                      f"pass@{s.get('k', 'k')} {_num(s.get('pass_at_k'))}" for name, s in record_sets(rec).items())


def set_eval_gauges(metrics: Any, rec: dict[str, Any]) -> None:
    """The learner's evaluation gauges from a record: the held-out slice's ``eval_accuracy{metric}`` and
    ``eval_response_length`` as before, and ``eval_avg_at_k`` / ``eval_pass_at_k`` per set and data_source
    (``data_source="all"``: the whole set)."""
    for key in ("avg_at_k", "pass_at_k", "greedy_accuracy"):
        if isinstance(rec.get(key), int | float):
            metrics.eval_accuracy.labels(metric=key).set(rec[key])
    if isinstance(rec.get("mean_response_length"), int | float):
        metrics.eval_response_length.set(rec["mean_response_length"])
    for name, s in record_sets(rec).items():
        rows = {**(s.get("by_data_source") or {}), "all": s}
        for source, row in rows.items():
            if isinstance(row.get("avg_at_k"), int | float):
                metrics.eval_avg_at_k.labels(set=name, data_source=source).set(row["avg_at_k"])
            if isinstance(row.get("pass_at_k"), int | float):
                metrics.eval_pass_at_k.labels(set=name, data_source=source).set(row["pass_at_k"])


__all__ = ["eval_line", "record_sets"]
