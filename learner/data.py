"""Where the learner's batches come from: the buffer (``BufferSource``) or a fixed list (``ListSource``),
and how every rank gets the same batch (``fetch``).

Not a CLI. A ``DataSource`` lives on rank 0 only. For each step ``fetch`` asks it for the groups and the
stored positives (NLL replay):

    groups, positives = fetch(source, version, n_groups, timeout_s, replay_fraction)   # on every rank

Decode once per hop: with one rank the source's decoded groups are used as they are and nothing is
encoded or broadcast; with more, rank 0 broadcasts the exact reply frames the source received
(``BatchFrames``: the buffer's ``BatchReply`` frames and its ``PositivesReply`` frame) and the other ranks
decode them once, while rank 0 keeps what it already decoded.

The staleness bound is enforced twice: the buffer serves only groups with
``weight_version >= learner_version - max_staleness`` and ``BufferSource`` drops (and counts) any group
that is still older, so a misconfigured buffer cannot feed the learner stale data silently. The other
ranks apply the same floor (``BatchFrames.min_version``) to the same frames.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from buffer.client import BatchClient, BufferStorageFailed
from common import protocol
from common.limits import is_positive
from common.protocol import Sample, SampleGroup
from common.security import client_curve_keys
from learner.dist import broadcast_frames, broadcast_ints, rank, rank0_wait, world_size

# Longest wait of one BatchRequest: a long batch_timeout_s is asked for in turns of this length. Short, because
# a request the buffer never answers (it was killed and restarted meanwhile) costs this much plus the
# client's reply timeout before the learner asks the new buffer; a turn is one small message.
MAX_REQUEST_WAIT_S = 5.0

log = logging.getLogger(__name__)


NO_FLOOR = -(1 << 62)  # BatchFrames.min_version that keeps every group


@dataclass(frozen=True)
class BatchFrames:
    """One step's groups as rank 0 decoded them, and the frames they came in, for the other ranks.

    ``groups`` are the ``BatchReply`` groups of ``frames`` (in order) with ``weight_version >=
    min_version``; the source dropped the others (stale)."""

    groups: list[SampleGroup]
    frames: list[bytes]
    min_version: int = NO_FLOOR

    @classmethod
    def decode(cls, frames: list[bytes], min_version: int) -> BatchFrames:
        groups = [g for f in frames for g in protocol.decode_as(f, protocol.BatchReply, max_frame_bytes=len(f)).groups
                  if g.weight_version >= min_version]
        return cls(groups, frames, min_version)


def decode_positives(frame: bytes) -> list[Sample]:
    """The samples of a ``PositivesReply`` frame; ``b""`` (none were asked for) gives []."""
    if not frame:
        return []
    return protocol.decode_as(frame, protocol.PositivesReply, max_frame_bytes=len(frame)).samples


class DataSource(Protocol):
    """What ``fetch`` needs from rank 0's source: decoded groups (one rank), or decoded groups and the frames
    they arrived in (several ranks), and the data cursor that goes into checkpoints."""

    def get_batch(self, learner_version: int, n_groups: int, timeout_s: float) -> list[SampleGroup]: ...

    def get_batch_frames(self, learner_version: int, n_groups: int, timeout_s: float) -> BatchFrames: ...

    def positives(self, n: int) -> list[Sample]: ...

    def positives_frame(self, n: int) -> tuple[list[Sample], bytes]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def totals(self) -> dict[str, int]:
        """The cumulative group counts this source keeps, by name (``groups_consumed``, and for the buffer
        ``stale_dropped`` and ``filtered``: groups generated, paid for, never trained on)."""
        ...


def fetch(source: DataSource | None, version: int, n_groups: int, timeout_s: float,
          replay_fraction: float = 0.0, positive_reward: float = 1.0) -> tuple[list[SampleGroup], list[Sample]]:
    """The step's groups and stored positives (``replay_fraction`` per positive of the batch, as
    ``common.limits.is_positive`` says: finished, reward >= ``positive_reward``), the same on every rank.
    Rank 0 asks ``source``; the other ranks pass None."""
    if world_size() == 1:
        assert source is not None, "rank 0 needs a data source"
        groups = source.get_batch(version, n_groups, timeout_s)
        return groups, source.positives(_n_replay(groups, replay_fraction, positive_reward))
    def work() -> tuple[BatchFrames, list[Sample], bytes]:
        assert source is not None, "rank 0 needs a data source"
        batch = source.get_batch_frames(version, n_groups, timeout_s)
        positives, pos_frame = source.positives_frame(_n_replay(batch.groups, replay_fraction, positive_reward))
        return batch, positives, pos_frame

    # The wait for the buffer can last learner.batch_timeout_s, far past the process group's timeout:
    # rank0_wait keeps the other ranks hearing from rank 0 meanwhile.
    got = rank0_wait(work if rank() == 0 else None, "waiting for a batch")
    header = frames = None
    if got is not None:
        batch, positives, pos_frame = got
        header, frames = [batch.min_version], [*batch.frames, pos_frame]
    header, frames = broadcast_ints(header), broadcast_frames(frames)
    if got is not None:
        return batch.groups, positives
    return BatchFrames.decode(frames[:-1], header[0]).groups, decode_positives(frames[-1])


def _n_replay(groups: list[SampleGroup], replay_fraction: float, positive_reward: float) -> int:
    n_pos = sum(1 for g in groups for s in g.samples if is_positive(s, positive_reward))
    return int(round(replay_fraction * n_pos))


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

    def get_batch_frames(self, learner_version: int, n_groups: int, timeout_s: float = 0.0) -> BatchFrames:
        """``get_batch`` plus the one ``BatchReply`` frame a buffer would have sent for it."""
        groups = self.get_batch(learner_version, n_groups, timeout_s)
        return BatchFrames(groups, [protocol.encode_batch_reply([protocol.encode(g) for g in groups], 0, 0)])

    @property
    def groups_consumed(self) -> int:
        return self.cursor

    def totals(self) -> dict[str, int]:
        return {"groups_consumed": self.cursor}  # a list drops nothing

    def positives(self, n: int) -> list[Sample]:
        if not self._positives or n <= 0:
            return []
        out = [self._positives[(self.pos_cursor + i) % len(self._positives)] for i in range(n)]
        self.pos_cursor += n
        return out

    def positives_frame(self, n: int) -> tuple[list[Sample], bytes]:
        """``positives`` plus its ``PositivesReply`` frame (``b""`` when none were asked for)."""
        if n <= 0:
            return [], b""
        out = self.positives(n)
        return out, protocol.encode(protocol.PositivesReply(samples=out))

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "pos_cursor": self.pos_cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state.get("cursor", 0))
        self.pos_cursor = int(state.get("pos_cursor", 0))


class BufferSource:
    """Batches from the buffer server (``buffer.client.BatchClient``), collected until ``n_groups`` arrived."""

    def __init__(self, addr: str, max_staleness: int, client: Any | None = None, curve: Any = None) -> None:
        if client is None:
            client = BatchClient(addr, curve=client_curve_keys(curve, "learner") if curve is not None else None)
        self.client = client
        self.max_staleness = max_staleness
        self.groups_consumed = 0
        self.stale_dropped = 0
        self.filtered = 0  # uniform-reward groups the buffer dropped (DAPO dynamic sampling): generated, never trained
        self.wait_seconds = 0.0

    def get_batch(self, learner_version: int, n_groups: int, timeout_s: float) -> list[SampleGroup]:
        return self.get_batch_frames(learner_version, n_groups, timeout_s).groups

    def get_batch_frames(self, learner_version: int, n_groups: int, timeout_s: float) -> BatchFrames:
        deadline = time.monotonic() + timeout_s
        out: list[SampleGroup] = []
        frames: list[bytes] = []
        floor = learner_version - self.max_staleness
        t0 = time.monotonic()
        while len(out) < n_groups:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"got {len(out)}/{n_groups} groups for learner version {learner_version} in {timeout_s:.0f} s; "
                    "are the actors and the buffer running?")
            try:
                reply, frame = self.client.get_batch_frame(learner_version, n_groups - len(out),
                                                           min(left, MAX_REQUEST_WAIT_S))
            except BufferStorageFailed as e:  # a full disk answers at once: ask again a second later
                log.warning("batch not served, asking again: %s", e)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            except TimeoutError:
                continue  # the buffer had too few groups in time; the deadline check above decides
            frames.append(frame)
            self.stale_dropped += int(reply.stale_dropped)
            self.filtered += int(reply.filtered)
            for g in reply.groups:
                if g.weight_version < floor:
                    self.stale_dropped += 1
                else:
                    out.append(g)
        self.wait_seconds = time.monotonic() - t0
        self.groups_consumed += len(out)
        return BatchFrames(out, frames, floor)

    def positives(self, n: int) -> list[Sample]:
        return self.positives_frame(n)[0]

    def positives_frame(self, n: int) -> tuple[list[Sample], bytes]:
        if n <= 0:
            return [], b""
        samples, frame = self.client.positives_frame(n)
        return list(samples), frame

    def state_dict(self) -> dict[str, Any]:
        # The buffer itself owns what was served (durable); the learner records how much it consumed.
        return self.totals()

    def totals(self) -> dict[str, int]:
        return {"groups_consumed": self.groups_consumed, "stale_dropped": self.stale_dropped,
                "filtered": self.filtered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups_consumed = int(state.get("groups_consumed", 0))
        self.stale_dropped = int(state.get("stale_dropped", 0))
        self.filtered = int(state.get("filtered", 0))
