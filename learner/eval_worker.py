"""Evaluation on rollout engines off the training path: a background thread of learner rank 0.

Not a CLI. ``learner.runner`` submits a version after publishing it; the thread evaluates it on every engine
of ``learner.engine_eval.eval_engine_urls`` (prompts dealt round-robin, ``evaluate_sets_on_engines``: the
held-out slice and ``task.eval_sets``) while training goes on, and appends
``{"kind": "eval", "weight_version": v, "step": v, ...}`` (``learner.eval_record``) to metrics.jsonl when done:

    evals = BackgroundEval(cfg, tokenizer, task, record)   # record(dict) appends and sets the gauges
    evals.submit(version)        # returns at once; a version still waiting is replaced by the newer one
    evals.finish()               # at the end of the run: the submitted evaluations complete (or fail)

One evaluation runs at a time. A version submitted while another is running waits; a later submission
replaces it (it is recorded as ``{"kind": "eval", "weight_version": v, "skipped": true}``): evaluations never
queue up behind training. Engines keep loading newer weights meanwhile, so each record says which versions
its outputs came from (``weight_versions_evaluated``). Per-request and weight-wait limits come from the
sizes of the work (each set's response limit; ``eval_timeout_s`` = 0: no overall limit), so an evaluation of
any size completes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from common.config import Config
from common.tasks.eval_sets import EvalSet, eval_sets
from learner.engine_eval import EngineEvalError, eval_engine_urls, evaluate_sets_on_engines
from learner.eval_record import eval_line

log = logging.getLogger("learner.eval")


def eval_limits(cfg: Config, max_new_tokens: int | None = None) -> dict[str, float]:
    """``evaluate_on_engines`` limits: the actors' generate timeout per request (base + max_new_tokens /
    min_tokens_per_s unless set; ``max_new_tokens`` default actors.max_new_tokens), and the actor's wait
    for a weight update. The overall one is ``learner.eval_timeout_s``."""
    a, e = cfg.actors, cfg.engine
    n = a.max_new_tokens if max_new_tokens is None else max_new_tokens
    return {"request_timeout_s": a.generate_timeout_s or a.generate_timeout_base_s + n / a.min_tokens_per_s,
            "version_wait_s": e.weight_load_timeout_s + e.health_timeout_s}


class BackgroundEval:
    """Rank 0's evaluation thread (see the module docstring)."""

    def __init__(self, cfg: Config, tokenizer: Any, task: Any, record: Callable[[dict[str, Any]], None],
                 urls: list[str] | None = None, sets: list[EvalSet] | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.task = task
        self.record = record
        self.urls = urls if urls is not None else eval_engine_urls(cfg)
        self.sets = sets if sets is not None else eval_sets(cfg, task)
        self._cond = threading.Condition()
        self._pending: int | None = None
        self._running: int | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="eval", daemon=True)
        self._thread.start()

    def submit(self, version: int) -> None:
        """Evaluate ``version`` once the thread is free; replaces a version that has not started."""
        with self._cond:
            if self._pending is not None:
                self._safe_record({"kind": "eval", "weight_version": self._pending, "step": self._pending,
                                   "time": time.time(), "skipped": True})
            self._pending = version
            self._cond.notify_all()

    def busy(self) -> bool:
        with self._cond:
            return self._pending is not None or self._running is not None

    def finish(self, timeout_s: float | None = None) -> bool:
        """Wait until everything submitted has been evaluated (or failed); then stop the thread. False when
        ``timeout_s`` ran out first (the thread is a daemon: it dies with the process)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._pending is not None or self._running is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                version, self._pending, self._running = self._pending, None, self._pending
            try:
                self._safe_record(self._evaluate(version))
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _evaluate(self, version: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"kind": "eval", "weight_version": version, "step": version}
        try:
            rep = evaluate_sets_on_engines(self.urls, self.tokenizer, self.task, self.sets, version,
                                           lambda n: eval_limits(self.cfg, n), timeout_s=self.cfg.learner.eval_timeout_s,
                                           temperature=self.cfg.actors.temperature)
        except (EngineEvalError, OSError) as e:
            log.error("evaluation of v%d failed (training goes on): %s", version, e)
            return {**rec, "time": time.time(), "error": str(e)}
        log.info("v%d on %d engine(s): %s (%.1f s)", version, len(self.urls), eval_line(rep), time.perf_counter() - t0)
        return {**rec, "time": time.time(), "weight_version_evaluated": version, **rep}

    def _safe_record(self, rec: dict[str, Any]) -> None:
        try:
            self.record(rec)
        except Exception:  # a failed write must not kill the thread (training goes on)
            log.exception("could not record the held-out evaluation of v%s", rec.get("weight_version"))
