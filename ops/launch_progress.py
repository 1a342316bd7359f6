"""The launcher's progress lines: one per learner step (its ETA at the pace of the last 10 steps;
``engines 1/2`` while fewer engines than planned are alive; ``MFU -`` when the learner reports none: an
unknown GPU without ``learner.peak_tflops``), value-pretraining step and evaluation (one part per set with
``task.eval_sets``), read from ``<run dir>/metrics.jsonl`` as the learner appends to it (``ops/launch.py``)."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any

from common.provenance import describe
from learner.eval_record import eval_line

ETA_WINDOW = 10  # steps whose pace the ETA extrapolates


def say(msg: str) -> None:
    print(f"[vapo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Progress:
    """Follows <run dir>/metrics.jsonl and prints one line per learner step and per evaluation."""

    def __init__(self, path: Path, total_steps: int) -> None:
        self.path = path
        self.offset = 0
        self.total = total_steps
        self.records: list[dict[str, Any]] = []
        self.last_eval: float | None = None
        self.base_eval: float | None = None
        self.last_time: float | None = None
        self.engines: tuple[int, int] | None = None  # (alive, planned), set by the launcher's supervision
        self.recent: deque[tuple[float, int]] = deque(maxlen=ETA_WINDOW)  # (time, step) of the last steps

    def eta(self, r: dict[str, Any], step: int) -> str:
        """The time to ``total`` at the pace of the last ``ETA_WINDOW`` steps, read from the records' own times
        (a launcher that resumes a run reads its earlier steps again, and the pace includes time lost to a
        stop); ``-`` until two steps have times."""
        if isinstance(r.get("time"), int | float):
            self.recent.append((float(r["time"]), step))
        if len(self.recent) < 2 or self.recent[-1][1] <= self.recent[0][1]:
            return "-"
        (t_a, s_a), (t_b, s_b) = self.recent[0], self.recent[-1]
        eta = (t_b - t_a) / (s_b - s_a) * max(self.total - step, 0)
        return f"{int(eta // 60)}m{int(eta % 60):02d}s"

    def poll(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        cut = data.rfind(b"\n") + 1  # only whole lines; a line being written is read next time
        self.offset += cut
        new = []
        for line in data[:cut].splitlines():
            try:
                new.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        for r in new:
            if r.get("kind") == "learner_step" and isinstance(r.get("time"), int | float):
                if self.last_time is not None and r["time"] > self.last_time:
                    r.setdefault("samples_per_second", r.get("samples", 0) / (r["time"] - self.last_time))
                self.last_time = r["time"]
            self.records.append(r)
            self._print(r)
        return new

    def _print(self, r: dict[str, Any]) -> None:
        kind = r.get("kind", "")
        ev = r if kind == "eval" else r.get("eval")
        if kind == "header":
            say(f"learner {'resumed' if r.get('resumed') else 'started'} on {describe(r)}")
        elif kind == "value_pretrain":
            say(f"value pretraining step {r.get('step', '?')}: explained variance (fresh groups) "
                f"{_fmt(r.get('explained_variance'))}  loss {_fmt(r.get('loss'), 4)}")
        elif kind == "learner_step":
            step = int(r.get("weight_version", r.get("step", 0)))
            say(
                f"step {step}/{self.total}  reward {_fmt(r.get('reward_mean'))}"
                f"  ev {_fmt(r.get('value_explained_variance'))}  staleness {_fmt(r.get('staleness_mean'), 2)}"
                f"  samples/s {_fmt(r.get('samples_per_second'), 1)}  len {_fmt(r.get('response_length_mean'), 1)}"
                f"  MFU {_percent(r.get('mfu'))}  ETA {self.eta(r, step)}{self.degraded()}"
            )
        if isinstance(ev, dict):
            acc = ev.get("avg_at_k")
            if isinstance(acc, int | float):
                if self.base_eval is None:
                    self.base_eval = float(acc)
                self.last_eval = float(acc)
            v = r.get('weight_version', r.get('version', '?'))
            if isinstance(ev.get("sets"), dict):  # task.eval_sets: one short part per set
                say(f"eval  v{v}: {eval_line(ev)}")
            else:
                say(f"eval  v{v}: held-out avg@k {_fmt(acc)}"
                    f"  greedy {_fmt(ev.get('greedy_accuracy'))}  length {_fmt(ev.get('mean_response_length'), 1)}")

    def degraded(self) -> str:
        """``  engines 1/2`` while fewer engines than planned are alive (a lost host, one given up)."""
        if self.engines is None or self.engines[0] >= self.engines[1]:
            return ""
        return f"  engines {self.engines[0]}/{self.engines[1]}"


def _fmt(v: Any, digits: int = 3) -> str:
    if isinstance(v, int | float):
        return f"{v:.{digits}f}"
    return "-"


def _percent(v: Any) -> str:
    """A fraction as a percentage with one decimal (``0.1234`` -> ``12.3%``); ``-`` when absent."""
    if isinstance(v, int | float):
        return f"{100 * v:.1f}%"
    return "-"
