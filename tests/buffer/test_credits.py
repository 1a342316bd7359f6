"""buffer.credits: the admission formula and the credit ledger, with every expected value worked by hand."""

from __future__ import annotations

from buffer.credits import CreditLedger, Grant, Refusal, admission_capacity, free_capacity

A, B = b"conn-A", b"conn-B"


def test_admission_capacity_is_the_staleness_bound_minus_what_is_queued_or_in_flight() -> None:
    # k=2, B=4, a batch request for 4 waits, 3 groups stored, 2 credits out: 2*4 + 4 - 3 - 2 = 7.
    assert admission_capacity(2, 4, 4, 3, 2) == 7
    # k=0 (synchronous): nothing is admitted until the learner waits; then exactly its batch: 0*4 + 4 = 4.
    assert admission_capacity(0, 4, 0, 0, 0) == 0
    assert admission_capacity(0, 4, 4, 0, 0) == 4
    # More stored than the bound (e.g. after a restart with a smaller k): negative, 1*4 + 0 - 6 - 0 = -2.
    assert admission_capacity(1, 4, 0, 6, 0) == -2


def test_free_capacity_caps_admission_by_the_size_limits() -> None:
    # room = capacity_groups 8 - 3 stored - 2 in flight = 3 < admission 7 -> 3.
    assert free_capacity(7, 3, 100, 2, 8, 1000) == 3
    # room 3 > admission 1 -> 1.
    assert free_capacity(1, 3, 100, 2, 8, 1000) == 1
    # Stored bytes at capacity_bytes (1000 >= 1000): no room at all.
    assert free_capacity(7, 3, 1000, 2, 8, 1000) == 0
    # Negative admission is reported as 0.
    assert free_capacity(-2, 0, 0, 0, 8, 1000) == 0


def test_grants_respect_the_per_actor_bound_then_expire_and_are_released() -> None:
    led = CreditLedger(per_actor=3, per_connection=4, ttl_s=10.0)
    assert led.request(A, 1, 5) is None and led.waiting == 1
    # room = min(3 - 0, 4 - 0) = 3, g = min(n 5, capacity 10, room 3) = 3; the other 2 stay wanted.
    assert led.grant(10, now=0.0) == [Grant(A, 1, 3)]
    assert led.in_flight == 3 and led.waiting == 1
    # At its bound: room = min(3 - 3, 4 - 3) = 0, nothing more.
    assert led.grant(10, now=1.0) == []
    # Two groups arrive: 3 - 2 = 1 in flight, room = min(3 - 1, 4 - 1) = 2 = what is still wanted.
    led.consume(1)
    led.consume(1)
    assert led.in_flight == 1
    assert led.grant(10, now=2.0) == [Grant(A, 1, 2)]
    assert led.in_flight == 3 and led.waiting == 0
    # At 10.5 the first grant (expiry 0 + 10) is over, its 1 unused credit with it; the second (2 + 10) stays.
    led.expire(10.5)
    assert led.in_flight == 2 and led.actor_credit(1) == 2
    # The connection closes: its 2 unused credits are released at once.
    assert led.release_connection(A) == 2
    assert led.in_flight == 0 and led.released == 2


def test_one_connection_shares_its_bound_across_actor_ids_and_capacity_goes_oldest_first() -> None:
    led = CreditLedger(per_actor=3, per_connection=4, ttl_s=10.0)
    assert led.request(A, 1, 3) is None and led.request(A, 2, 3) is None
    # Actor 1: room = min(3, 4 - 0) = 3 -> 3. Actor 2: room = min(3, 4 - 3) = 1 -> 1; 2 still wanted.
    assert led.grant(10, now=0.0) == [Grant(A, 1, 3), Grant(A, 2, 1)]
    assert led.connection_credit(A) == 4 and led.waiting == 1
    # Another connection: its own bound. Capacity 2 goes to the oldest waiting request first: actor 2 (on A)
    # is at A's bound (room 0) so it is skipped; actor 3 gets min(n 2, capacity 2, room 3) = 2.
    assert led.request(B, 3, 2) is None
    assert led.grant(2, now=0.0) == [Grant(B, 3, 2)]


def test_refusals_bound_what_a_client_can_take() -> None:
    led = CreditLedger(per_actor=3, per_connection=2, ttl_s=10.0, max_waiting=3)
    assert led.request(A, 1, 1) is None and led.request(A, 2, 1) is None
    # A third actor id on a connection that may hold 2 credits can only be an invented id.
    r = led.request(A, 3, 1)
    assert isinstance(r, Refusal) and r.reason == "too_many_actor_ids"
    assert led.request(B, 4, 1) is None
    # max_waiting = 3 requests already wait (actors 1, 2, 4).
    r = led.request(B, 5, 1)
    assert isinstance(r, Refusal) and r.reason == "too_many_waiting"
    assert led.waiting == 3


def test_an_actor_id_belongs_to_the_first_curve_key_that_asks_for_it() -> None:
    led = CreditLedger(per_actor=3, per_connection=3, ttl_s=10.0)
    assert led.request(A, 5, 1, key="key-0") is None
    r = led.request(B, 5, 1, key="key-1")
    assert isinstance(r, Refusal) and r.reason == "actor_key"
    assert led.request(B, 5, 1, key="key-0") is None  # same key, new connection: allowed


def test_a_reconnected_actor_releases_the_old_connections_grants() -> None:
    led = CreditLedger(per_actor=3, per_connection=3, ttl_s=10.0)
    assert led.request(A, 1, 3) is None
    assert led.grant(10, now=0.0) == [Grant(A, 1, 3)]
    # Actor 1 asks again from connection B: the 3 credits held on A will never be used; they stop counting.
    assert led.request(B, 1, 2) is None
    assert led.in_flight == 0 and led.waiting == 1
    assert led.grant(10, now=1.0) == [Grant(B, 1, 2)]


def test_withdrawals_cancel_only_the_own_connections_request() -> None:
    led = CreditLedger(per_actor=3, per_connection=3, ttl_s=10.0)
    assert led.request(A, 1, 2) is None
    assert led.request(B, 1, 0) is None and led.waiting == 1  # B cannot cancel A's request
    assert led.request(A, 1, 0) is None and led.waiting == 0
    assert led.grant(10, now=0.0) == []


def test_every_refusal_reason_is_declared_for_the_clients() -> None:
    # AsyncGroupSender tells a refused credit request from a refused ingest frame by the reason alone.
    import re
    from pathlib import Path

    from buffer.credits import REFUSAL_REASONS

    src = (Path(__file__).resolve().parents[2] / "buffer" / "credits.py").read_text()
    assert set(re.findall(r'Refusal\("([a-z_]+)"', src)) == REFUSAL_REASONS


def test_fair_share_is_the_bound_over_the_active_parties_at_least_one() -> None:
    from buffer.credits import fair_share

    # 8 free + 0 in flight over 2 parties = 4; with 3 in flight and 5 free, still 8 // 2.
    assert fair_share(8, 0, 2) == 4 and fair_share(5, 3, 2) == 4
    # More parties than credit: each may still hold one; no party at all counts as one.
    assert fair_share(2, 1, 7) == 1 and fair_share(6, 0, 0) == 6


def test_a_party_alone_borrows_the_whole_bound_and_gives_back_the_loan_when_another_waits() -> None:
    led = CreditLedger(per_actor=16, per_connection=16, ttl_s=600.0)
    # A shared-key holder asks 16 for a made-up id: alone, it takes all 8 (work-conserving).
    assert led.request(A, 7, 16, key="shared") is None
    assert led.grant(8, now=0.0) == [Grant(A, 7, 8)]
    # The real actor (its own key) asks: nothing is free, 2 parties -> share 8 // 2 = 4; the loan above 4 is
    # taken back (stops counting), so 4 are free again, and the real actor gets them, the holder nothing more.
    assert led.request(B, 0, 8, key="actor-0") is None
    assert led.grant(0, now=1.0) == []
    assert led.reclaim(0) == 4 and led.reclaimed == 4 and led.in_flight == 4
    assert led.grant(4, now=1.0) == [Grant(B, 0, 4)]
    assert led.principal_credit() == {"shared": 4, "actor-0": 4}
    # Nothing more to take back: each holds its share.
    assert led.reclaim(0) == 0


def test_a_party_over_its_share_waits_while_another_waits_whatever_its_ids_or_connections() -> None:
    led = CreditLedger(per_actor=32, per_connection=32, ttl_s=600.0)
    # One key, two connections, two made-up ids: one party. The real actor waits too.
    assert led.request(A, 5, 32, key="shared") is None and led.request(B, 6, 32, key="shared") is None
    assert led.request(b"real", 0, 32, key="actor-0") is None
    # 64 free, 2 parties -> share 32: the shared key's ids get 32 together (oldest first), the actor 32.
    assert led.grant(64, now=0.0) == [Grant(A, 5, 32), Grant(b"real", 0, 32)]
    assert led.principal_credit() == {"shared": 32, "actor-0": 32}


def test_no_loan_is_taken_back_while_the_free_capacity_serves_the_waiting_party() -> None:
    led = CreditLedger(per_actor=16, per_connection=16, ttl_s=600.0)
    assert led.request(A, 1, 6, key="k1") is None
    assert led.grant(8, now=0.0) == [Grant(A, 1, 6)]
    # k2 wants 2; share = (2 free + 6) // 2 = 4, it needs min(2, 4) = 2 and 2 are free: no reclaim.
    assert led.request(B, 2, 2, key="k2") is None
    assert led.reclaim(2) == 0
    assert led.grant(2, now=0.0) == [Grant(B, 2, 2)]
    # Without CurveZMQ the party is the connection.
    led2 = CreditLedger(per_actor=16, per_connection=16, ttl_s=600.0)
    assert led2.request(A, 1, 1) is None and led2.request(A, 2, 1) is None
    assert len(led2.principal_credit()) == 0 and led2.share(4) == 4


def test_no_loan_is_taken_back_for_a_party_its_own_bounds_keep_from_using_it() -> None:
    led = CreditLedger(per_actor=2, per_connection=2, ttl_s=600.0)
    C, D = b"conn-C", b"conn-D"
    for ident, actor_id in ((A, 1), (C, 2), (D, 3)):  # one key, three ids on three connections
        assert led.request(ident, actor_id, 2, key="k1") is None
    assert len(led.grant(6, now=0.0)) == 3  # alone: 6
    assert led.request(B, 4, 5, key="k2") is None
    assert led.grant(2, now=0.0) == [Grant(B, 4, 2)]  # k2 at its per-actor bound (2), still wanting 3
    # share = (0 free + 8) // 2 = 4: k2 holds 2 < 4 but may not hold more, so k1's loan stays.
    assert led.reclaim(0) == 0 and led.principal_credit() == {"k1": 6, "k2": 2}
