"""Where the learner's batches come from: the buffer (``BufferSource``) or a fixed list (``ListSource``).

Not a CLI. Both expose ``get_batch(learner_version, n_groups, timeout_s) -> list[SampleGroup]``,
``positives(n) -> list[Sample]`` and ``state_dict()``/``load_state_dict()`` (the data cursor that goes into
checkpoints). Only rank 0 talks to the buffer; ``learner.train`` broadcasts what it got.

The staleness bound is enforced twice: the buffer serves only groups with
``weight_version >= learner_version - max_staleness`` and ``BufferSource`` drops (and counts) any group
that is still older, so a misconfigured buffer cannot feed the learner stale data silently.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from common.protocol import Sample, SampleGroup

# Longest wait of one BatchRequest: a long batch_timeout_s is asked for in turns of this length. Short, because
# a request the buffer never answers (it was killed and restarted meanwhile) costs this much plus the
# client's reply timeout before the learner asks the new buffer; a turn is one small message.
MAX_REQUEST_WAIT_S = 5.0


class DataSource(Protocol):
    def get_batch(self, learner_version: int, n_groups: int, timeout_s: float) -> list[SampleGroup]: ...

    def positives(self, n: int) -> list[Sample]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ListSource:
    """Serves ``groups`` in order, ``n_groups`` at a time, wrapping around (tests, benchmarks, replays)."""

    def __init__(self, groups: list[SampleGroup], positives: list[Sample] | None = None) -> None:
        if not groups:
            raise ValueError("ListSource needs at least one group")
        self.groups = groups
        self._positives = positives or []
        self.cursor = 0
        self.pos_cursor = 0

    def get_batch(self, learner_version: int, n_groups: int, timeout_s: float = 0.0) -> list[SampleGroup]:
        out = [self.groups[(self.cursor + i) % len(self.groups)] for i in range(n_groups)]
        self.cursor += n_groups
        return out

    @property
    def groups_consumed(self) -> int:
        return self.cursor

    def positives(self, n: int) -> list[Sample]:
        if not self._positives or n <= 0:
            return []
        out = [self._positives[(self.pos_cursor + i) % len(self._positives)] for i in range(n)]
        self.pos_cursor += n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "pos_cursor": self.pos_cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state.get("cursor", 0))
        self.pos_cursor = int(state.get("pos_cursor", 0))


class BufferSource:
    """Batches from the buffer server (``buffer.client.BatchClient``), collected until ``n_groups`` arrived."""

    def __init__(self, addr: str, max_staleness: int, client: Any | None = None, curve: Any = None) -> None:
        if client is None:
            from buffer.client import BatchClient
            from common.security import client_curve_keys

            client = BatchClient(addr, curve=client_curve_keys(curve) if curve is not None else None)
        self.client = client
        self.max_staleness = max_staleness
        self.groups_consumed = 0
        self.stale_dropped = 0
        self.filtered = 0  # uniform-reward groups the buffer dropped (DAPO dynamic sampling): generated, never trained
        self.wait_seconds = 0.0

    def get_batch(self, learner_version: int, n_groups: int, timeout_s: float) -> list[SampleGroup]:
        deadline = time.monotonic() + timeout_s
        out: list[SampleGroup] = []
        t0 = time.monotonic()
        while len(out) < n_groups:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"got {len(out)}/{n_groups} groups for learner version {learner_version} in {timeout_s:.0f} s; "
                    "are the actors and the buffer running?")
            try:
                reply = self.client.get_batch(learner_version, n_groups - len(out), min(left, MAX_REQUEST_WAIT_S))
            except TimeoutError:
                continue  # the buffer had too few groups in time; the deadline check above decides
            self.stale_dropped += int(reply.stale_dropped)
            self.filtered += int(reply.filtered)
            floor = learner_version - self.max_staleness
            for g in reply.groups:
                if g.weight_version < floor:
                    self.stale_dropped += 1
                else:
                    out.append(g)
        self.wait_seconds = time.monotonic() - t0
        self.groups_consumed += len(out)
        return out

    def positives(self, n: int) -> list[Sample]:
        return list(self.client.positives(n)) if n > 0 else []

    def state_dict(self) -> dict[str, Any]:
        # The buffer itself owns what was served (durable); the learner records how much it consumed.
        return {"groups_consumed": self.groups_consumed, "stale_dropped": self.stale_dropped,
                "filtered": self.filtered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups_consumed = int(state.get("groups_consumed", 0))
        self.stale_dropped = int(state.get("stale_dropped", 0))
        self.filtered = int(state.get("filtered", 0))
