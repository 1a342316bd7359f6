"""The buffer's counters: the ``StatsReply`` dict and the Prometheus gauges (``vapo_buffer_*``).

Not a CLI; used by ``buffer.server``. ``BufferStats`` only reads the other roles' state: ``reply`` answers
``StatsRequest``, ``update_gauges`` runs every loop turn (at most every 0.5 s unless forced, since the
gauges read LMDB counters and the admission capacity).
"""

from __future__ import annotations

import os
import time

from buffer.admission import Admission
from buffer.frames import FrameRejections
from buffer.ingest import Ingest
from buffer.peers import Peers
from buffer.serving import BatchServing
from buffer.store import BufferStore
from common.metrics import Metrics

GAUGE_INTERVAL_S = 0.5


class BufferStats:
    """Reads the store and the roles into ``StatsReply`` counters and the gauges."""

    def __init__(self, store: BufferStore, metrics: Metrics, *, ingest: Ingest, serving: BatchServing,
                 admission: Admission, rejections: FrameRejections, serve_peers: Peers) -> None:
        self.store = store
        self.metrics = metrics
        self.ingest = ingest
        self.serving = serving
        self.admission = admission
        self.rejections = rejections
        self.serve_peers = serve_peers
        self._last_gauges = 0.0

    def reply(self) -> dict[str, float]:
        """The ``StatsReply.stats`` map (the caller has LMDB to itself)."""
        store, ledger, waits = self.store, self.admission.ledger, self.serving.waits
        out: dict[str, float] = {k: float(v) for k, v in store.counters.items()}
        out.update({
            "positives": float(store.positives_count),
            "min_version": float(store.min_version()),
            "max_version": float(store.max_version()),
            "credit_outstanding": float(ledger.in_flight),
            "credit_waiting": float(ledger.waiting),
            "credit_released": float(ledger.released),
            "credit_reclaimed": float(ledger.reclaimed),
            "batch_waiting": float(len(waits)),
            "batch_waits_abandoned": float(waits.abandoned),
            "admission_capacity": float(self.admission.capacity()),
            "rejected_total": float(self.rejections.total),
            "batch_timeouts": float(self.serving.timeouts),
            "storage_errors": float(self.ingest.storage_errors),
            "ingest_commits": float(self.ingest.commits),
            "lmdb_bytes": float(store.data_bytes()),
            "map_size": float(store.map_size),
            "metrics_port": float(self.metrics.port or 0),
            "pid": float(os.getpid()),
        })
        for reason, n in self.rejections.by_reason.items():
            out[f"rejected_{reason}"] = float(n)
        for reason, n in self.ingest.invalid.items():
            out[f"invalid_{reason}"] = float(n)
        out["invalid_total"] = float(sum(self.ingest.invalid.values()))
        out["auth_refused_ingest"] = float(self.ingest.peers.refused_reported)
        out["auth_refused_serve"] = float(self.serve_peers.refused_reported)
        return out

    def update_gauges(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_gauges < GAUGE_INTERVAL_S:
            return
        self._last_gauges = now
        counters, metrics, ledger = self.store.counters, self.metrics, self.admission.ledger
        metrics.depth_groups.set(counters["depth_groups"])
        metrics.depth_samples.set(counters["depth_samples"])
        metrics.depth_bytes.set(counters["depth_bytes"])
        metrics.positives_stored.set(self.store.positives_count)
        metrics.credit_outstanding.set(ledger.in_flight)
        metrics.credit_waiting.set(ledger.waiting)
        metrics.admission_capacity.set(self.admission.capacity())
        metrics.learner_version.set(counters["learner_version"])
        metrics.lmdb_bytes.set(self.store.data_bytes())
