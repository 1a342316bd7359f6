"""The balanced micro-batch plan (``common.microplan``): plans worked out by hand on small inputs, the
balance figures of a known case, and the synthetic lengths the benchmark and the balance estimate draw."""

from __future__ import annotations

import math

import pytest

from common.microplan import (
    Workload,
    capped_mean,
    cut_shares,
    deal,
    lockstep,
    lognormal_mu,
    minibatches,
    plan_step,
    sigma_for,
    slot_costs,
    synthetic_lengths,
    truncated_fraction,
)
from tests.common.placement_fixtures import QWEN_32B

TOKENS = Workload()  # cost = tokens: every figure below can be added up by hand


def test_workload_of_a_row_a_micro_batch_and_a_model() -> None:
    w = Workload(linear=2.0, quadratic=0.5)
    assert w.row(4) == 2 * 4 + 0.5 * 16 == 16.0
    assert w.micro([4, 2], packed=True) == 16.0 + (4 + 2) == 22.0  # the rows' own costs
    assert w.micro([4, 2], packed=False) == 2 * 16.0  # two rows padded to the longest
    assert w.micro([], packed=True) == 0.0
    # Qwen2.5-32B: 32,763,876,352 parameters (64 layers of 487,605,248, untied 152064 x 5120 embedding and head,
    # final norm 5120); attention 2 x 64 layers x (40 x 128) = 655,360 a row per token squared.
    q = Workload.of_model(QWEN_32B)
    assert q.linear == 2 * 32_763_876_352
    assert q.quadratic == 2 * 64 * 5120
    assert Workload.of_model(QWEN_32B, "critic").linear < q.linear  # no LM head


def test_deal_gives_the_longest_row_to_the_least_loaded_rank() -> None:
    lengths = [10, 9, 8, 7, 6, 5]
    # 10 -> r0; 9 -> r1; 8 -> r1 (9 < 10); 7 -> r0 (10 < 17); 6: both 17 with 2 rows -> r0; 5 -> r1.
    assert deal(lengths, range(6), 2, TOKENS) == [[0, 3, 4], [1, 2, 5]]
    # Only the rows given: 9 -> r0, 7 -> r1, 5 -> r1 (7 < 9).
    assert deal(lengths, [5, 1, 3], 2, TOKENS) == [[1], [3, 5]]
    assert deal(lengths, [], 3, TOKENS) == [[], [], []]


def test_a_heavy_first_micro_batch_on_one_rank_is_matched_on_the_others() -> None:
    """Rank 0 holds a 60-token row; rank 1 four rows of 30, 30, 20, 20; budget 70 tokens, so k = 2 on both.
    Each cut on its own (LPT) gives rank 1 [30+20, 30+20]: index 0 costs max(60, 50) = 60, index 1 max(40, 50)
    = 50, 110 against an ideal of 100. Cut toward rank 0's profile (60, 40), rank 1 fills its first micro-
    batch to 60 (30 + 30) and leaves 40: 60 + 40 = the ideal."""
    lengths = [60, 20, 20, 30, 30, 20, 20]
    plan = cut_shares([[0, 1, 2], [3, 4, 5, 6]], lengths, 70, TOKENS)
    assert plan == [[[0], [1, 2]], [[3, 4], [5, 6]]]
    assert slot_costs(plan, lengths, TOKENS, packed=True) == [60.0, 40.0]
    s = lockstep(plan, lengths, TOKENS, packed=True)
    assert s == {"lockstep": 100.0, "ideal": 100.0, "over_ideal": 1.0, "slots": 2.0, "padding_share": 0.0,
                 "filler_share": 0.0}


def test_same_count_on_every_rank_within_the_budget_a_longer_row_alone() -> None:
    lengths = [150, 10, 10, 10, 50, 50]
    # Rank 0: 180 tokens need 2 micro-batches of <= 100, the 150-token row alone; rank 1's 100 tokens would fit
    # one, but every rank runs 2: [50], [50].
    plan = cut_shares([[0, 1, 2, 3], [4, 5]], lengths, 100, TOKENS)
    assert plan == [[[0], [1, 2, 3]], [[4], [5]]]
    for rank in plan:
        for m in rank:
            assert len(m) == 1 or sum(lengths[i] for i in m) <= 100


def test_a_rank_with_fewer_rows_than_micro_batches_ends_with_empty_ones() -> None:
    lengths = [40, 40, 40, 10]
    plan = cut_shares([[0, 1, 2], [3]], lengths, 50, TOKENS)  # 40 + 40 > 50: rank 0 needs 3
    assert plan == [[[0], [1], [2]], [[3], [], []]]
    s = lockstep(plan, lengths, TOKENS, packed=True)
    assert s["filler_share"] == pytest.approx(2 / 6)
    assert s["lockstep"] == 120.0 and s["ideal"] == 130 / 2  # index 0 costs 40 on rank 0, not 10


def test_padded_layout_caps_rows_and_counts_padding() -> None:
    lengths = [10, 9, 3, 2, 2]
    # 5 rows, at most 2 a micro-batch: k = 3. LPT (each row to the micro-batch it leaves lightest, padded: rows x
    # the longest) gives [9, 2] 18, [10] 10, [3, 2] 6 = 34. The cuts toward a profile go on from there: caps
    # (10, 9, 7) give 34 again, (18, 10, 6) 35, then (20, 9, 6) puts 9 beside 10 (20 <= 20), 2 beside 3, and the
    # last 2 into the empty third: [10, 9] 20, [3, 2] 6, [2] 2 = 28, rows of like length together.
    plan = cut_shares([[0, 1, 2, 3, 4]], lengths, 100, TOKENS, packed=False, max_rows=2)
    assert plan == [[[0, 1], [2, 3], [4]]]
    s = lockstep(plan, lengths, TOKENS, packed=False)
    assert s["lockstep"] == 28.0 and s["ideal"] == 26.0  # 20 + 6 + 2 run for 26 real tokens
    assert s["padding_share"] == pytest.approx(2 / 28)
    # Packed, the row cap does not apply: 26 tokens fit one micro-batch.
    assert cut_shares([[0, 1, 2, 3, 4]], lengths, 100, TOKENS, packed=True, max_rows=2) == [[[0, 1, 2, 3, 4]]]


def test_the_plan_is_deterministic_and_every_row_runs_once() -> None:
    rows = synthetic_lengths(2048, 5000, 20480, seed=3)
    mbs = minibatches(2048, 4)
    work = Workload.of_model(QWEN_32B)
    a = plan_step(rows.lengths, mbs, 12, 24576, work)
    b = plan_step(rows.lengths, mbs, 12, 24576, work)
    assert a == b
    assert len({len(p) for p in a}) == 1  # the same count on every rank
    ran = sorted(i for p in a for m in p for i in m)
    assert ran == list(range(2048))
    for p in a:
        for m in p:
            assert len(m) == 1 or sum(rows.lengths[i] for i in m) <= 24576


def test_paper_scale_plan_meets_the_goals() -> None:
    """8,192 rows in 16 mini-batches over 48 ranks, the 24,576-token budget (ops/bench/plan.py's step, training
    pass): within 1.10 of the ideal at a 5,000-token mean, 1.20 at 1,500; no filler."""
    work = Workload.of_model(QWEN_32B)
    for mean, goal in ((5000, 1.10), (1500, 1.20)):
        rows = synthetic_lengths(8192, mean, 20480)
        mbs = [[i for i in mb if not rows.truncated[i]] for mb in minibatches(8192, 16)]
        s = lockstep(plan_step(rows.lengths, mbs, 48, 24576, work), rows.lengths, work, packed=True)
        assert s["over_ideal"] <= goal, (mean, s)
        assert s["filler_share"] == 0.0


def test_synthetic_lengths_have_the_asked_mean_after_the_cap() -> None:
    mu = lognormal_mu(5000, 1.0, 20480)
    assert capped_mean(mu, 1.0, 20480) == pytest.approx(5000, rel=1e-9)
    # Without a cap in reach the mean is exp(mu + sigma^2 / 2).
    assert lognormal_mu(100, 0.5, 1e9) == pytest.approx(math.log(100) - 0.125, abs=1e-6)
    t = truncated_fraction(lognormal_mu(8000, 0.7, 20480), 0.7, 20480)
    assert sigma_for(8000, t, 20480) == pytest.approx(0.7, abs=1e-3)  # the spread back from the truncated share
    rows = synthetic_lengths(8192, 5000, 20480, seed=0)
    assert rows.responses.mean() == pytest.approx(5000, rel=0.03)
    assert rows.prompts.mean() == pytest.approx(256, rel=0.03)
    assert (rows.truncated == (rows.responses == 20480)).all()
    assert rows.truncated.mean() == pytest.approx(truncated_fraction(mu, 1.0, 20480), abs=0.01)
    assert rows.responses.max() == 20480 and rows.responses.min() >= 1
    again = synthetic_lengths(8192, 5000, 20480, seed=0)
    assert (again.responses == rows.responses).all() and (again.prompts == rows.prompts).all()
    assert rows.params()["response_sigma"] == 1.0
