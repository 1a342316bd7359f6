"""The buffer's LMDB layout: database names, key and value encodings, the durable counters.

Not a CLI; shared by ``buffer.store`` (the writer), ``buffer.directory`` (read-only summary, offline repair)
and ``buffer.positives`` (the positives' dedup key). Changing anything here changes the on-disk format.

Databases:

- ``groups``: key = big-endian ``(weight_version, seq, n_samples)`` (8 + 8 + 4 bytes), so a cursor walks
  groups oldest weight version first, arrival order within a version. Value = the group's encoded
  ``SampleGroup`` frame exactly as received (stored and served without a copy being re-encoded: see
  ``common.protocol.encode_batch_reply``).
- ``gindex``: group_id -> outcome byte (``S`` stored, ``F`` filtered, ``X`` stale on arrival) + group key.
  Re-sent group_ids find their entry and are acknowledged again without a second copy. Entries are kept
  after a group is served, so a late re-send is still recognised (about 40 bytes per group ever seen).
- ``positives``: key = big-endian seq; value = 16-byte hash + encoded ``Sample`` frame. Keys are contiguous
  from ``pos_head`` to ``pos_next - 1``; eviction removes the oldest (head) first.
- ``pindex``: blake2b-128(len(prompt) | prompt ids | output ids) -> positives key (deduplication).
- ``served`` (only with ``buffer.record_served``): key = big-endian ``(served_batches, stale_dropped)`` after
  a take; value = ``SERVED_HEAD`` (learner version, the staleness floor ``min_version``, groups served,
  groups dropped as stale) then the ``groups`` keys served, then those dropped. Written in the take's
  transaction, so it is exact after any crash (``ops.chaos.history`` reads it).
- ``meta``: named signed 64-bit counters (depth, totals, learner version, sequence numbers) written in the
  same transaction as the data they describe, so they are exact after any crash; the server re-seeds its
  admission control from them on start. ``served_version`` is the learner version that the last full
  learner batch served was requested with: the server lets a client raise the learner version only a
  bounded step past it.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import lmdb
import numpy as np

DATABASES = ("groups", "gindex", "positives", "pindex", "meta")

GROUP_KEY = struct.Struct(">QQI")  # weight_version, seq, n_samples (never affects order: seq is unique)
POSITIVE_KEY = struct.Struct(">Q")  # positives seq; also the first 8 bytes of a group key (its weight version)
COUNTER_VALUE = struct.Struct(">q")
SERVED_KEY = struct.Struct(">QQ")  # served_batches, stale_dropped after the take
SERVED_HEAD = struct.Struct(">qqII")  # learner_version, min_version, n served, n dropped stale
_PROMPT_LEN = struct.Struct(">I")
HASH_BYTES = 16

STORED, FILTERED, STALE = b"S", b"F", b"X"
OUTCOMES = {STORED: "stored", FILTERED: "filtered", STALE: "stale"}

COUNTERS = (
    "next_seq",  # next group sequence number
    "depth_groups", "depth_samples", "depth_bytes",  # groups waiting to be served
    "accepted_groups", "accepted_samples",  # ever stored
    "served_groups", "served_batches",
    "stale_dropped",  # groups removed or refused for staleness
    "filtered",  # groups refused by a filter
    "duplicates",  # re-sent group_ids
    "learner_version",  # newest learner version seen
    "served_version",  # learner version the last full learner batch served was requested with
    "pos_next", "pos_head",  # positives key range
    "positives_duplicates", "positives_evicted",
)


def positive_hash(prompt_ids: np.ndarray, output_ids: np.ndarray) -> bytes:
    """Dedup key of a positive: same prompt tokens and same output tokens."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(_PROMPT_LEN.pack(int(prompt_ids.shape[0])))
    h.update(np.ascontiguousarray(prompt_ids, dtype="<i4").tobytes())
    h.update(np.ascontiguousarray(output_ids, dtype="<i4").tobytes())
    return h.digest()


def key_version(key: bytes) -> int:
    """The weight version of a ``groups`` key."""
    return POSITIVE_KEY.unpack(key[:8])[0]


def read_counters(txn: lmdb.Transaction, meta: Any) -> dict[str, int]:
    """Every counter of ``meta`` (0 when never written)."""
    out = {}
    for name in COUNTERS:
        v = txn.get(name.encode(), db=meta)
        out[name] = COUNTER_VALUE.unpack(v)[0] if v is not None else 0
    if txn.get(b"served_version", db=meta) is None:
        # A directory written before served_version existed: trust its learner version as served, so the
        # learner that wrote it may continue one step past it.
        out["served_version"] = out["learner_version"]
    return out


def write_counters(txn: lmdb.Transaction, meta: Any, counters: dict[str, int], old: dict[str, int]) -> None:
    """Write the counters that changed since ``old`` (and any never written)."""
    for k, v in counters.items():
        if old.get(k) != v or txn.get(k.encode(), db=meta) is None:
            txn.put(k.encode(), COUNTER_VALUE.pack(v), db=meta)


def version_bound(env: lmdb.Environment, groups: Any, last: bool) -> int:
    """Newest (``last``) or oldest weight version waiting in ``groups``; -1 when empty."""
    with env.begin() as txn:
        cur = txn.cursor(db=groups)
        ok = cur.last() if last else cur.first()
        return key_version(cur.key()) if ok else -1
