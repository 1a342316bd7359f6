"""The buffer's ingest socket: what actors send (``SampleGroup``, ``CreditRequest``) and what they get back.

``Ingest`` owns the ingest socket's reading side and the commit pipeline: it reads and validates frames
(protocol, the actor role of the client key, the ``common.limits`` bounds), decides each group's fate and
its positives, hands batches to the writer thread (``buffer.writer``) and acknowledges a batch once its LMDB
transaction committed. Credit requests it reads are handed to the event loop (``buffer.server``), which
passes them to ``buffer.admission`` (the admission rules).

Groups arriving together (up to ``buffer.commit_batch``) are written in one LMDB transaction and each is
answered ``IngestAck(committed=True)`` only after that commit. A re-sent group_id is acknowledged again
(``duplicate=True``) and stored once. ``IngestAck.error`` is ``""`` when the group was stored,
``"stale"`` / ``"filtered:uniform_reward"`` when it was recorded but will never be served (still
``committed=True``: do not re-send), ``"full: ..."`` / ``"storage: ..."`` with ``committed=False``
when it was not stored (re-send later), and ``"invalid:<reason>: ..."`` with ``committed=False`` when the
group breaks the ingest bounds of ``common.limits`` (empty prompt or response, token id past the
vocabulary, reward outside the task's range, logprob > 0, too long): never stored, counted in
``vapo_buffer_invalid_groups{reason}``, final (re-sending cannot help). Two more ``invalid`` reasons are the
buffer's own: ``version``, a sample's ``weight_version`` or a version in its ``version_spans`` newer than the
learner can have published (``version_limit``: the highest learner version a ``BatchRequest`` may still
bring, plus the one it publishes after training on it), which would otherwise be served last and trained
on as fresh; ``actor_key``, a group stamped with an actor id its client key may not act for
(``common.security.ServerCurve.actor_refusal``; its credit is not consumed: it is another actor's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from buffer.frames import FrameRejections, client_key
from buffer.layout import FILTERED, STALE, STORED
from buffer.peers import Peers
from buffer.positives import harvest_positives
from buffer.store import BufferStore, GroupRecord, StorageError
from buffer.writer import Pending, Writer
from common.config import Config
from common.limits import SampleLimits, group_problem
from common.metrics import Metrics
from common.protocol import CreditRequest, IngestAck, ProtocolError, SampleGroup, decode, encode
from common.rewards import uniform_trained_reward
from common.security import ServerCurve

log = logging.getLogger("vapo.buffer")  # the server's logger: one log stream for the whole buffer

# A credit request read from the ingest socket: (ROUTER identity, request, client key).
CreditMessage = tuple[bytes, CreditRequest, str | None]

READ_AHEAD = 2  # batches validated ahead of the one being committed (``Ingest.accepting`` says why)


def version_limit(counters: dict[str, int], max_step: int) -> int:
    """The newest weight version a group may carry: the highest learner version a ``BatchRequest`` may still
    bring (``buffer.serving``'s bound) plus one, the version the learner publishes after training on it."""
    return max(counters["learner_version"], counters["served_version"] + max_step) + 1


def version_problem(group: SampleGroup, newest: int) -> tuple[str, str] | None:
    """``("version", message)`` when a sample claims weights newer than ``newest``, else None."""
    for i, s in enumerate(group.samples):
        spans = s.version_spans
        claimed = max(s.weight_version, int(spans[0::2].max()) if spans is not None and len(spans) else 0)
        if claimed > newest:
            return "version", (f"sample {i} claims weight version {claimed}, newer than the learner can have "
                               f"published ({newest})")
    return None


class Ingest:
    """The ingest socket's frames and the commit pipeline (validated groups -> writer thread -> acks).

    ``consume_credit(actor_id)`` is called for each group that used up its sender's credit;
    ``on_committed(filtered, stale)`` after every commit, with the groups it recorded but will never serve.
    """

    def __init__(self, cfg: Config, sock: zmq.Socket, store: BufferStore, writer: Writer, *, metrics: Metrics,
                 rejections: FrameRejections, curve: ServerCurve, limits: SampleLimits,
                 consume_credit: Callable[[int], None], on_committed: Callable[[int, int], None]) -> None:
        self.cfg = cfg
        self.sock = sock
        self.peers = Peers(sock)
        self.store = store
        self.writer = writer
        self.metrics = metrics
        self.rejections = rejections
        self.curve = curve
        self.limits = limits
        self.consume_credit = consume_credit
        self.on_committed = on_committed
        self.next_batch: list[Pending] = []  # validated, waiting for a commit (the next READ_AHEAD batches)
        # Groups and bytes to be stored by next_batch and by the batch the writer is committing: kept as they
        # change, since summing them for every group that arrives grows with the batch squared.
        self._queued = (0, 0)
        self._writing = (0, 0)
        self.invalid: dict[str, int] = {}  # refused groups by reason
        self.storage_errors = 0
        self.commits = 0

    @property
    def accepting(self) -> bool:
        """False while the next two batches are validated and waiting: the loop stops reading (the ZeroMQ queues
        push back on senders).

        Two, not one: with one, the main thread stopped reading once it had validated the batch after the one
        being committed and waited out the commit. A second batch ahead lifted the buffer benchmark's median
        ingest/raw from 0.58-0.61 to 0.60-0.64 (three runs each); two cores still stand ~22 % idle during
        ingest, so this is not the whole story."""
        return len(self.next_batch) < READ_AHEAD * self.cfg.buffer.commit_batch

    def drain(self) -> list[CreditMessage]:
        """Read, validate and queue groups for the next commit; answer bad frames at once.

        Returns the credit requests read, in order, for admission control.
        """
        credit_msgs: list[CreditMessage] = []
        learner_version = self.store.counters["learner_version"]
        newest = version_limit(self.store.counters, self.cfg.buffer.learner_version_max_step)
        for _ in range(4 * self.cfg.buffer.commit_batch):
            if self.writer.finished:  # hand the writer the next batch now, not after this drain
                self.collect()
                self.submit()
            if not self.accepting:
                break
            got = self.peers.recv()
            if got is None:
                break
            ident, body = got
            msg = self._decode(ident, body)
            key = client_key(self.curve, body[0])
            if isinstance(msg, CreditRequest):
                credit_msgs.append((ident, msg, key))
            elif isinstance(msg, SampleGroup):
                wrong_key = self.curve.actor_refusal(key, msg.actor_id)
                if wrong_key is not None:
                    self._refuse_group(ident, msg, "actor_key", wrong_key, consume=False)
                else:
                    self._take_group(ident, msg, body[0].buffer, learner_version, newest)
        return credit_msgs

    def _decode(self, ident: bytes, body: list[zmq.Frame]) -> CreditRequest | SampleGroup | None:
        """The message of a frame actors may send, or None when it was refused (and answered)."""
        if len(body) != 1:
            self.send(ident, self.rejections.reject("multipart", f"expected 1 frame, got {len(body)}"))
            return None
        try:
            msg = decode(body[0].buffer, self.cfg.buffer.max_frame_bytes)  # zero-copy view
        except ProtocolError as e:
            self.send(ident, self.rejections.reject(e.reason, str(e)))
            return None
        if not isinstance(msg, CreditRequest | SampleGroup):
            self.send(ident, self.rejections.reject("unexpected_type", f"{msg.TYPE} not accepted on ingest"))
            return None
        if self.curve.enabled and self.curve.role(client_key(self.curve, body[0])) != "actor":
            self.send(ident, self.rejections.reject("role", f"{msg.TYPE} is for actor keys only"))
            return None
        return msg

    def _take_group(self, ident: bytes, group: SampleGroup, frame: bytes, learner_version: int, newest: int) -> None:
        """Queue a decoded group for the next commit, or answer why not."""
        bad = group_problem(group, self.limits) or version_problem(group, newest)
        if bad is not None:
            self._refuse_group(ident, group, *bad)
            return
        record = self._record(group, frame, learner_version)  # LMDB copies the frame once, into the page
        if record.fate == STORED and not self._has_room(len(frame)):
            self.settle()
            if not self._has_room(len(frame)) and self.store.known(group.group_id) is None:
                self.send(ident, encode(IngestAck(
                    group_id=group.group_id, committed=False, duplicate=False,
                    error=f"full: {self.store.counters['depth_groups']} groups waiting")))
                return
        self.next_batch.append((record, (ident, group.group_id, group.actor_id)))
        if record.fate == STORED:
            self._queued = (self._queued[0] + 1, self._queued[1] + len(frame))

    def _refuse_group(self, ident: bytes, group: SampleGroup, reason: str, message: str, consume: bool = True) -> None:
        """A protocol-valid group the learner could not use: never stored, answered with a final error."""
        self.invalid[reason] = self.invalid.get(reason, 0) + 1
        self.metrics.invalid_groups.labels(reason=reason).inc()
        if consume:  # generated on a credit: it must not hold that credit until the ttl
            self.consume_credit(group.actor_id)
        log.warning("refused group %s of actor %d: %s: %s", group.group_id[:64], group.actor_id, reason, message)
        self.send(ident, encode(IngestAck(group_id=group.group_id, committed=False, duplicate=False,
                                          error=f"invalid:{reason}: {message}"[:4000])))

    def _record(self, group: SampleGroup, frame: bytes, learner_version: int) -> GroupRecord:
        positives = harvest_positives(group, frame, self.cfg.buffer.positive_reward)
        fate = STORED
        if group.weight_version < learner_version - self.cfg.buffer.max_staleness:
            fate = STALE
        elif self.cfg.buffer.filter_uniform_groups and uniform_trained_reward(group, self.cfg):
            fate = FILTERED
        return GroupRecord(group.group_id, frame, group.weight_version, len(group.samples), positives, fate)

    def _has_room(self, nbytes: int) -> bool:
        c = self.store.counters
        groups = c["depth_groups"] + self._queued[0] + self._writing[0]
        size = c["depth_bytes"] + self._queued[1] + self._writing[1] + nbytes
        return groups < self.cfg.buffer.capacity_groups and size <= self.cfg.buffer.capacity_bytes

    def submit(self) -> None:
        """Hand the next batch to the writer thread when there is one and the writer is idle."""
        if not self.next_batch or self.writer.busy:
            return
        n = self.cfg.buffer.commit_batch
        batch, self.next_batch = self.next_batch[:n], self.next_batch[n:]
        stored = [len(record.frame) for record, _ in batch if record.fate == STORED]
        self._writing = (len(stored), sum(stored))
        self._queued = (self._queued[0] - self._writing[0], self._queued[1] - self._writing[1])
        self.metrics.ingested_groups.inc(len(batch))
        self.writer.submit(batch, dict(self.store.counters))

    def settle(self) -> None:
        """Finish the commit in progress; every main-thread LMDB access goes through here first.

        Nothing is submitted again until the main loop's next turn, so the caller has LMDB to itself.
        """
        while self.writer.busy:
            self.writer.wait()
            self.collect()

    def collect(self) -> None:
        """Acknowledge the batches whose commit finished (never blocks)."""
        for batch, before, results, err in self.writer.collect():
            self._writing = (0, 0)  # committed (in the store's counters now) or failed (not stored)
            if err is not None or results is None:
                self._fail_batch(batch, err)
            else:
                self._ack_batch(batch, before, results)

    def _fail_batch(self, batch: list[Pending], err: StorageError | None) -> None:
        self.storage_errors += 1
        reason = err.reason if err is not None else "unknown"
        self.metrics.storage_errors.labels(reason=reason).inc()
        log.error("storage error, %d groups not stored (senders will retry): %s", len(batch), err)
        for _, (ident, gid, _) in batch:
            self.send(ident, encode(IngestAck(
                group_id=gid, committed=False, duplicate=False, error=f"storage: {err}"[:4000])))

    def _ack_batch(self, batch: list[Pending], before: dict[str, int], results: list[tuple[str, bool]]) -> None:
        """Acknowledge a batch whose transaction has committed."""
        self.commits += 1
        after = self.store.counters
        for (_, (ident, gid, actor_id)), (outcome, dup) in zip(batch, results, strict=True):
            if not dup:
                self.consume_credit(actor_id)
            note = "" if outcome == "stored" else ("filtered:uniform_reward" if outcome == "filtered" else outcome)
            self.send(ident, encode(IngestAck(group_id=gid, committed=True, duplicate=dup, error=note)))
        metrics = self.metrics
        metrics.acked_groups.inc(len(batch))
        metrics.duplicate_groups.inc(after["duplicates"] - before["duplicates"])
        n_filtered = after["filtered"] - before["filtered"]
        if n_filtered:
            metrics.filtered_groups.labels(reason="uniform_reward").inc(n_filtered)
        n_stale = after["stale_dropped"] - before["stale_dropped"]
        if n_stale:
            metrics.stale_dropped_groups.inc(n_stale)
        metrics.positives_duplicates.inc(after["positives_duplicates"] - before["positives_duplicates"])
        metrics.positives_evicted.inc(after["positives_evicted"] - before["positives_evicted"])
        self.on_committed(n_filtered, n_stale)

    def send(self, ident: bytes, frame: bytes) -> None:
        """Answer an ingest peer; a full reply queue drops the reply (the sender re-sends)."""
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("ingest reply queue full; dropping a reply (the sender will re-send)")
