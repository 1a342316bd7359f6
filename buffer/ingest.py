"""The buffer's ingest socket: what actors send (``SampleGroup``, ``CreditRequest``) and what they get back.

``BufferServer`` (``buffer.server``) owns the sockets, the store and the writer thread; the functions here
are its ingest-side methods (bound as class attributes there, so ``srv`` is the server): read and validate
frames (protocol, the actor role of the client key, the ``common.limits`` bounds), decide each group's fate
and its positives, acknowledge a batch once its LMDB transaction committed, and answer credit requests.

Groups arriving together (up to ``buffer.commit_batch``) are written in one LMDB transaction and each is
answered ``IngestAck(committed=True)`` only after that commit. A re-sent group_id is acknowledged again
(``duplicate=True``) and stored once. ``IngestAck.error`` is ``""`` when the group was stored,
``"stale"`` / ``"filtered:uniform_reward"`` when it was recorded but will never be served (still
``committed=True``: do not re-send), ``"full: ..."`` / ``"storage: ..."`` with ``committed=False``
when it was not stored (re-send later), and ``"invalid:<reason>: ..."`` with ``committed=False`` when the
group breaks the ingest bounds of ``common.limits`` (empty prompt or response, token id past the
vocabulary, reward outside the task's range, logprob > 0, too long): never stored, counted in
``vapo_buffer_invalid_groups{reason}``, final (re-sending cannot help).

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
Every term is durable or re-derivable after a restart (AReaL bug #1388): depth, totals and the learner
version are LMDB counters; credits in flight restart at zero (groups from old grants still count when
they arrive), and a grant not used within ``buffer.credit_ttl_s`` stops counting. A grant carries the
learner version: actors that generate with weights at least that new never produce stale groups.

No actor id holds more than ``buffer.max_credit_per_actor`` unused credits and no ingest connection more
than ``buffer.max_credit_per_connection`` across its actor ids, so a client inventing actor ids cannot
take all capacity. A connection that closes gives back its unused credit at once (the socket monitor
reports the closed descriptor, and every frame carries the descriptor it came on). With CurveZMQ an actor
id belongs to the first client key that asks credit for it (until the buffer restarts); another key
asking for it is refused (``actor_key``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import zmq

from buffer.store import FILTERED, STALE, STORED, GroupRecord, StorageError, positive_hash
from buffer.writer import Pending
from common.limits import group_problem, is_positive
from common.protocol import (
    CreditGrant,
    CreditRequest,
    IngestAck,
    ProtocolError,
    SampleGroup,
    decode,
    encode,
    sample_frames,
)

if TYPE_CHECKING:  # the server imports this module; the type is for annotations only
    from buffer.server import BufferServer

log = logging.getLogger("vapo.buffer")  # the server's logger: one log stream for the whole buffer


def drain_ingest(srv: BufferServer) -> None:
    """Read, validate and queue groups for the next commit; answer everything else at once."""
    credit_msgs: list[tuple[bytes, CreditRequest, str | None]] = []
    lv, pos_reward = srv.learner_version, srv.cfg.buffer.positive_reward
    for _ in range(4 * srv.cfg.buffer.commit_batch):
        if len(srv._next) >= srv.cfg.buffer.commit_batch:
            break
        try:
            parts = srv.ingest.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
        ident, body = parts[0].bytes, parts[1:]
        if body:
            srv.ingest_peers.seen(ident, body[-1])
        if len(body) != 1:
            srv._send_ingest(ident, srv._reject("multipart", f"expected 1 frame, got {len(body)}"))
            continue
        frame = body[0].buffer  # zero-copy view; LMDB copies it once, into the page
        try:
            msg = decode(frame, srv.max_frame)
        except ProtocolError as e:
            srv._send_ingest(ident, srv._reject(e.reason, str(e)))
            continue
        if not isinstance(msg, CreditRequest | SampleGroup):
            srv._send_ingest(ident, srv._reject("unexpected_type", f"{msg.TYPE} not accepted on ingest"))
            continue
        key = srv._client_key(body[0])
        if srv.curve.enabled and srv.curve.role(key) != "actor":
            srv._send_ingest(ident, srv._reject("role", f"{msg.TYPE} is for actor keys only"))
            continue
        if isinstance(msg, CreditRequest):
            credit_msgs.append((ident, msg, key))
            continue
        bad = group_problem(msg, srv.limits)
        if bad is not None:
            srv._refuse_group(ident, msg, *bad)
            continue
        rec = srv._record(msg, frame, lv, pos_reward)
        if rec.fate == STORED and not srv._has_room(len(frame)):
            srv._wait_writer()
            if not srv._has_room(len(frame)) and srv._known(msg.group_id) is None:
                srv._send_ingest(ident, encode(IngestAck(
                    group_id=msg.group_id, committed=False, duplicate=False,
                    error=f"full: {srv.store.counters['depth_groups']} groups waiting")))
                continue
        srv._next.append((rec, (ident, msg.group_id, msg.actor_id)))
    for ident, req, key in credit_msgs:
        srv._on_credit_request(ident, req, key)


def refuse_group(srv: BufferServer, ident: bytes, g: SampleGroup, reason: str, message: str) -> None:
    """A protocol-valid group the learner could not use: never stored, answered with a final error."""
    srv._invalid[reason] = srv._invalid.get(reason, 0) + 1
    srv.m.invalid_groups.labels(reason=reason).inc()
    srv.credits.consume(g.actor_id)  # generated on a credit: it must not hold that credit until the ttl
    log.warning("refused group %s of actor %d: %s: %s", g.group_id[:64], g.actor_id, reason, message)
    srv._send_ingest(ident, encode(IngestAck(group_id=g.group_id, committed=False, duplicate=False,
                                              error=f"invalid:{reason}: {message}"[:4000])))


def client_key(srv: BufferServer, frame: zmq.Frame) -> str | None:
    """The sender's CURVE public key (ZAP User-Id, z85) when CurveZMQ is on, else None."""
    if not srv.curve.enabled:
        return None
    try:
        return frame.get("User-Id") or None
    except zmq.ZMQError:
        return None


def record_group(srv: BufferServer, g: SampleGroup, frame: bytes, lv: int, pos_reward: float) -> GroupRecord:
    positives: list[tuple[bytes, bytes]] = []
    # A response cut at the length limit is never a positive, whatever its reward: imitating it would
    # teach the policy not to stop.
    keep = [is_positive(s, pos_reward) for s in g.samples]
    if any(keep):
        # Stored as the exact bytes they arrived in: cut out of the frame, not encoded again.
        frames = sample_frames(frame)
        positives = [(positive_hash(s.prompt_ids, s.output_ids), f)
                     for s, f, k in zip(g.samples, frames, keep, strict=True) if k]
    fate = STORED
    if g.weight_version < lv - srv.k:
        fate = STALE
    elif srv.cfg.buffer.filter_uniform_groups and len({s.reward for s in g.samples}) == 1:
        fate = FILTERED
    return GroupRecord(g.group_id, frame, g.weight_version, len(g.samples), positives, fate)


def has_room(srv: BufferServer, nbytes: int) -> bool:
    c = srv.store.counters
    new = [r for r, _ in srv._next + srv.writer.batch if r.fate == STORED]
    groups = c["depth_groups"] + len(new)
    size = c["depth_bytes"] + sum(len(r.frame) for r in new) + nbytes
    return groups < srv.cfg.buffer.capacity_groups and size <= srv.cfg.buffer.capacity_bytes


def finish_commit(srv: BufferServer, batch: list[Pending], before: dict[str, int],
            results: list[tuple[str, bool]] | None, err: StorageError | None) -> None:
    """Acknowledge a batch whose transaction has committed (or report its storage error)."""
    if err is not None or results is None:
        srv._storage_errors += 1
        reason = err.reason if err is not None else "unknown"
        srv.m.storage_errors.labels(reason=reason).inc()
        log.error("storage error, %d groups not stored (senders will retry): %s", len(batch), err)
        for _, (ident, gid, _) in batch:
            srv._send_ingest(ident, encode(IngestAck(
                group_id=gid, committed=False, duplicate=False, error=f"storage: {err}"[:4000])))
        return
    srv._ingest_commits += 1
    after = srv.store.counters
    for (_, (ident, gid, actor_id)), (outcome, dup) in zip(batch, results, strict=True):
        if not dup:
            srv.credits.consume(actor_id)
        note = "" if outcome == "stored" else ("filtered:uniform_reward" if outcome == "filtered" else outcome)
        srv._send_ingest(ident, encode(IngestAck(group_id=gid, committed=True, duplicate=dup, error=note)))
    srv.m.acked_groups.inc(len(batch))
    srv.m.duplicate_groups.inc(after["duplicates"] - before["duplicates"])
    n_filtered = after["filtered"] - before["filtered"]
    if n_filtered:
        srv.m.filtered_groups.labels(reason="uniform_reward").inc(n_filtered)
        srv._filtered_since_reply += n_filtered
    n_stale = after["stale_dropped"] - before["stale_dropped"]
    if n_stale:
        srv.m.stale_dropped_groups.inc(n_stale)
        srv._dropped_since_reply += n_stale
    srv.m.positives_duplicates.inc(after["positives_duplicates"] - before["positives_duplicates"])
    srv.m.positives_evicted.inc(after["positives_evicted"] - before["positives_evicted"])
    srv._depth_changed = True


def send_ingest(srv: BufferServer, ident: bytes, frame: bytes) -> None:
    try:
        srv.ingest.send_multipart([ident, frame], zmq.NOBLOCK)
    except zmq.Again:
        log.warning("ingest reply queue full; dropping a reply (the sender will re-send)")


def on_credit_request(srv: BufferServer, ident: bytes, req: CreditRequest, key: str | None = None) -> None:
    refused = srv.credits.request(ident, req.actor_id, req.n, key)
    if refused is not None:
        srv._send_ingest(ident, srv._reject(refused.reason, refused.message))
    elif req.n > 0 and srv.capacity() < req.n:
        srv.m.admission_waits.inc()


def grant_credits(srv: BufferServer) -> None:
    if not srv.credits.waiting:
        return
    for g in srv.credits.grant(srv.capacity(), time.monotonic()):
        srv._send_ingest(g.ident, encode(CreditGrant(n=g.n, learner_version=srv.learner_version)))
        srv.m.credit_granted.inc(g.n)
