"""The buffer's positives: which samples of an arriving group are kept for NLL replay, and the learner's
``PositivesRequest``.

Not a CLI; used by ``buffer.ingest`` (harvest) and ``buffer.server`` (requests). The positives themselves
live in LMDB (``buffer.store``: deduplicated, oldest evicted first).
"""

from __future__ import annotations

import random

from buffer.layout import positive_hash
from buffer.store import BufferStore
from common.limits import is_positive
from common.protocol import PositivesRequest, SampleGroup
from common.splice import encode_positives_reply, sample_frames

MAX_POSITIVES_PER_REPLY = 1 << 16


def harvest_positives(group: SampleGroup, frame: bytes, positive_reward: float) -> list[tuple[bytes, bytes]]:
    """(dedup hash, encoded Sample) of every sample of ``group`` worth replaying, cut out of its ``frame``."""
    # A response cut at the length limit is never a positive, whatever its reward: imitating it would
    # teach the policy not to stop.
    keep = [is_positive(s, positive_reward) for s in group.samples]
    if not any(keep):
        return []
    # Stored as the exact bytes they arrived in: cut out of the frame, not encoded again.
    frames = sample_frames(frame)
    return [(positive_hash(s.prompt_ids, s.output_ids), f)
            for s, f, k in zip(group.samples, frames, keep, strict=True) if k]


class Positives:
    """Answers ``PositivesRequest(n)``: up to n distinct stored positives, drawn with the run's seeded rng."""

    def __init__(self, store: BufferStore, seed: int) -> None:
        self.store = store
        self.rng = random.Random(seed)

    def reply(self, req: PositivesRequest) -> bytes:
        """The encoded ``PositivesReply`` (the caller has LMDB to itself: the writer is idle)."""
        # Stored frames were validated at ingest: spliced into the reply, not decoded again.
        picked = self.store.sample_positives(min(req.n, MAX_POSITIVES_PER_REPLY), self.rng)
        return encode_positives_reply(picked)
