"""``<run dir>/metrics.jsonl``: one JSON object per line, appended by rank 0 of the learner.

Not a CLI. Records carry a ``kind``: ``header`` (``learner.runner.main``, first, and again at each resumed
start: what produced the records that follow, from ``common.provenance``), ``learner_step`` and ``eval``
(``learner.runner``), ``value_pretrain`` (``learner.value_pretrain``); ``ops/report.py`` and
``ops/launch.py`` read them, and every reader selects records by ``kind``. Its own module because both
writers use it and ``learner.runner`` sits above ``learner.value_pretrain``. ``RunRecords.append`` is the
one sink: the line in metrics.jsonl (``metrics.jsonl``) and the same record to the experiment trackers
(``metrics.trackers``, ``learner.trackers``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from common import provenance
from common.config import Config
from learner.trackers import Trackers

_lock = threading.Lock()  # rank 0's background evaluation appends beside the training loop


def _write_line(path: Path, record: dict[str, Any]) -> None:
    line = json.dumps(record, default=float) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(line)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line; numbers that JSON lacks (numpy, tensors) are written as floats."""
    with _lock:
        _write_line(path, record)


class RunRecords:
    """Rank 0's sink for the run's records: ``<run dir>/metrics.jsonl`` (when ``metrics.jsonl``) and the
    experiment trackers (``trackers``: ``RunRecords.open`` opens what ``metrics.trackers`` names; a plain
    ``RunRecords(cfg)`` has none). The training loop and the background evaluator's thread both append."""

    def __init__(self, cfg: Config, trackers: Trackers | None = None) -> None:
        self.cfg = cfg
        self.path: Path = cfg.run_dir / "metrics.jsonl"
        self.jsonl: bool = cfg.metrics.jsonl
        self.trackers = trackers

    @classmethod
    def open(cls, cfg: Config) -> RunRecords:
        """The run's sink with its experiment trackers open (close it: ``close`` or ``with``)."""
        return cls(cfg, Trackers.open(cfg))

    def append(self, record: dict[str, Any]) -> None:
        """``record`` as one metrics.jsonl line and, flushed, to every tracker (at the record's ``step``)."""
        with _lock:
            if self.jsonl:
                _write_line(self.path, record)
            if self.trackers is not None:
                self.trackers.log(record)

    def append_header(self) -> dict[str, Any]:
        """Append the run's header record (``header_record``; a resumed run gets one per start: the machine
        may have changed); returns it."""
        rec = header_record(self.cfg)
        self.append(rec)
        return rec

    def close(self, failed: bool = False) -> None:
        """Close the trackers (a failed run's W&B run is marked so); appending afterwards writes the file only."""
        with _lock:
            trackers, self.trackers = self.trackers, None
        if trackers is not None:
            trackers.close(failed)

    def __enter__(self) -> RunRecords:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(failed=exc_type is not None)


def header_record(cfg: Config) -> dict[str, Any]:
    """``{"kind": "header", "time", "run", "resumed", **common.provenance.for_config(cfg)}``: commit, base
    checksum, CPU model and SIMD flags, torch/DeepSpeed versions, thread settings, load."""
    path = cfg.run_dir / "metrics.jsonl"
    resumed = path.exists() and path.stat().st_size > 0
    return {"kind": "header", "time": time.time(), "run": cfg.run.name, "resumed": resumed,
            **provenance.for_config(cfg)}


def write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    """``record`` as ``path``, all or nothing (a temp file renamed over it): readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, default=float) + "\n")
    tmp.replace(path)
