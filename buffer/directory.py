"""A buffer directory as a whole: the one-server lock, the offline repair and a read-only summary.

Not a CLI (``buffer.inspect`` is); used by ``buffer.server`` (the lock), ``buffer.inspect`` and the launcher's
checks. A running server holds an exclusive ``flock`` on ``server.lock`` in the directory (:func:`lock_server`),
so a second server, or an offline repair (:func:`repair_learner_version`), cannot write under it;
:func:`inspect` reads one snapshot and is safe while the server writes; :func:`ledger` reads every acknowledged
group and, with ``buffer.record_served``, every take (``ops.chaos.history`` checks them).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import lmdb

from buffer.layout import DATABASES, GROUP_KEY, SERVED_HEAD, SERVED_KEY, key_version, read_counters
from buffer.store import BufferStore

LOCK_FILE = "server.lock"


def lock_server(path: str | Path) -> int:
    """Take the buffer directory's exclusive server lock; returns the fd to keep open while serving.

    Raises OSError naming the holder's pid when another process (a server, a repair) holds it. The kernel
    drops the lock when the holder dies, so a SIGKILLed server never blocks its restart.
    """
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    fd = os.open(p / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise OSError(errno.EBUSY, f"buffer directory {p} is in use by a running buffer server (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_server(fd: int) -> None:
    os.close(fd)  # closing the last descriptor releases the flock


def repair_learner_version(path: str | Path, version: int) -> int:
    """Offline repair: set the durable learner version (e.g. after a bad client raised it); returns the old one.

    Refuses (OSError) while a server runs on ``path``: the server keeps its own copy of the counters.
    """
    p = Path(path)
    if not (p / "data.mdb").is_file():
        raise FileNotFoundError(f"{p} is not an LMDB buffer directory (no data.mdb)")
    fd = lock_server(p)
    try:
        store = BufferStore(p)
        try:
            return store.reset_learner_version(version)
        finally:
            store.close()
    finally:
        unlock_server(fd)


def inspect(path: str | Path) -> dict[str, Any]:
    """Summary of a buffer directory from one read-only snapshot (works while the server writes)."""
    p = Path(path)
    if not (p / "data.mdb").is_file():
        raise FileNotFoundError(f"{p} is not an LMDB buffer directory (no data.mdb)")
    # map_size=0 adopts the size recorded in the file; any other value would be reported instead (LMDB keeps
    # the larger of the requested and the recorded size), which showed py-lmdb's 10 MiB default here.
    env = lmdb.open(str(p), readonly=True, lock=True, max_dbs=8, subdir=True, readahead=False, map_size=0)
    try:
        with env.begin() as txn:
            dbs = {}
            for name in DATABASES:
                try:
                    dbs[name] = env.open_db(name.encode(), txn=txn, create=False)
                except lmdb.NotFoundError:
                    raise FileNotFoundError(f"{p}: database {name!r} missing; not a vapo buffer") from None
            counters = read_counters(txn, dbs["meta"])
            cur = txn.cursor(db=dbs["groups"])
            min_v = key_version(cur.key()) if cur.first() else None
            max_v = key_version(cur.key()) if cur.last() else None
            n_groups = txn.stat(dbs["groups"])["entries"]
            n_pos = txn.stat(dbs["positives"])["entries"]
        info = env.info()
    finally:
        env.close()
    st = os.stat(p / "data.mdb")
    return {
        "path": str(p),
        "groups": n_groups,
        "samples": counters["depth_samples"],
        "group_bytes": counters["depth_bytes"],
        "positives": n_pos,
        "min_weight_version": min_v,
        "max_weight_version": max_v,
        "learner_version": counters["learner_version"],
        "bytes_on_disk": int(st.st_blocks) * 512,
        "file_size": int(st.st_size),
        "map_size": int(info["map_size"]),
        "counters": counters,
    }


def ledger(path: str | Path) -> dict[str, Any]:
    """Every acknowledged group and its fate, the groups waiting, and each recorded take, from one snapshot.

    ``acked``: group_id -> (outcome byte, ``groups`` key or b""); ``waiting``: the ``groups`` keys still
    stored; ``takes`` (empty without ``buffer.record_served``): per take in commit order, ``learner_version``,
    ``min_version`` and the ``(weight_version, seq)`` of the groups ``served`` and ``dropped`` as stale.
    """
    env = lmdb.open(str(path), readonly=True, lock=True, max_dbs=8, subdir=True, readahead=False, map_size=0)
    try:
        with env.begin() as txn:
            gindex = env.open_db(b"gindex", txn=txn, create=False)
            groups = env.open_db(b"groups", txn=txn, create=False)
            acked = {k.decode(): (v[:1], bytes(v[1:])) for k, v in txn.cursor(db=gindex)}
            waiting = {bytes(k) for k in txn.cursor(db=groups).iternext(keys=True, values=False)}
            counters = read_counters(txn, env.open_db(b"meta", txn=txn, create=False))
            takes = []
            try:
                served = env.open_db(b"served", txn=txn, create=False)
            except lmdb.NotFoundError:
                served = None
            for k, v in txn.cursor(db=served) if served is not None else ():
                lv, mv, n_served, n_dropped = SERVED_HEAD.unpack(v[:SERVED_HEAD.size])
                keys = [GROUP_KEY.unpack(v[i:i + GROUP_KEY.size])[:2]
                        for i in range(SERVED_HEAD.size, len(v), GROUP_KEY.size)]
                takes.append({"at": SERVED_KEY.unpack(k), "learner_version": lv, "min_version": mv,
                              "served": keys[:n_served], "dropped": keys[n_served:n_served + n_dropped]})
    finally:
        env.close()
    return {"acked": acked, "waiting": waiting, "takes": takes, "counters": counters}
