"""Admission on a real LMDB store: the capacity formula, refusals answered on the ingest side, grants carrying
the learner version, credit given back when a connection closes."""

from __future__ import annotations

from pathlib import Path

from buffer.admission import Admission
from buffer.frames import FrameRejections
from buffer.store import BufferStore, GroupRecord
from common.metrics import Metrics
from common.protocol import CreditGrant, CreditRequest, ErrorReply, decode, encode
from tests.buffer.fixtures import buffer_config, make_group


class Harness:
    def __init__(self, tmp_path: Path, pending_n: int = 0) -> None:
        cfg = buffer_config(tmp_path, ["buffer.max_staleness=1", "learner.batch_groups=4",
                                       "buffer.max_credit_per_actor=3", "buffer.max_credit_per_connection=5"])
        self.store = BufferStore(cfg.buffer_path)
        self.metrics = Metrics("buffer")
        self.sent: list[tuple[bytes, object]] = []
        self.pending = pending_n
        self.admission = Admission(cfg, self.store, metrics=self.metrics, rejections=FrameRejections(self.metrics),
                                   pending_n=lambda: self.pending,
                                   send=lambda ident, frame: self.sent.append((ident, decode(frame))))

    def store_groups(self, n: int) -> None:
        groups = [make_group() for _ in range(n)]
        self.store.put_groups([GroupRecord(g.group_id, encode(g), 0, len(g.samples), []) for g in groups])


def test_capacity_is_staleness_times_batch_plus_the_waiting_request_minus_depth(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    assert h.admission.capacity() == 1 * 4
    h.pending = 4  # a learner waits for a batch of 4
    assert h.admission.capacity() == 8
    h.store_groups(3)
    assert h.admission.capacity() == 5


def test_a_grant_carries_the_learner_version_and_counts_in_flight(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.store.set_learner_version(6)
    h.admission.on_request(b"conn", CreditRequest(actor_id=1, n=3))
    h.admission.grant()
    assert h.sent == [(b"conn", CreditGrant(n=3, learner_version=6))]
    assert h.admission.ledger.in_flight == 3 and h.admission.capacity() == 1
    h.admission.consume(1)  # a group of actor 1 arrived
    assert h.admission.ledger.in_flight == 2
    h.admission.release_connection(b"conn")
    assert h.admission.ledger.in_flight == 0 and h.admission.ledger.released == 2
    assert h.metrics.registry.get_sample_value("vapo_buffer_credit_granted_total") == 3.0


def test_a_request_beyond_capacity_waits_and_is_counted(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.store_groups(4)  # depth 4: no capacity left
    h.admission.on_request(b"conn", CreditRequest(actor_id=1, n=2))
    h.admission.grant()
    assert h.sent == [] and h.admission.ledger.waiting == 1
    assert h.metrics.registry.get_sample_value("vapo_buffer_admission_waits_total") == 1.0


def test_a_refused_request_is_answered_with_its_reason(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.admission.on_request(b"conn", CreditRequest(actor_id=1, n=1), key="key-a")
    h.admission.on_request(b"other", CreditRequest(actor_id=1, n=1), key="key-b")  # actor 1 belongs to key-a
    ((ident, reply),) = h.sent
    assert ident == b"other" and isinstance(reply, ErrorReply) and reply.reason == "actor_key"
    assert h.admission.rejections.by_reason == {"actor_key": 1}
