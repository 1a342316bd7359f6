"""Serving batches to the learner: ``BatchRequest`` checks, the wait list, the staleness rule, one batch.

Not a CLI; used by ``buffer.server``, which reads the serve socket and routes each ``BatchRequest`` here (the
rules are in that module's docstring). Every call here runs while the writer thread is idle: the caller
settles the commit in progress first (``settle``), so LMDB is this thread's alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from buffer.frames import FrameRejections
from buffer.store import BufferStore, StorageError
from buffer.waits import BatchWait, BatchWaits
from common.config import Config
from common.metrics import Metrics
from common.protocol import BatchRequest, ErrorReply, encode, encode_batch_reply

# Answers a serve peer: (ROUTER identity, REQ envelope, frame, copy).
Reply = Callable[[bytes, list[bytes], bytes, bool], None]


class BatchServing:
    """Batch requests: accepted ones wait (``waits``) until ``n_groups`` fresh groups are there or time runs out.

    ``served()`` is called after every batch sent (the gauges are refreshed at once).
    """

    def __init__(self, cfg: Config, store: BufferStore, *, metrics: Metrics, rejections: FrameRejections,
                 reply: Reply, settle: Callable[[], None], served: Callable[[], None]) -> None:
        self.cfg = cfg
        self.store = store
        self.metrics = metrics
        self.rejections = rejections
        self.reply = reply
        self.settle = settle
        self.served = served
        self.max_batch_groups = min(cfg.buffer.max_batch_groups, cfg.buffer.capacity_groups)
        self.waits = BatchWaits()
        self.timeouts = 0
        # Counted into the next BatchReply (stale_dropped, filtered), then reset.
        self.dropped_since_reply = 0
        self.filtered_since_reply = 0
        self._depth_changed = True  # every wait is checked on the next turn, not only the expired ones

    def note_commit(self, filtered: int, stale: int) -> None:
        """Ingest committed groups: the waits may be served now; its refusals go into the next reply."""
        self.filtered_since_reply += filtered
        self.dropped_since_reply += stale
        self._depth_changed = True

    def check(self, req: BatchRequest) -> tuple[str, str] | None:
        """(reason, message) when the request is refused, else None."""
        b = self.cfg.buffer
        if not 1 <= req.n_groups <= self.max_batch_groups:
            return "bad_request", (f"n_groups={req.n_groups} outside [1, {self.max_batch_groups}] "
                                   f"(buffer.max_batch_groups={b.max_batch_groups}, "
                                   f"buffer.capacity_groups={b.capacity_groups})")
        if req.timeout_ms > b.max_batch_wait_s * 1000:
            return "bad_request", (f"timeout_ms={req.timeout_ms} exceeds buffer.max_batch_wait_s={b.max_batch_wait_s:g} s; "
                                   "ask again after a timeout reply instead")
        c = self.store.counters
        limit = max(c["learner_version"], c["served_version"] + b.learner_version_max_step)
        if req.learner_version > limit:
            return "learner_version", (
                f"learner_version={req.learner_version} is more than buffer.learner_version_max_step="
                f"{b.learner_version_max_step} past {c['served_version']}, the learner version of the last full "
                f"batch served (stored learner version {c['learner_version']}): only the learner moves it, one "
                "step per batch. If this is the learner (e.g. resumed against a new buffer directory), stop the "
                f"buffer and run: python -m buffer.inspect {self.cfg.buffer_path} --set-learner-version "
                f"{max(0, req.learner_version - 1)}")
        return None

    def on_request(self, ident: bytes, envelope: list[bytes], req: BatchRequest) -> None:
        """Refuse the request, or record its learner version and add it to the wait list."""
        refused = self.check(req)
        if refused is not None:
            self.reply(ident, envelope, self.rejections.reject(*refused), True)
            return
        try:
            self.store.set_learner_version(req.learner_version)
        except StorageError as e:
            self.metrics.storage_errors.labels(reason=e.reason).inc()
            self.reply(ident, envelope, encode(ErrorReply(reason="storage", message=str(e)[:4000])), True)
            return
        self.metrics.learner_version.set(self.store.counters["learner_version"])
        old = self.waits.add(BatchWait(ident, envelope, req, time.monotonic() + req.timeout_ms / 1000.0))
        if old is not None:  # the wait list was full: the oldest request gets a timeout reply
            self.timeouts += 1
            self.metrics.batch_timeouts.inc()
            self.reply(old.ident, old.envelope, encode(ErrorReply(
                reason="timeout", message=f"evicted: {self.waits.limit} batch requests waiting; ask again")), True)
        self._depth_changed = True

    def serve_waiting(self) -> None:
        """Serve every waiting request that can be served (oldest first), time out the expired ones."""
        if not self.waits:
            return
        now = time.monotonic()
        check_all = self._depth_changed
        self._depth_changed = False
        for w in self.waits:
            if check_all or now >= w.deadline:
                self._serve_one(w, now)

    def _serve_one(self, w: BatchWait, now: float) -> None:
        self.settle()
        req = w.req
        min_version = max(0, self.store.counters["learner_version"] - self.cfg.buffer.max_staleness)
        # Only a full learner batch moves served_version, to the version the request carried (not the stored
        # one, which another client may have raised a step: recording that would let it drift a step per batch).
        full = req.n_groups >= min(self.cfg.learner.batch_groups, self.max_batch_groups)
        try:
            frames, dropped = self.store.take_groups(
                req.n_groups, min_version, served_version=req.learner_version if full else None)
        except StorageError as e:
            self.metrics.storage_errors.labels(reason=e.reason).inc()
            self.waits.remove(w.ident)
            self.reply(w.ident, w.envelope, encode(ErrorReply(reason="storage", message=str(e)[:4000])), True)
            return
        if dropped:
            self.metrics.stale_dropped_groups.inc(dropped)
            self.dropped_since_reply += dropped
        if frames:
            n = len(frames)
            batch = encode_batch_reply(frames, self.dropped_since_reply, self.filtered_since_reply)
            del frames
            self.waits.remove(w.ident)
            self.reply(w.ident, w.envelope, batch, False)  # tens of MB: hand the buffer to ZeroMQ
            self.dropped_since_reply = self.filtered_since_reply = 0
            self.metrics.served_groups.inc(n)
            self.metrics.batch_serve_seconds.observe(time.monotonic() - now)
            self.served()
        elif now >= w.deadline:
            self._time_out(w)

    def _time_out(self, w: BatchWait) -> None:
        self.timeouts += 1
        self.metrics.batch_timeouts.inc()
        self.waits.remove(w.ident)
        depth = self.store.counters["depth_groups"]
        self.reply(w.ident, w.envelope, encode(ErrorReply(
            reason="timeout", message=f"{depth} of {w.req.n_groups} groups after {w.req.timeout_ms} ms")), True)

    def fail_all(self, message: str) -> None:
        """The loop hit a bug: every waiting request gets an ``internal`` error (their clients ask again)."""
        for w in self.waits.clear():
            self.reply(w.ident, w.envelope, encode(ErrorReply(reason="internal", message=message)), True)
