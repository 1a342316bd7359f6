"""The buffer's wait list: batch requests that wait for enough groups, at most one per serve connection.

Not a CLI; used by ``buffer.serving`` (which serves them from the event loop). No sockets and no clock:
deadlines are absolute ``time.monotonic()`` seconds computed by the caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from common.protocol import BatchRequest

MAX_BATCH_WAITS = 1024  # batch requests waiting at once (one per serve connection); the oldest is evicted


@dataclass
class BatchWait:
    """One BatchRequest waiting for groups: who asked (ROUTER identity + REQ envelope) and until when."""

    ident: bytes
    envelope: list[bytes]
    req: BatchRequest
    deadline: float


class BatchWaits:
    """Waiting batch requests by serve identity, oldest first."""

    def __init__(self, limit: int = MAX_BATCH_WAITS) -> None:
        self.limit = limit
        self.abandoned = 0  # dropped because their connection closed
        self._by_ident: dict[bytes, BatchWait] = {}

    def __len__(self) -> int:
        return len(self._by_ident)

    def __contains__(self, ident: bytes) -> bool:
        return ident in self._by_ident

    def __iter__(self) -> Iterator[BatchWait]:
        """Oldest first, over a copy: the caller may remove waits while iterating."""
        return iter(list(self._by_ident.values()))

    def add(self, w: BatchWait) -> BatchWait | None:
        """Queue ``w`` (its identity must not wait already); returns the oldest wait if it had to be evicted.

        Evicting the oldest (the caller answers it with a timeout, and clients ask again after a timeout)
        bounds memory against a flood of waiting requests and keeps the learner going; refusing new
        requests instead would turn the flood into an error for the learner.
        """
        evicted = None
        if len(self._by_ident) >= self.limit:
            evicted = self._by_ident.pop(next(iter(self._by_ident)))
        self._by_ident[w.ident] = w
        return evicted

    def remove(self, ident: bytes) -> BatchWait | None:
        return self._by_ident.pop(ident, None)

    def abandon(self, ident: bytes) -> bool:
        """The connection ``ident`` closed: drop its wait (it can no longer swallow groups)."""
        if self._by_ident.pop(ident, None) is None:
            return False
        self.abandoned += 1
        return True

    def clear(self) -> list[BatchWait]:
        out = list(self._by_ident.values())
        self._by_ident = {}
        return out

    def pending_n(self) -> int:
        """The largest ``n_groups`` waiting (0 when none): what admission control makes room for."""
        return max((w.req.n_groups for w in self._by_ident.values()), default=0)

    def first_deadline(self) -> float | None:
        return min((w.deadline for w in self._by_ident.values()), default=None)
