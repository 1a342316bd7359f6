"""BatchWaits: one wait per serve identity, oldest first, eviction at the limit, abandon on disconnect."""

from __future__ import annotations

from buffer.waits import BatchWait, BatchWaits
from common.protocol import BatchRequest


def wait(ident: bytes, n: int = 1, deadline: float = 10.0) -> BatchWait:
    return BatchWait(ident, [b""], BatchRequest(learner_version=0, n_groups=n, timeout_ms=100), deadline)


def test_waits_keep_arrival_order_and_report_the_largest_request_and_first_deadline() -> None:
    waits = BatchWaits()
    assert not waits and waits.pending_n() == 0 and waits.first_deadline() is None
    assert waits.add(wait(b"a", n=2, deadline=5.0)) is None
    assert waits.add(wait(b"b", n=7, deadline=3.0)) is None
    assert [w.ident for w in waits] == [b"a", b"b"]
    assert b"a" in waits and b"c" not in waits and len(waits) == 2
    assert waits.pending_n() == 7
    assert waits.first_deadline() == 3.0


def test_a_full_wait_list_evicts_the_oldest() -> None:
    waits = BatchWaits(limit=2)
    waits.add(wait(b"a"))
    waits.add(wait(b"b"))
    evicted = waits.add(wait(b"c"))
    assert evicted is not None and evicted.ident == b"a"
    assert [w.ident for w in waits] == [b"b", b"c"]


def test_iteration_is_over_a_copy_so_waits_can_be_removed_meanwhile() -> None:
    waits = BatchWaits()
    for ident in (b"a", b"b", b"c"):
        waits.add(wait(ident))
    seen = []
    for w in waits:
        seen.append(w.ident)
        waits.remove(w.ident)
    assert seen == [b"a", b"b", b"c"] and len(waits) == 0


def test_abandon_counts_only_waits_that_existed_and_clear_returns_the_rest() -> None:
    waits = BatchWaits()
    waits.add(wait(b"a"))
    waits.add(wait(b"b"))
    assert waits.abandon(b"a") is True
    assert waits.abandon(b"a") is False
    assert waits.abandoned == 1
    assert waits.remove(b"zz") is None
    assert [w.ident for w in waits.clear()] == [b"b"]
    assert len(waits) == 0
