"""A guarded process pool for reward functions: a reward that hangs, raises or eats memory costs one reward
of 0 and a counted error, never a stalled or dead actor.

    pool = RewardPool(["file:/abs/r.py:compute_score", "module:common.tasks.reward_rules:boxed"],
                      workers=2, timeout_s=10.0, memory_mb=2048)
    results = pool.score([RewardCall("file:/abs/r.py:compute_score", "gsm8k", response, "42", "{}"), ...])
    pool.close()

A function is named ``file:<path>:<function>`` (a user's file, verl's signature ``compute_score(data_source,
solution_str, ground_truth, extra_info)``) or ``module:<module>:<function>`` (an importable module: the
built-in rules). The pool starts on its first ``score``: ``workers`` processes from the ``spawn`` context
(never fork: the caller holds threads and sockets), each importing every named function once, then lowering
its own address-space limit (``RLIMIT_AS``) to what it holds plus ``memory_mb``. A ``score`` call takes one
idle worker, sends it the whole batch (one round trip: the worker answers item by item, results come back
in order) and gives each item ``timeout_s`` from the moment the previous one was answered. Then:

- a float (or a dict whose ``score`` is one; its other numeric keys are ``extra`` figures, at most
  ``MAX_EXTRA`` of them) is the score;
- a timeout kills the worker (``timeout``), its death (``crash``) or a ``MemoryError`` (``memory``) replaces
  it, an exception is ``exception``, a non-number, NaN or infinity is ``bad_value``: each gives score 0 with
  that ``error`` kind, one log line per kind per ``log_every_s`` (``vapo.reward``), and the rest of the batch
  goes on, on a fresh worker where the old one is gone.

Only plain data crosses the pipes (strings, floats, dicts of str to float), both ways. Workers die with the
process that started them (``common.lifeline``'s ancestor watchdog: a pidfd on that process, so it holds
whichever thread spawned them), on ``close()`` and at interpreter exit (daemonic processes).

Not a CLI; ``python -m pytest tests/common/test_reward_pool.py`` runs hanging, raising and runaway rewards.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from common import lifeline

log = logging.getLogger("vapo.reward")

ERROR_KINDS = ("timeout", "exception", "memory", "crash", "bad_value")
MAX_EXTRA = 16  # extra figures kept per result: they become metric labels, which must stay few
STARTUP_TIMEOUT_S = 120.0  # a worker's interpreter start and imports (sympy, a user's torch) on a busy host
_MESSAGE_CHARS = 400


class RewardPoolError(RuntimeError):
    """The pool cannot score at all: a reward function does not load, or the pool is closed."""


class RewardCall(NamedTuple):
    """One response to score: which function, and verl's four arguments (``extra_info`` as JSON text)."""

    function: str
    data_source: str
    solution_str: str
    ground_truth: str
    extra_info: str = ""


@dataclass(frozen=True)
class RewardResult:
    """A score (0.0 when ``error`` is set), the function's extra figures, and what went wrong."""

    score: float
    extra: dict[str, float] = field(default_factory=dict)
    error: str = ""  # "" or one of ERROR_KINDS
    message: str = ""


class RateLimitedLog:
    """At most one warning per key per ``every_s``; the next one says how many were held back."""

    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self.logger, self.every_s = logger, every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -math.inf) < self.every_s:
                self._held[key] = self._held.get(key, 0) + 1
                return
            self._last[key], held = now, self._held.pop(key, 0)
        self.logger.warning(msg + (f" ({held} more like it since the last line)" if held else ""), *args)


# ------------------------------------------------------------------------------------- worker process


def _load(spec: str) -> Callable[..., Any]:
    """The function a ``file:``/``module:`` name points at (raises with a message that names it)."""
    kind, _, rest = spec.partition(":")
    where, _, name = rest.rpartition(":")
    if kind == "module":
        module = importlib.import_module(where)
    elif kind == "file":
        module_spec = importlib.util.spec_from_file_location(f"vapo_reward_{abs(hash(where))}", where)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"{where} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # dataclasses and pickling inside the file look themselves up
        module_spec.loader.exec_module(module)
    else:
        raise ValueError(f"{spec!r}: expected file:<path>:<function> or module:<module>:<function>")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{where} has no function {name!r}")
    return fn


def _as_score(value: Any) -> tuple[float, dict[str, float]] | str:
    """(score, extra figures) of what a function returned, or why it is not a score."""
    extra: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return f"a dict without 'score' (keys {sorted(map(str, value))[:8]})"
        for k, v in value.items():
            if k != "score" and isinstance(v, int | float) and math.isfinite(float(v)) and len(extra) < MAX_EXTRA:
                extra[str(k)] = float(v)
        value = value["score"]
    try:
        score = float(value)  # numpy and torch scalars too
    except (TypeError, ValueError):
        return f"not a number: {type(value).__name__} {str(value)[:80]!r}"
    if isinstance(value, str) or not math.isfinite(score):
        return f"not a finite number: {value!r}"
    return score, extra


def _call(fn: Callable[..., Any], item: Sequence[str]) -> tuple[Any, ...]:
    """One item's answer: ("ok", score, extra) or ("error", kind, message)."""
    _, source, solution, truth, extra_text = item
    try:
        extra_info = json.loads(extra_text) if extra_text else None
    except ValueError:
        extra_info = extra_text
    try:
        out = _as_score(fn(source, solution, truth, extra_info))
    except MemoryError:
        return ("error", "memory", "MemoryError: the reward function ran out of its address space")
    except (Exception, SystemExit) as e:
        return ("error", "exception", f"{type(e).__name__}: {e}"[:_MESSAGE_CHARS])
    if isinstance(out, str):
        return ("error", "bad_value", out)
    return ("ok", out[0], out[1])


def _limit_memory(memory_mb: int) -> None:
    """Address space = what this process maps now (interpreter, imports) + ``memory_mb``."""
    try:
        with open("/proc/self/statm") as fh:
            mapped = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = mapped + memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (OSError, ValueError) as e:
        log.warning("reward worker %d: no memory limit (%s)", os.getpid(), e)


def _worker_main(conn: Connection, specs: list[str], memory_mb: int, ancestor: str) -> None:
    """A worker: load the functions, limit memory, then answer batches until told to stop or orphaned."""
    lifeline.watch_ancestor(ancestor)
    try:
        functions = {spec: _load(spec) for spec in specs}
    except BaseException as e:  # the file's own top level may do anything
        conn.send(("failed", f"{type(e).__name__}: {e}"[:_MESSAGE_CHARS]))
        return
    _limit_memory(memory_mb)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "score":
            return
        for item in msg[1]:
            fn = functions.get(item[0])
            answer = _call(fn, item) if fn is not None else ("error", "exception", f"unknown function {item[0]!r}")
            conn.send(answer)
            if answer[1] == "memory":
                return  # what it allocated may still be held (a global list): start afresh


# ------------------------------------------------------------------------------------- the pool


class _Worker:
    """One worker process and the parent's end of its pipe; started again after it is killed."""

    def __init__(self, pool: RewardPool) -> None:
        self.pool = pool
        self.proc: Any = None
        self.conn: Connection | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def launch(self) -> None:
        """Start the process (``wait_ready`` waits for it to load its functions)."""
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, name="vapo-reward", daemon=True,
                                args=(child, self.pool.specs, self.pool.memory_mb, lifeline.token()))
        self.proc.start()
        child.close()
        self.conn = parent

    def wait_ready(self) -> None:
        """Wait until the launched process has loaded its functions (RewardPoolError if it does not)."""
        assert self.conn is not None and self.proc is not None
        try:
            ready = self.conn.recv() if self.conn.poll(STARTUP_TIMEOUT_S) else ("failed", "no answer at start")
        except (EOFError, OSError):
            ready = ("failed", f"died at start (exit code {self.proc.exitcode})")
        if ready[0] != "ready":
            self.kill()
            raise RewardPoolError(f"reward worker could not load {self.pool.specs}: {ready[1]}")

    def stop_process(self) -> None:
        """Kill the process only (another thread may be reading its pipe: it sees the end of it)."""
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(ValueError):  # already closed by its owner
                proc.kill()

    def kill(self) -> None:
        """Kill the process, reap it, close the pipe."""
        proc, conn = self.proc, self.conn
        self.proc, self.conn = None, None
        if proc is not None:
            with contextlib.suppress(ValueError):
                proc.kill()
                proc.join(5.0)
                if proc.exitcode is not None:
                    proc.close()
        if conn is not None:
            conn.close()

    def score(self, items: list[RewardCall], timeout_s: float) -> tuple[list[RewardResult], bool]:
        """Results for a prefix of ``items`` (all of them unless the worker was lost) and whether it was."""
        assert self.conn is not None
        try:
            self.conn.send(("score", [tuple(i) for i in items]))
        except (OSError, ValueError) as e:
            return [RewardResult(0.0, error="crash", message=f"worker pipe closed: {e}")], True
        out: list[RewardResult] = []
        for _ in items:
            try:
                answer = self.conn.recv() if self.conn.poll(timeout_s) else None
            except (EOFError, OSError):
                code = self.proc.exitcode if self.proc is not None else None
                return [*out, RewardResult(0.0, error="crash", message=f"worker died (exit code {code})")], True
            if answer is None:
                return [*out, RewardResult(0.0, error="timeout", message=f"no result within {timeout_s:g} s")], True
            if answer[0] == "ok":
                out.append(RewardResult(float(answer[1]), dict(answer[2])))
                continue
            out.append(RewardResult(0.0, error=str(answer[1]), message=str(answer[2])))
            if answer[1] == "memory":
                return out, True
        return out, False


class RewardPool:
    """``workers`` guarded processes scoring batches of ``RewardCall`` (see the module docstring)."""

    def __init__(self, specs: Sequence[str], *, workers: int = 2, timeout_s: float = 10.0, memory_mb: int = 2048,
                 log_every_s: float = 10.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        for spec in specs:
            if spec.startswith("file:") and not Path(spec[5:].rpartition(":")[0]).is_file():
                raise ValueError(f"reward file not found: {spec[5:].rpartition(':')[0]}")
        self.specs, self.timeout_s, self.memory_mb = list(specs), timeout_s, memory_mb
        self.errors = RateLimitedLog(log, log_every_s)
        self.error_counts = dict.fromkeys(ERROR_KINDS, 0)
        self._workers = [_Worker(self) for _ in range(workers)]
        self._idle: list[_Worker] = []
        self._cond = threading.Condition()
        self._started = self._closed = False

    def _ensure_started(self) -> None:
        """Start every worker, once (the first call pays; a function that fails to load is an error here)."""
        with self._cond:
            if self._started:
                return
            try:
                for w in self._workers:  # all start together, then each is waited for
                    w.launch()
                for w in self._workers:
                    w.wait_ready()
            except RewardPoolError:
                for w in self._workers:
                    w.kill()
                raise
            self._idle, self._started = list(self._workers), True

    def score(self, calls: Sequence[RewardCall]) -> list[RewardResult]:
        """One result per call, in order; a failed call is score 0 with its ``error`` kind (see the module)."""
        if not calls:
            return []
        self._ensure_started()
        with self._cond:
            while not self._idle and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RewardPoolError("the reward pool is closed")
            worker = self._idle.pop()
        try:
            return self._score_on(worker, list(calls))
        finally:
            with self._cond:
                self._idle.append(worker)
                self._cond.notify()

    def _score_on(self, worker: _Worker, calls: list[RewardCall]) -> list[RewardResult]:
        results: list[RewardResult] = []
        while len(results) < len(calls) and not self._closed:
            if not worker.alive():
                worker.kill()
                try:
                    worker.launch()
                    worker.wait_ready()
                except RewardPoolError as e:  # e.g. the file changed under a running pool
                    results += [RewardResult(0.0, error="crash", message=str(e))] * (len(calls) - len(results))
                    break
            got, lost = worker.score(calls[len(results):], self.timeout_s)
            results += got
            if lost:
                worker.kill()
        results += [RewardResult(0.0, error="crash", message="pool closed")] * (len(calls) - len(results))
        for call, res in zip(calls, results, strict=True):
            if res.error:
                with self._cond:
                    self.error_counts[res.error] = self.error_counts.get(res.error, 0) + 1
                self.errors.warn(res.error, "reward %s (%s, data_source %r): %s; scored 0", res.error,
                                 call.function, call.data_source, res.message)
        return results

    def pids(self) -> list[int]:
        """The live workers' process ids (tests, and an operator's ``ps``)."""
        return [w.proc.pid for w in self._workers if w.alive()]

    def close(self) -> None:
        """Kill every worker; a call waiting for one raises RewardPoolError, one in flight ends as crashes."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            idle = list(self._idle)
        for w in self._workers:
            if w in idle:
                w.kill()
            else:  # in use: its caller reads the pipe's end, then reaps it
                w.stop_process()


__all__ = ["ERROR_KINDS", "MAX_EXTRA", "RateLimitedLog", "RewardCall", "RewardPool", "RewardPoolError",
           "RewardResult"]
