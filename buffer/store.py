"""The buffer's durable state: one LMDB environment, no sockets.

Used by ``buffer.server`` (the only writer, through its roles) and ``buffer.directory`` (offline repair).

The key layout, value encodings and counters are in ``buffer.layout``; the directory lock, the offline
repair and the read-only summary (``inspect``) in ``buffer.directory``.

Every write is one transaction (a batch of groups, a batch take); callers acknowledge only after
:meth:`BufferStore.put_groups` returns, i.e. after the commit. ``MapFullError`` grows the map (doubling,
up to ``max_map_size`` when set) and retries the transaction; any other LMDB failure (disk full, file size
limit, I/O error) aborts the transaction, leaves the previous committed state intact, and raises
:class:`StorageError` with a short ``reason`` for the ``vapo_buffer_storage_errors`` metric.
"""

from __future__ import annotations

import errno
import os
import random
import resource
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from buffer.layout import (
    FILTERED,
    GROUP_KEY,
    HASH_BYTES,
    OUTCOMES,
    POSITIVE_KEY,
    SERVED_HEAD,
    SERVED_KEY,
    STORED,
    read_counters,
    version_bound,
    write_counters,
)


class StorageError(RuntimeError):
    """An LMDB write failed; nothing of the failed transaction was committed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass
class GroupRecord:
    """One validated group as the server hands it to the store."""

    group_id: str
    frame: bytes  # the encoded SampleGroup, stored verbatim
    weight_version: int
    n_samples: int
    positives: list[tuple[bytes, bytes]]  # (hash, encoded Sample) of verified-correct samples
    fate: bytes = STORED  # STORED, FILTERED or STALE, applied only if the group_id is new


def _classify(e: Exception, path: Path | None = None) -> str:
    msg = str(e).lower()
    code = getattr(e, "errno", None)
    if code == errno.ENOSPC or "no space" in msg:
        return "disk_full"
    if code == errno.EFBIG or "file too large" in msg:
        return "file_too_large"
    if path is not None and (code == errno.EIO or "input/output" in msg):
        # LMDB reports a short write (full disk, file size limit) as EIO: look at the likely causes.
        if shutil.disk_usage(path).free < 64 << 20:
            return "disk_full"
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft != resource.RLIM_INFINITY and _file_size(path) + (16 << 20) >= soft:
            return "file_too_large"
        return "io_error"
    if isinstance(e, lmdb.MapFullError):
        return "map_full"
    if isinstance(e, lmdb.PanicError):
        return "panic"
    return "lmdb_error"


class BufferStore:
    """Single-writer LMDB store of groups, positives and counters."""

    def __init__(
        self,
        path: str | Path,
        map_size: int = 1 << 30,
        max_map_size: int = 0,
        positives_capacity: int = 20000,
        on_commit: Callable[[float], None] | None = None,
        record_served: bool = False,
    ) -> None:
        self.path = Path(path)
        self.record_served = record_served
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_map_size = max_map_size
        self.positives_capacity = positives_capacity
        self.on_commit = on_commit
        self._map_size = map_size if not max_map_size else min(map_size, max_map_size)
        self._lock = threading.RLock()
        self._open()
        self.counters = self._read_counters()

    # ------------------------------------------------------------------ environment

    def _open(self) -> None:
        self.env = lmdb.open(
            str(self.path), map_size=self._map_size, max_dbs=8, subdir=True, sync=True, metasync=True,
            readahead=False, meminit=False, max_readers=256,
        )
        # LMDB keeps the larger of the requested and the stored map size.
        self._map_size = self.env.info()["map_size"]
        self.groups = self.env.open_db(b"groups")
        self.gindex = self.env.open_db(b"gindex")
        self.positives = self.env.open_db(b"positives")
        self.pindex = self.env.open_db(b"pindex")
        self.meta = self.env.open_db(b"meta")
        # Only asked for (the chaos run's history): it grows by 20 bytes per group served, never trimmed.
        self.served = self.env.open_db(b"served") if self.record_served else None

    def close(self) -> None:
        self.env.close()

    def _read_counters(self) -> dict[str, int]:
        with self.env.begin() as txn:
            return read_counters(txn, self.meta)

    def _grow(self) -> None:
        new = self._map_size * 2
        if self.max_map_size:
            if self._map_size >= self.max_map_size:
                raise StorageError("map_full", f"LMDB map is at buffer.max_map_size_bytes={self.max_map_size}")
            new = min(new, self.max_map_size)
        self.env.set_mapsize(new)
        self._map_size = new

    def _write(self, fn: Callable[[lmdb.Transaction, dict[str, int]], Any]) -> Any:
        """Run ``fn(txn, counters)`` in one write transaction; counters are committed with it."""
        with self._lock:  # one writer at a time, so the counters never lose an update
            return self._write_locked(fn)

    def _write_locked(self, fn: Callable[[lmdb.Transaction, dict[str, int]], Any]) -> Any:
        while True:
            c = dict(self.counters)
            try:
                txn = self.env.begin(write=True)
                try:
                    result = fn(txn, c)
                    write_counters(txn, self.meta, c, self.counters)
                except BaseException:
                    txn.abort()
                    raise
                t0 = time.perf_counter()
                txn.commit()
                if self.on_commit is not None:
                    self.on_commit(time.perf_counter() - t0)
            except lmdb.MapFullError:
                self._grow()
                continue
            except StorageError:
                raise
            except lmdb.Error as e:
                reason = _classify(e, self.path)
                # A failed commit can leave the environment unusable (MDB_PANIC); reopening is safe because
                # this process is the only writer and LMDB never exposes a partial transaction.
                try:
                    self.env.close()
                finally:
                    self._open()
                    self.counters = self._read_counters()
                raise StorageError(reason, f"LMDB write failed at {self.path}: {e}") from None
            except OSError as e:
                raise StorageError(_classify(e), f"LMDB write failed at {self.path}: {e}") from None
            self.counters = c
            return result

    # ------------------------------------------------------------------ groups

    def put_groups(self, records: Iterable[GroupRecord]) -> list[tuple[str, bool]]:
        """Store a batch in one transaction; returns ``(outcome, duplicate)`` per record after the commit.

        ``outcome`` is ``stored``, ``filtered`` or ``stale`` (for a duplicate: the first copy's outcome).
        """
        records = list(records)

        def fn(txn: lmdb.Transaction, c: dict[str, int]) -> list[tuple[str, bool]]:
            out = []
            for r in records:
                gid = r.group_id.encode()
                prev = txn.get(gid, db=self.gindex)
                if prev is not None:
                    c["duplicates"] += 1
                    out.append((OUTCOMES.get(prev[:1], "stored"), True))
                    continue
                key = b""
                if r.fate == STORED:
                    key = GROUP_KEY.pack(r.weight_version, c["next_seq"], r.n_samples)
                    c["next_seq"] += 1
                    txn.put(key, r.frame, db=self.groups)
                    c["depth_groups"] += 1
                    c["depth_samples"] += r.n_samples
                    c["depth_bytes"] += len(r.frame)
                    c["accepted_groups"] += 1
                    c["accepted_samples"] += r.n_samples
                elif r.fate == FILTERED:
                    c["filtered"] += 1
                else:
                    c["stale_dropped"] += 1
                txn.put(gid, r.fate + key, db=self.gindex)
                for h, frame in r.positives:
                    self._add_positive(txn, c, h, frame)
                out.append((OUTCOMES[r.fate], False))
            self._evict_positives(txn, c)
            return out

        return self._write(fn)

    def _drop_stale_in(self, txn: lmdb.Transaction, c: dict[str, int], min_version: int,
                       keys: list[bytes] | None = None) -> int:
        dropped = 0
        cur = txn.cursor(db=self.groups)
        while cur.first():
            version, _, n_samples = GROUP_KEY.unpack(cur.key())
            if version >= min_version:
                break
            c["depth_groups"] -= 1
            c["depth_samples"] -= n_samples
            c["depth_bytes"] -= len(cur.value())
            c["stale_dropped"] += 1
            if keys is not None:
                keys.append(cur.key())
            cur.delete()
            dropped += 1
        return dropped

    def known(self, group_id: str) -> bytes | None:
        """The gindex entry of a group_id (outcome byte + group key), or None if it never arrived."""
        with self.env.begin() as txn:
            return txn.get(group_id.encode(), db=self.gindex)

    def take_groups(self, n: int, min_version: int = 0, partial: bool = False,
                    served_version: int | None = None) -> tuple[list[bytes], int]:
        """Atomically drop stale groups, then remove and return the ``n`` oldest frames.

        Returns ``([], dropped)`` when fewer than ``n`` remain and ``partial`` is false (nothing is taken).
        ``served_version`` (when not None) is recorded as the ``served_version`` counter if groups are taken.
        """

        def fn(txn: lmdb.Transaction, c: dict[str, int]) -> tuple[list[bytes], int]:
            dropped_keys: list[bytes] | None = [] if self.served is not None else None
            dropped = self._drop_stale_in(txn, c, min_version, dropped_keys) if min_version > 0 else 0
            taken: list[bytes] = []
            if c["depth_groups"] < n and not partial:
                self._record_served(txn, c, min_version, taken, dropped_keys)
                return [], dropped
            frames: list[bytes] = []
            cur = txn.cursor(db=self.groups)
            while len(frames) < n and cur.first():
                v = cur.value()
                frames.append(v)
                taken.append(cur.key())
                c["depth_groups"] -= 1
                c["depth_samples"] -= GROUP_KEY.unpack(cur.key())[2]
                c["depth_bytes"] -= len(v)
                cur.delete()
            if frames:
                c["served_groups"] += len(frames)
                c["served_batches"] += 1
                if served_version is not None:
                    c["served_version"] = served_version
            self._record_served(txn, c, min_version, taken, dropped_keys)
            return frames, dropped

        if self.counters["depth_groups"] < n and not partial and (
            min_version <= 0 or self.counters["depth_groups"] == 0 or self.min_version() >= min_version
        ):
            return [], 0  # nothing to do: skip an empty write transaction
        return self._write(fn)

    def _record_served(self, txn: lmdb.Transaction, c: dict[str, int], min_version: int, taken: list[bytes],
                       dropped: list[bytes] | None) -> None:
        """With ``record_served``: the group keys this take served and dropped as stale, in its transaction."""
        if self.served is None or not (taken or dropped):
            return
        dropped = dropped or []
        head = SERVED_HEAD.pack(c["learner_version"], min_version, len(taken), len(dropped))
        txn.put(SERVED_KEY.pack(c["served_batches"], c["stale_dropped"]), head + b"".join(taken + dropped),
                db=self.served)

    def set_learner_version(self, version: int) -> None:
        """Raise the durable learner version (never lowers it: the server's admission rule is monotonic)."""
        if version > self.counters["learner_version"]:
            def fn(txn: lmdb.Transaction, c: dict[str, int]) -> None:
                c["learner_version"] = version
            self._write(fn)

    def reset_learner_version(self, version: int) -> int:
        """Set learner_version and served_version to ``version`` (an operator's repair); returns the old one."""
        old = self.counters["learner_version"]

        def fn(txn: lmdb.Transaction, c: dict[str, int]) -> None:
            c["learner_version"] = version
            c["served_version"] = version
        self._write(fn)
        return old

    def min_version(self) -> int:
        """Oldest weight version waiting (-1 when empty)."""
        return version_bound(self.env, self.groups, last=False)

    def max_version(self) -> int:
        return version_bound(self.env, self.groups, last=True)

    # ------------------------------------------------------------------ positives

    def _add_positive(self, txn: lmdb.Transaction, c: dict[str, int], h: bytes, frame: bytes) -> None:
        if self.positives_capacity <= 0:
            return
        if txn.get(h, db=self.pindex) is not None:
            c["positives_duplicates"] += 1
            return
        key = POSITIVE_KEY.pack(c["pos_next"])
        c["pos_next"] += 1
        txn.put(key, h + frame, db=self.positives)
        txn.put(h, key, db=self.pindex)

    def _evict_positives(self, txn: lmdb.Transaction, c: dict[str, int]) -> None:
        while c["pos_next"] - c["pos_head"] > self.positives_capacity:
            key = POSITIVE_KEY.pack(c["pos_head"])
            v = txn.get(key, db=self.positives)
            if v is not None:
                txn.delete(v[:HASH_BYTES], db=self.pindex)
                txn.delete(key, db=self.positives)
            c["pos_head"] += 1
            c["positives_evicted"] += 1

    @property
    def positives_count(self) -> int:
        return self.counters["pos_next"] - self.counters["pos_head"]

    def sample_positives(self, n: int, rng: random.Random | None = None) -> list[bytes]:
        """Up to ``n`` distinct stored positives (encoded Sample frames), uniformly at random."""
        rng = rng or random.Random()
        head, count = self.counters["pos_head"], self.positives_count
        picks = rng.sample(range(count), min(n, count)) if count else []
        out = []
        with self.env.begin() as txn:
            for i in picks:
                v = txn.get(POSITIVE_KEY.pack(head + i), db=self.positives)
                if v is not None:
                    out.append(v[HASH_BYTES:])
        return out

    def iter_positives(self) -> list[bytes]:
        """Every stored positive, oldest first (tests, tools)."""
        with self.env.begin() as txn:
            return [bytes(v[HASH_BYTES:]) for _, v in txn.cursor(db=self.positives)]

    # ------------------------------------------------------------------ reading

    def iter_group_frames(self) -> list[bytes]:
        """Every waiting group frame in serving order (tests, tools)."""
        with self.env.begin() as txn:
            return [bytes(v) for _, v in txn.cursor(db=self.groups)]

    def data_bytes(self) -> int:
        return _file_bytes(self.path)

    @property
    def map_size(self) -> int:
        return self._map_size


def _file_bytes(path: Path) -> int:
    try:
        st = os.stat(path / "data.mdb")
    except FileNotFoundError:
        return 0
    return int(st.st_blocks) * 512


def _file_size(path: Path) -> int:
    try:
        return os.stat(path / "data.mdb").st_size
    except FileNotFoundError:
        return 0
