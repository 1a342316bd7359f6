"""What waits for the scheduler thread: the sequences waiting for a KV slot with the tokens they hold
against the bound (``WaitQueue``, of ``Sequence``), and the control calls waiting for a step boundary
(``Commands``).

Not a CLI. ``common.generation.scheduler.Scheduler`` owns one and calls it under its condition variable
(neither queue takes a lock). Each waiting sequence counts prompt + ``max_new_tokens`` tokens against
``max_queued_tokens``; a request that would pass it is refused whole (``SchedulerBusy``, the server's 503)
before any of its sequences is queued.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.generation.sampling import RequestError, SamplingParams


class SchedulerBusy(RuntimeError):
    """The waiting queue holds too many tokens to take this request (the server answers 503)."""


@dataclass
class Sequence:
    """One sample being generated (a request with n > 1 or a batch becomes several)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Sequence], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    retractions: int = 0
    created: float = field(default_factory=time.time)
    finished_at: float = 0.0
    # Slot bookkeeping: how many positions of this sequence's KV are in the cache.
    cached_len: int = 0
    # Tokens this sequence counts against ``max_queued_tokens`` while it waits (prompt + max_new_tokens).
    cost: int = 0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def record(self, tok: int, logprob: float, version: str, eos_token_ids: set[int], context_length: int) -> bool:
        """Append one generated token (with the weight version that produced it); True when it ends the
        sequence: EOS (unless ``ignore_eos``), a stop token, ``max_new_tokens`` or the context length."""
        self.output_ids.append(tok)
        self.logprobs.append(logprob)
        self.versions.append(version)
        p = self.params
        if (not p.ignore_eos and tok in eos_token_ids) or tok in p.stop_token_ids:
            self.finish = {"type": "stop", "matched": tok}
        elif len(self.output_ids) >= p.max_new_tokens or self.cached_len >= context_length:
            self.finish = {"type": "length", "length": len(self.output_ids)}
        return self.finish is not None


def aborted(message: str, status_code: int | None = None) -> dict[str, Any]:
    """The finish of a sequence cut short: SGLang's ``finish_reason`` for an abort."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


class WaitQueue:
    """Sequences in arrival order (retracted ones back at the front) and the tokens they hold."""

    def __init__(self, max_queued_tokens: int) -> None:
        self.max_queued_tokens = max_queued_tokens
        self.tokens = 0
        self._seqs: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._seqs)

    def first(self) -> Sequence:
        return self._seqs[0]

    def admissible(self, cost: int) -> None:
        """Raise ``SchedulerBusy`` unless ``cost`` more queued tokens fit under ``max_queued_tokens``."""
        if cost > self.max_queued_tokens:
            raise RequestError(f"The request needs {cost} tokens (prompts x n x (input + max_new_tokens)), more "
                               f"than the server queues at once ({self.max_queued_tokens}, --max-queued-tokens).")
        if self.tokens + cost > self.max_queued_tokens:
            raise SchedulerBusy(f"The server is busy: {self.tokens} tokens are queued and this request needs "
                                f"{cost} more (limit {self.max_queued_tokens}, --max-queued-tokens). Retry later.")

    def push(self, s: Sequence, *, front: bool = False) -> None:
        """Queue ``s`` last (a new request) or first (``front``: retracted from its slot)."""
        if front:
            self._seqs.appendleft(s)
        else:
            self._seqs.append(s)
        self.tokens += s.cost

    def retract(self, running: list[Sequence]) -> None:
        """Put the ``running`` sequences back at the front, in slot order: they recompute their KV later."""
        for s in reversed(running):
            s.retractions += 1
            s.cached_len = 0
            self.push(s, front=True)

    def pop(self) -> Sequence:
        s = self._seqs.popleft()
        self.tokens -= s.cost
        return s

    def take(self, free: int, max_prefill_tokens: int) -> list[Sequence]:
        """Up to ``free`` sequences for one prefill of at most ``max_prefill_tokens`` (always at least one)."""
        batch: list[Sequence] = []
        tokens = 0
        while self._seqs and len(batch) < free:
            ctx = len(self._seqs[0].prompt_ids) + len(self._seqs[0].output_ids)
            if batch and tokens + ctx > max_prefill_tokens:
                break
            batch.append(self.pop())
            tokens += ctx
        return batch

    def remove(self, hit: Callable[[Sequence], bool]) -> list[Sequence]:
        """Take out every sequence ``hit`` selects; returns them."""
        gone = [s for s in self._seqs if hit(s)]
        self._seqs = deque(s for s in self._seqs if not hit(s))
        self.tokens -= sum(s.cost for s in gone)
        return gone

    def drain(self) -> list[Sequence]:
        """Everything waiting, the queue left empty."""
        return self.remove(lambda s: True)


class Commands:
    """Calls from any thread, run on the scheduler thread at its next step boundary; each answers a future."""

    def __init__(self) -> None:
        self._items: deque[tuple[Callable[[], Any], cf.Future]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, fn: Callable[[], Any]) -> cf.Future:
        fut: cf.Future = cf.Future()
        self._items.append((fn, fut))
        return fut

    def take(self) -> list[tuple[Callable[[], Any], cf.Future]]:
        items = list(self._items)
        self._items.clear()
        return items

    @staticmethod
    def run(items: list[tuple[Callable[[], Any], cf.Future]]) -> None:
        for fn, fut in items:
            try:
                fut.set_result(fn())
            except BaseException as e:  # report to the caller, keep serving
                fut.set_exception(e)
