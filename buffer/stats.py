"""The buffer's counters: the ``StatsReply`` dict and the Prometheus gauges (``vapo_buffer_*``).

Both read ``BufferServer`` (``buffer.server``) state and are its methods (bound as class attributes there,
so ``srv`` is the server): ``server_stats`` is ``BufferServer.stats`` (answers ``StatsRequest``),
``update_gauges`` is ``BufferServer._update_gauges`` (called every loop turn, at most every 0.5 s unless
forced, since the gauges read LMDB counters and the admission capacity).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the server imports this module; the type is for annotations only
    from buffer.server import BufferServer


def server_stats(srv: BufferServer) -> dict[str, float]:
    c = srv.store.counters
    out: dict[str, float] = {k: float(v) for k, v in c.items()}
    out.update({
        "positives": float(srv.store.positives_count),
        "min_version": float(srv.store.min_version()),
        "max_version": float(srv.store.max_version()),
        "credit_outstanding": float(srv.credits.in_flight),
        "credit_waiting": float(srv.credits.waiting),
        "credit_released": float(srv.credits.released),
        "batch_waiting": float(len(srv._waits)),
        "batch_waits_abandoned": float(srv._waits.abandoned),
        "admission_capacity": float(srv.capacity()),
        "rejected_total": float(sum(srv._rejected.values())),
        "batch_timeouts": float(srv._timeouts),
        "storage_errors": float(srv._storage_errors),
        "ingest_commits": float(srv._ingest_commits),
        "lmdb_bytes": float(srv.store.data_bytes()),
        "map_size": float(srv.store.map_size),
        "metrics_port": float(srv.m.port or 0),
        "pid": float(os.getpid()),
    })
    for reason, n in srv._rejected.items():
        out[f"rejected_{reason}"] = float(n)
    for reason, n in srv._invalid.items():
        out[f"invalid_{reason}"] = float(n)
    out["invalid_total"] = float(sum(srv._invalid.values()))
    out["auth_refused_ingest"] = float(srv._auth_refused["ingest"])
    out["auth_refused_serve"] = float(srv._auth_refused["serve"])
    return out


def update_gauges(srv: BufferServer, force: bool = False) -> None:
    now = time.monotonic()
    if not force and now - srv._last_gauges < 0.5:
        return
    srv._last_gauges = now
    c = srv.store.counters
    srv.m.depth_groups.set(c["depth_groups"])
    srv.m.depth_samples.set(c["depth_samples"])
    srv.m.depth_bytes.set(c["depth_bytes"])
    srv.m.positives_stored.set(srv.store.positives_count)
    srv.m.credit_outstanding.set(srv.credits.in_flight)
    srv.m.credit_waiting.set(srv.credits.waiting)
    srv.m.admission_capacity.set(srv.capacity())
    srv.m.learner_version.set(c["learner_version"])
    srv.m.lmdb_bytes.set(srv.store.data_bytes())
