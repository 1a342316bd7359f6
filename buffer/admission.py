"""Admission control: the credit ledger, actors' credit requests and grants, and the admission capacity.

Not a CLI; used by ``buffer.server`` (which routes ``CreditRequest`` frames here from ``buffer.ingest``).
The bookkeeping itself is ``buffer.credits`` (pure); this role adds the clock, the store's counters, the
metrics and the replies.

Admission control (AReaL's staleness bound): an actor asks ``CreditRequest(actor_id, n)`` — "I want n
more groups' worth of credit" (replaces any earlier waiting request of that actor; n = 0 withdraws it)
— and generates only after a ``CreditGrant``. AReaL admits while
``(max_staleness + version + 1) * batch_groups - (accepted + running) > 0``. Here ``version * batch_groups``
is counted as the groups the learner has consumed (plus the batch it is waiting for), not the version
number it reports, so ``accepted - consumed = depth``::

    capacity = max_staleness * batch_groups + (largest n_groups of the waiting BatchRequests, else 0)
               - (groups waiting in LMDB + credits in flight)

also capped by ``buffer.capacity_groups`` / ``capacity_bytes``. Grants are deferred while capacity is
zero. Counting consumption instead of the reported version keeps the bound right when the learner takes
several batches per version (value pretraining) or resumes from an older checkpoint; with
``max_staleness = 0`` actors work only while the learner waits, which makes the system synchronous.
Every term is durable or re-derivable after a restart (an admission counter kept only in memory would
restart at zero and let actors overrun the staleness bound after a crash): depth, totals and the learner
version are LMDB counters; credits in flight restart at zero (groups from old grants still count when
they arrive), and a grant not used within ``buffer.credit_ttl_s`` stops counting. A grant carries the
learner version: actors that generate with weights at least that new never produce stale groups.

No actor id holds more than ``buffer.max_credit_per_actor`` unused credits and no ingest connection more
than ``buffer.max_credit_per_connection`` across its actor ids. A connection that closes gives back its
unused credit at once (the socket monitor reports the closed descriptor, and every frame carries the
descriptor it came on).

Identity and fair share. With CurveZMQ an ``actor-<i>`` key (the launcher writes one per actor) acts for
actor id i alone and nobody else acts for i (``common.security.ServerCurve.actor_refusal``); an id without a
key of its own belongs to the first key that asks credit for it (until the buffer restarts). Another key
asking is refused (``actor_key``). Each party (a client key; without CurveZMQ a connection) holds at most its
fair share of the admission bound while another party waits: bound / active parties, at least 1; alone it
may take more, and what it took above its share is reclaimed (stops counting) when another party below its
share waits and nothing is free (``buffer.credits``; ``vapo_buffer_credit_reclaimed``). So one holder of
the shared ``actor`` key asking for made-up ids, over any number of connections, takes one share at most
once a real actor asks, and the real actors and the learner go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from buffer.credits import CreditLedger, admission_capacity, free_capacity
from buffer.frames import FrameRejections
from buffer.store import BufferStore
from common.config import Config
from common.metrics import Metrics
from common.protocol import CreditGrant, CreditRequest, encode
from common.security import ServerCurve

log = logging.getLogger("vapo.buffer")


class Admission:
    """Credit requests and grants of the ingest connections, bounded by the admission capacity.

    ``pending_n()`` is the largest ``n_groups`` of the waiting batch requests (``buffer.serving``);
    ``send(ident, frame)`` answers an ingest peer; ``curve`` knows which actor id a per-actor key is bound to.
    """

    def __init__(self, cfg: Config, store: BufferStore, *, metrics: Metrics, rejections: FrameRejections,
                 pending_n: Callable[[], int], send: Callable[[bytes, bytes], None],
                 curve: ServerCurve | None = None) -> None:
        b = cfg.buffer
        self.cfg = cfg
        self.store = store
        self.metrics = metrics
        self.rejections = rejections
        self.pending_n = pending_n
        self.send = send
        self.curve = curve or ServerCurve(None, None)
        per_actor = b.max_credit_per_actor or 2 * cfg.actors.prompts_in_flight
        self.ledger = CreditLedger(per_actor, b.max_credit_per_connection or per_actor, b.credit_ttl_s)

    def capacity(self) -> int:
        """Groups that may be granted now (>= 0)."""
        b, c = self.cfg.buffer, self.store.counters
        in_flight = self.ledger.in_flight
        adm = admission_capacity(b.max_staleness, self.cfg.learner.batch_groups, self.pending_n(),
                                 c["depth_groups"], in_flight)
        return free_capacity(adm, c["depth_groups"], c["depth_bytes"], in_flight, b.capacity_groups,
                             b.capacity_bytes)

    def on_request(self, ident: bytes, req: CreditRequest, key: str | None = None) -> None:
        bound = self.curve.actor_refusal(key, req.actor_id)
        if bound is not None:
            self.send(ident, self.rejections.reject("actor_key", bound))
            return
        refused = self.ledger.request(ident, req.actor_id, req.n, key)
        if refused is not None:
            self.send(ident, self.rejections.reject(refused.reason, refused.message))
        elif req.n > 0 and self.capacity() < req.n:
            self.metrics.admission_waits.inc()

    def consume(self, actor_id: int) -> None:
        """A group of ``actor_id`` arrived: it used up one of its credits."""
        self.ledger.consume(actor_id)

    def release_connection(self, ident: bytes) -> None:
        """An ingest connection closed: its unused credit is free again."""
        released = self.ledger.release_connection(ident)
        if released:
            log.info("an ingest connection closed: released its %d unused credits", released)

    def grant(self) -> None:
        """Expire unused grants, reclaim lent credit a party below its fair share needs, then grant what the
        capacity allows to the waiting requests."""
        self.ledger.expire(time.monotonic())
        if not self.ledger.waiting:
            return
        reclaimed = self.ledger.reclaim(self.capacity())
        if reclaimed:
            self.metrics.credit_reclaimed.inc(reclaimed)
        for g in self.ledger.grant(self.capacity(), time.monotonic()):
            self.send(g.ident, encode(CreditGrant(n=g.n, learner_version=self.store.counters["learner_version"])))
            self.metrics.credit_granted.inc(g.n)
