"""Where the learner's batches come from and how every rank gets the same usable batch: the sources (the
buffer's ``BufferSource``, a fixed list's ``ListSource``) and ``fetch``, the one call a step makes.

Not a CLI. A ``DataSource`` lives on rank 0 only. For each step ``fetch`` asks it for the groups and the
stored positives (NLL replay), drops what the learner cannot use and asks again for as many:

    groups, positives = fetch(source, version, n_groups, timeout_s, limits=row_limits(cfg))   # on every rank

The data moves down this file once: a source's ``get_batch`` (stale groups dropped and counted) and
``positives`` → ``fetch`` (one rank: as decoded; more: rank 0 broadcasts the exact reply frames the source
received and the other ranks decode them once, while rank 0 keeps what it already decoded) →
``drop_unusable`` (bad rows dropped, counted, made up for by another ask). ``learner.batch`` then collates.

The staleness bound is enforced twice: the buffer serves only groups with
``weight_version >= learner_version - max_staleness`` and ``BufferSource`` drops (and counts) any group
that is still older, so a misconfigured buffer cannot feed the learner stale data silently. The other
ranks apply the same floor (``BatchFrames.min_version``) to the same frames.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from buffer.client import BatchClient, BufferStorageFailed
from common import protocol
from common.config import Config
from common.limits import (
    SampleLimits,
    group_problem,
    is_positive,
    limits_from_config,
    model_shape,
    sample_problem,
)
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
    """One ask's groups as rank 0 decoded them, and the frames they came in, for the other ranks.

    ``groups`` are the ``BatchReply`` groups of ``frames`` (in order) with ``weight_version >=
    min_version``; the source dropped the others (stale). ``frames`` None: the source holds its groups
    decoded (a list) and ``wire_frames`` encodes them only when another rank needs them."""

    groups: list[SampleGroup]
    frames: list[bytes] | None = None
    min_version: int = NO_FLOOR

    @classmethod
    def decode(cls, frames: list[bytes], min_version: int) -> BatchFrames:
        groups = [g for f in frames for g in protocol.decode_as(f, protocol.BatchReply, max_frame_bytes=len(f)).groups
                  if g.weight_version >= min_version]
        return cls(groups, frames, min_version)

    def wire_frames(self) -> list[bytes]:
        """The frames to broadcast: the source's own, or the one ``BatchReply`` a buffer would have sent."""
        if self.frames is not None:
            return self.frames
        return [protocol.encode_batch_reply([protocol.encode(g) for g in self.groups], 0, 0)]


@dataclass(frozen=True)
class Positives:
    """Stored positives for NLL replay, and the ``PositivesReply`` frame they came in (None: encode on demand)."""

    samples: list[Sample]
    frame: bytes | None = None

    @staticmethod
    def decode(frame: bytes) -> list[Sample]:
        """The samples of a ``PositivesReply`` frame; ``b""`` (none were asked for) gives []."""
        if not frame:
            return []
        return protocol.decode_as(frame, protocol.PositivesReply, max_frame_bytes=len(frame)).samples

    def wire_frame(self) -> bytes:
        if self.frame is not None:
            return self.frame
        return protocol.encode(protocol.PositivesReply(samples=self.samples)) if self.samples else b""


class DataSource(Protocol):
    """What ``fetch`` needs from rank 0's source: a batch (decoded groups, and the frames they arrived in when
    there are any), stored positives, and the data cursor that goes into checkpoints."""

    def get_batch(self, learner_version: int, n_groups: int, timeout_s: float) -> BatchFrames: ...

    def positives(self, n: int) -> Positives: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def totals(self) -> dict[str, int]:
        """The cumulative group counts this source keeps, by name (``groups_consumed``, and for the buffer
        ``stale_dropped`` and ``filtered``: groups generated, paid for, never trained on)."""
        ...


def _no_count(reason: str, n: int) -> None:
    """``fetch``'s default ``count``: the caller keeps no metric of dropped rows (tests, tools)."""


def fetch(source: DataSource | None, version: int, n_groups: int, timeout_s: float, *,
          limits: SampleLimits = SampleLimits(), count: Callable[[str, int], None] = _no_count,
          replay_fraction: float = 0.0, positive_reward: float = 1.0) -> tuple[list[SampleGroup], list[Sample]]:
    """``n_groups`` usable groups and the stored positives that came with them (``replay_fraction`` per positive
    of each ask, as ``common.limits.is_positive`` says: finished, reward >= ``positive_reward``), the same on
    every rank. Rank 0 asks ``source``; the other ranks pass None. Rows outside ``limits`` are dropped, counted
    with ``count(reason, samples)`` and asked for again; every rank sees the same rows, so every rank asks alike."""
    groups: list[SampleGroup] = []
    extra: list[Sample] = []
    while len(groups) < n_groups:
        got, pos, dropped = drop_unusable(*_fetch_once(source, version, n_groups - len(groups), timeout_s,
                                                       replay_fraction, positive_reward), limits)
        for reason, n in dropped.items():
            count(reason, n)
        groups += got
        extra += pos
    return groups, extra


def _fetch_once(source: DataSource | None, version: int, n_groups: int, timeout_s: float, replay_fraction: float,
                positive_reward: float) -> tuple[list[SampleGroup], list[Sample]]:
    """One ask of rank 0's source, handed to every rank (decoded once per hop)."""
    def work() -> tuple[BatchFrames, Positives]:
        assert source is not None, "rank 0 needs a data source"
        batch = source.get_batch(version, n_groups, timeout_s)
        return batch, source.positives(_n_replay(batch.groups, replay_fraction, positive_reward))

    if world_size() == 1:
        batch, positives = work()
        return batch.groups, positives.samples
    # The wait for the buffer can last learner.batch_timeout_s, far past the process group's timeout:
    # rank0_wait keeps the other ranks hearing from rank 0 meanwhile.
    got = rank0_wait(work if rank() == 0 else None, "waiting for a batch")
    header = frames = None
    if got is not None:
        batch, positives = got
        header, frames = [batch.min_version], [*batch.wire_frames(), positives.wire_frame()]
    header, frames = broadcast_ints(header), broadcast_frames(frames)
    if got is not None:
        return batch.groups, positives.samples
    return BatchFrames.decode(frames[:-1], header[0]).groups, Positives.decode(frames[-1])


def _n_replay(groups: list[SampleGroup], replay_fraction: float, positive_reward: float) -> int:
    n_pos = sum(1 for g in groups for s in g.samples if is_positive(s, positive_reward))
    return int(round(replay_fraction * n_pos))


def row_limits(cfg: Config) -> SampleLimits:
    """What a usable row is for this learner: the run's bounds (``common.limits``), with the vocabulary of the
    model it trains (``buffer.vocab_size`` may only narrow it: an id past the embedding table is an index error)."""
    lim = limits_from_config(cfg)
    vocab = model_shape(cfg.model.path)[0]
    if vocab and (lim.vocab_size == 0 or lim.vocab_size > vocab):
        lim = replace(lim, vocab_size=vocab)
    return lim


def drop_unusable(groups: list[SampleGroup], extra: list[Sample], lim: SampleLimits
                  ) -> tuple[list[SampleGroup], list[Sample], dict[str, int]]:
    """The groups and replayed positives the learner can train on, and how many samples were dropped per reason.

    The buffer refuses such groups at ingest; this is the learner's own guard (a buffer directory filled before
    the check, a changed config on resume): a bad sample drops its whole group (group statistics need all of
    it), a bad positive only itself. Never raises on what a row holds."""
    dropped: dict[str, int] = {}

    def usable(problem: tuple[str, str] | None, n_samples: int) -> bool:
        if problem is not None:
            dropped[problem[0]] = dropped.get(problem[0], 0) + n_samples
        return problem is None

    kept = [g for g in groups if usable(group_problem(g, lim), len(g.samples))]
    pos = [s for s in extra if usable(sample_problem(s, lim), 1)]
    return kept, pos, dropped


class ListSource:
    """Serves ``groups`` in order, ``n_groups`` at a time, wrapping around (tests, benchmarks, replays)."""

    def __init__(self, groups: list[SampleGroup], positives: list[Sample] | None = None) -> None:
        if not groups:
            raise ValueError("ListSource needs at least one group")
        self.groups = groups
        self._positives = positives or []
        self.cursor = 0
        self.pos_cursor = 0

    def get_batch(self, learner_version: int, n_groups: int, timeout_s: float = 0.0) -> BatchFrames:
        out = [self.groups[(self.cursor + i) % len(self.groups)] for i in range(n_groups)]
        self.cursor += n_groups
        return BatchFrames(out)

    @property
    def groups_consumed(self) -> int:
        return self.cursor

    def totals(self) -> dict[str, int]:
        return {"groups_consumed": self.cursor}  # a list drops nothing

    def positives(self, n: int) -> Positives:
        if not self._positives or n <= 0:
            return Positives([])
        out = [self._positives[(self.pos_cursor + i) % len(self._positives)] for i in range(n)]
        self.pos_cursor += n
        return Positives(out)

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

    def get_batch(self, learner_version: int, n_groups: int, timeout_s: float) -> BatchFrames:
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

    def positives(self, n: int) -> Positives:
        if n <= 0:
            return Positives([], b"")
        samples, frame = self.client.positives_frame(n)
        return Positives(list(samples), frame)

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
