"""learner.schedule: one deal of rows to ranks for every pass, rows no loss reads skipped, the same micro-batch count
on every rank, the no-grad budget, and fillers only where a rank has no row left."""

from __future__ import annotations

import numpy as np
import torch

from common.microplan import Workload
from common.protocol import Sample
from learner.batch import collate_samples
from learner.schedule import MicroLimits, micro_batches, micro_plan, my_rows, read_rows, shares

LENGTHS = [10, 2, 6, 8, 4, 3]  # prompt + response tokens of rows 0..5 (one prompt token each)


def _batch(excluded: tuple[int, ...] = (), replay: tuple[int, ...] = ()):
    samples = [Sample(prompt_ids=np.array([1], dtype=np.int32), output_ids=np.full(n - 1, 2, dtype=np.int32),
                      output_logprobs=np.zeros(n - 1, dtype=np.float32), reward=0.0, finish_reason="stop",
                      weight_version=0, response_length=n - 1) for n in LENGTHS]
    b = collate_samples(samples, pad_id=0)
    b.excluded[list(excluded)] = True
    b.is_replay[list(replay)] = True
    return b


def test_one_deal_serves_every_pass_and_budget() -> None:
    """Longest first to the least-loaded rank (workload = tokens here): 10 → r0, 8 → r1, 6 → r1, 4 → r0, 3 → r0
    (a tie at 14: fewer rows, then the lower rank), 2 → r1."""
    b = _batch()
    lim = MicroLimits(tokens=12, packed=True, work=Workload(1.0, 0.0))
    rows = torch.arange(6)
    assert shares(rows, b, lim, 2) == [[0, 4, 5], [3, 2, 1]]
    train = micro_plan(rows, b, lim, 2, grad=True, model="policy")
    no_grad = micro_plan(rows, b, lim, 2, grad=False, model="policy")
    # 17 and 16 tokens per rank within 12: two micro-batches each, heaviest first; without a backward the budget
    # doubles (24) and one micro-batch each holds the rank's whole share.
    assert [len(p) for p in train] == [2, 2] and [len(p) for p in no_grad] == [1, 1]
    assert all(sum(LENGTHS[i] for i in m) <= 12 for p in train for m in p)
    for r, share in enumerate(shares(rows, b, lim, 2)):
        assert sorted(i for m in train[r] for i in m) == sorted(share) == sorted(i for m in no_grad[r] for i in m)
    assert lim.budget(b, grad=False) == 24 and MicroLimits(rows=2).budget(b, grad=True) == 2 * 10


def test_rows_no_loss_reads_are_skipped_in_every_pass() -> None:
    """Row 0 cut at the length limit under algo.truncated=mask is in no pass; row 3, a replayed positive, is in the
    policy's passes (the NLL reads it) and not the critic's."""
    b = _batch(excluded=(0,), replay=(3,))
    lim = MicroLimits(tokens=100, packed=True)
    rows = torch.arange(6)
    assert read_rows(b, rows, "policy").tolist() == [1, 2, 3, 4, 5]
    assert read_rows(b, rows, "critic").tolist() == [1, 2, 4, 5]
    policy = [i for p in micro_plan(rows, b, lim, 2, grad=True, model="policy") for m in p for i in m]
    critic = [i for p in micro_plan(rows, b, lim, 2, grad=True, model="critic") for m in p for i in m]
    assert sorted(policy) == [1, 2, 3, 4, 5] and sorted(critic) == [1, 2, 4, 5]
    assert my_rows([rows], b, lim).tolist() == [1, 2, 3, 4, 5]  # one rank: all it trains on


def test_a_filler_only_where_a_rank_has_no_row_left() -> None:
    b = _batch()
    lim = MicroLimits(tokens=100, packed=True)
    two_rows = torch.tensor([1, 5])
    plan = micro_plan(two_rows, b, lim, 3, grad=True, model="policy")
    assert [len(p) for p in plan] == [1, 1, 1] and sorted(len(p[0]) for p in plan) == [0, 1, 1]
    # On one rank every micro-batch is a real one, packed as configured.
    mine = micro_batches([torch.arange(6)], b, lim)
    assert all(m.weight == 1.0 and m.packed for m in mine)
    assert sorted(torch.cat([m.rows for m in mine]).tolist()) == list(range(6))
