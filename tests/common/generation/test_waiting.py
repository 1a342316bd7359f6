"""common.generation.waiting: the scheduler's waiting queue keeps its token count, refuses what cannot fit,
cuts prefills by their token budget, puts retracted sequences back first, and runs control calls in order."""

from __future__ import annotations

import pytest

from common.generation.sampling import RequestError, SamplingParams
from common.generation.waiting import Commands, SchedulerBusy, Sequence, WaitQueue, aborted


def seq(rid: str, prompt: int, max_new: int = 4) -> Sequence:
    s = Sequence(rid, list(range(prompt)), SamplingParams.from_dict({"max_new_tokens": max_new}, 100), lambda _: None)
    s.cost = prompt + max_new
    return s


def test_the_token_count_follows_every_way_in_and_out() -> None:
    q = WaitQueue(max_queued_tokens=100)
    for s in (seq("a", 6), seq("b", 10), seq("c", 2)):
        q.push(s)
    assert len(q) == 3 and q.tokens == 10 + 14 + 6
    gone = q.remove(lambda s: s.rid == "b")
    assert [s.rid for s in gone] == ["b"] and q.tokens == 16 and q.first().rid == "a"
    assert q.pop().rid == "a" and q.tokens == 6
    assert [s.rid for s in q.drain()] == ["c"] and q.tokens == 0 and len(q) == 0


def test_a_request_past_the_bound_is_refused_whole() -> None:
    q = WaitQueue(max_queued_tokens=20)
    q.push(seq("a", 10))  # 14 tokens held
    with pytest.raises(SchedulerBusy):
        q.admissible(7)  # fits alone, not beside what waits: retry later
    with pytest.raises(RequestError):
        q.admissible(21)  # never fits
    q.admissible(6)


def test_a_prefill_takes_at_least_one_and_stops_at_its_token_budget() -> None:
    q = WaitQueue(max_queued_tokens=1000)
    for i, n in enumerate((30, 30, 30, 30)):
        q.push(seq(f"s{i}", n))
    assert [s.rid for s in q.take(free=8, max_prefill_tokens=70)] == ["s0", "s1"]
    assert [s.rid for s in q.take(free=1, max_prefill_tokens=70)] == ["s2"]  # the free slots bound it too
    assert [s.rid for s in q.take(free=8, max_prefill_tokens=10)] == ["s3"]  # one even past the budget
    assert q.tokens == 0


def test_retracted_sequences_wait_first_in_slot_order_and_recompute_their_cache() -> None:
    q = WaitQueue(max_queued_tokens=1000)
    q.push(seq("new", 5))
    running = [seq("slot0", 3), seq("slot1", 4)]
    for s in running:
        s.cached_len = 7
    q.retract(running)
    taken = q.take(free=8, max_prefill_tokens=1000)
    assert [s.rid for s in taken] == ["slot0", "slot1", "new"]
    assert [(s.cached_len, s.retractions) for s in taken[:2]] == [(0, 1), (0, 1)]


def test_a_sequence_ends_at_eos_a_stop_token_or_its_length() -> None:
    s = seq("a", 3, max_new=3)
    assert not s.record(7, -0.5, "1", eos_token_ids={2}, context_length=64)
    assert s.record(2, -0.1, "2", eos_token_ids={2}, context_length=64)
    assert s.finish == {"type": "stop", "matched": 2} and s.versions == ["1", "2"] and s.output_ids == [7, 2]
    t = seq("b", 3, max_new=2)
    t.record(5, 0.0, "1", eos_token_ids={2}, context_length=64)
    assert t.record(6, 0.0, "1", eos_token_ids={2}, context_length=64)
    assert t.finish == {"type": "length", "length": 2}
    assert aborted("gone", 500)["status_code"] == 500


def test_control_calls_run_in_order_and_a_failure_answers_its_own_future() -> None:
    c = Commands()
    seen: list[int] = []
    ok = c.put(lambda: seen.append(1) or "first")
    bad = c.put(lambda: 1 / 0)
    last = c.put(lambda: seen.append(3) or "third")
    assert len(c) == 3
    Commands.run(c.take())
    assert len(c) == 0 and seen == [1, 3]
    assert ok.result() == "first" and last.result() == "third"
    with pytest.raises(ZeroDivisionError):
        bad.result()
