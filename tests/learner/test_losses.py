"""learner.losses: token-level vs sequence-mean aggregation, clip-higher gradients, NLL on positives."""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import (
    entropy_from_logits,
    explained_variance,
    masked_mean,
    masked_whiten,
    nll_loss,
    policy_loss,
    positive_token_count,
    token_logprobs,
    value_loss,
)

# Uneven batch: sequence 0 has 1 real token, sequence 1 has 3.
MASK = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([[3.0, 9.0, 9.0], [1.0, 1.0, 1.0]])


def _loss(agg: str, normalizer=None) -> torch.Tensor:
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(2, 3), ADV, MASK, 0.2, 0.28, loss_agg=agg, normalizer=normalizer)
    return loss


def test_token_mean_vs_seq_mean_on_uneven_batch() -> None:
    # ratio = 1 everywhere, so the per-token objective is A.
    # token mean: −(3 + 1 + 1 + 1) / 4 real tokens = −1.5
    torch.testing.assert_close(_loss("token_mean"), torch.tensor(-1.5))
    # seq mean: −((3 / 1) + (3 / 3)) / 2 sequences = −2.0
    torch.testing.assert_close(_loss("seq_mean"), torch.tensor(-2.0))
    with pytest.raises(ValueError):
        _loss("bogus")


def test_global_normalizer_makes_micro_batches_add_up_to_the_full_batch_token_mean() -> None:
    # Token-level normalisation: summing micro-batch losses normalised by the global token count == full-batch token mean.
    full = _loss("token_mean")
    n = MASK.sum()
    parts = []
    for i in range(2):
        logp = torch.zeros(1, 3, requires_grad=True)
        loss, _ = policy_loss(logp, torch.zeros(1, 3), ADV[i : i + 1], MASK[i : i + 1], normalizer=n)
        parts.append(loss)
    torch.testing.assert_close(sum(parts), full)
    # The naive per-micro-batch mean gives a different (wrong) answer on this uneven batch: −(3 + 1)/2 = −2.
    naive = sum(policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), ADV[i : i + 1], MASK[i : i + 1])[0] for i in range(2)) / 2
    assert not torch.isclose(naive, full)


@pytest.mark.parametrize(
    "log_ratio, adv, clipped",
    [
        (math.log(1.5), 1.0, True),  # ratio 1.5 > 1 + 0.28 with A > 0: clipped, no gradient
        (math.log(1.2), 1.0, False),  # inside the clip-higher range (1.2 < 1.28): gradient flows
        (math.log(0.7), -1.0, True),  # ratio 0.7 < 1 − 0.2 with A < 0: clipped
        (math.log(0.7), 1.0, False),  # ratio low but A > 0: min() picks the unclipped term, gradient flows
        (math.log(1.5), -1.0, False),  # ratio high but A < 0: unclipped term, gradient flows
    ],
)
def test_clip_higher_gradient(log_ratio: float, adv: float, clipped: bool) -> None:
    logp = torch.tensor([[log_ratio]], requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1), 0.2, 0.28)
    loss.backward()
    if clipped:
        assert logp.grad.abs().item() == 0.0
        key = "clip_fraction_high" if adv > 0 else "clip_fraction_low"
        assert stats[key].item() == 1.0
    else:
        # d/dlogp of −r·A = −r·A
        assert logp.grad.item() == pytest.approx(-math.exp(log_ratio) * adv, rel=1e-5)
        assert stats["clip_fraction_high"].item() == 0.0 and stats["clip_fraction_low"].item() == 0.0


def test_policy_stats_and_importance_weight() -> None:
    logp = torch.log(torch.tensor([[1.1, 0.9]]))
    _, stats = policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    assert stats["ratio_mean"].item() == pytest.approx(1.0, abs=1e-6)
    assert stats["approx_kl"].item() == pytest.approx(-(math.log(1.1) + math.log(0.9)) / 2, rel=1e-5)
    w = torch.tensor([[2.0, 0.0]])
    loss_w, _ = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), importance_weight=w)
    torch.testing.assert_close(loss_w, torch.tensor(-1.0))  # −(2·1 + 0·1) / 2


def test_nll_ignores_non_positive_samples() -> None:
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-5.0, -5.0, -5.0], [-3.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards = torch.tensor([1.0, 0.0, 1.0])
    loss = nll_loss(logp, mask, rewards)
    # positive tokens: row 0 (−1, −2) and row 2 (−3) → 6 / 3 = 2
    torch.testing.assert_close(loss, torch.tensor(2.0))
    assert positive_token_count(mask, rewards).item() == 3
    loss.backward()
    assert torch.all(logp.grad[1] == 0) and logp.grad[0, 2] == 0


def test_nll_with_no_positives_is_zero_not_nan() -> None:
    logp = torch.randn(2, 3, requires_grad=True)
    loss = nll_loss(logp, torch.ones(2, 3), torch.zeros(2))
    assert loss.item() == 0.0 and not torch.isnan(loss)
    loss.backward()
    assert torch.all(logp.grad == 0)


def test_value_loss_and_clipping() -> None:
    values = torch.tensor([[0.9, 0.1]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0]])
    loss, _ = value_loss(values, returns, torch.ones(1, 2))
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.01 + 0.81) / 2))
    # Clipped around old 0.5 by ±0.2: V0 = 0.9 → 0.7, (0.7−1)² = .09 > .01, the clipped term wins;
    # V1 = 0.1 → 0.3, (0.3−1)² = .49 < .81, the unclipped term stays. Clip fraction 1/2.
    loss_c, stats = value_loss(values, returns, torch.ones(1, 2), old_values=torch.full((1, 2), 0.5), clip=0.2)
    torch.testing.assert_close(loss_c, torch.tensor(0.5 * (0.09 + 0.81) / 2))
    assert stats["value_clip_fraction"].item() == 0.5


def test_explained_variance() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 2.0, 99.0]])
    assert explained_variance(returns, returns, mask)[0] == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 1.0), returns, mask)[0] == pytest.approx(0.0, abs=1e-6)
    assert explained_variance(-returns, returns, mask)[0] < 0
    assert explained_variance(returns, torch.ones(1, 4), mask)[0] == 0.0  # constant returns


def test_explained_variance_hand_derived() -> None:
    # Real tokens R = [0, 1, 2], V = [0, 0, 3]: d = R − V = [0, 1, −1]. Unbiased: Var[R] = 1,
    # Var[d] = (2 − 0²/3) / 2 = 1 → EV = 1 − 1/1 = 0. Mean V = 1. Padding (99) is ignored.
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 2.0, 99.0]])
    ev, mean = explained_variance(torch.tensor([[0.0, 0.0, 3.0, 50.0]]), returns, mask)
    assert ev == pytest.approx(0.0, abs=1e-12) and mean == pytest.approx(1.0)
    # V = [0, 1, 1]: d = [0, 0, 1], Var[d] = (1 − 1/3) / 2 = 1/3 → EV = 2/3; mean V = 2/3.
    ev, mean = explained_variance(torch.tensor([[0.0, 1.0, 1.0, 0.0]]), returns, mask)
    assert ev == pytest.approx(2 / 3) and mean == pytest.approx(2 / 3)
    # Fewer than two real tokens: EV 0, mean still the mean value.
    assert explained_variance(torch.tensor([[4.0, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]])) == (0.0, 4.0)


def test_masked_mean_and_whiten() -> None:
    x = torch.tensor([[1.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    assert masked_mean(x, m).item() == 2.0
    assert masked_mean(x, torch.zeros(1, 3)).item() == 0.0
    w = masked_whiten(x, m)
    assert w[0, 2].item() == 0.0
    assert masked_mean(w, m).item() == pytest.approx(0.0, abs=1e-6)
    # mean 2, unbiased variance ((1−2)² + (3−2)²) / 1 = 2: [−1, 1] / sqrt(2 + 1e-8).
    torch.testing.assert_close(w, torch.tensor([[-1.0, 1.0, 0.0]]) / math.sqrt(2.0 + 1e-8))
    assert torch.equal(masked_whiten(x, torch.zeros(1, 3)), torch.zeros(1, 3))  # no real token


def test_reduce_sum_sees_the_stacked_sufficient_statistics() -> None:
    """``reduce_sum`` gets one float64 vector per call (what an all-reduce sums over ranks); doubling it
    (two ranks holding the same rows) gives the statistics of both ranks' rows together."""
    x = torch.tensor([[1.0, 3.0, 100.0], [2.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    r = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    seen: list[torch.Tensor] = []

    def twice(s: torch.Tensor) -> torch.Tensor:
        seen.append(s)
        return 2 * s

    both = masked_whiten(torch.cat([x, x]), torch.cat([m, m]))
    torch.testing.assert_close(masked_whiten(x, m, reduce_sum=twice), both[:2], rtol=0, atol=1e-7)
    assert seen[-1].dtype == torch.float64 and seen[-1].tolist() == [3.0, 6.0, 14.0]  # n, Σx, Σx²
    ev2 = explained_variance(x, r, m, reduce_sum=twice)
    assert seen[-1].shape == (6,)
    ev_both = explained_variance(torch.cat([x, x]), torch.cat([r, r]), torch.cat([m, m]))
    assert ev2 == pytest.approx(ev_both, abs=1e-12)


def test_token_logprobs_and_entropy() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]]))
    lp = token_logprobs(logits, torch.tensor([[0, 2]]))
    torch.testing.assert_close(lp, torch.log(torch.tensor([[0.5, 1 / 3]])))
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.tensor([[1.5 * math.log(2), math.log(3)]]))


@pytest.mark.parametrize("chunks", [1, 3, 7, 40])  # 40 > 13 positions: some chunks are empty
def test_chunked_logprobs_and_entropy_equal_the_full_computation(chunks: int) -> None:
    """Values and gradients (w.r.t. hidden states and head weight) of the chunked, recomputed LM head
    equal log_softmax over full logits, for a loss that uses both log-probs and entropy."""
    from learner.losses import chunked_token_logprobs

    g = torch.Generator().manual_seed(0)
    N, H, V = 13, 8, 50
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    tokens = torch.randint(0, V, (N,), generator=g)
    coef = torch.randn(N, generator=g)

    logits = head(hidden)
    lp_full = token_logprobs(logits[None], tokens[None])[0]
    ent_full = entropy_from_logits(logits[None])[0]
    ((coef * lp_full).sum() + 0.3 * ent_full.sum()).backward()
    g_h, g_w = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    lp, ent = chunked_token_logprobs(hidden, head, tokens, chunks, entropy_grad=True)
    torch.testing.assert_close(lp, lp_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_full, atol=1e-5, rtol=1e-5)
    ((coef * lp).sum() + 0.3 * ent.sum()).backward()
    torch.testing.assert_close(hidden.grad, g_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.weight.grad, g_w, atol=1e-5, rtol=1e-5)
    # Hand-derived: uniform logits give log(1/V) and entropy log(V) everywhere.
    lp0, ent0 = chunked_token_logprobs(torch.zeros(3, H), lambda x: torch.zeros(x.shape[0], V), tokens[:3], chunks)
    torch.testing.assert_close(lp0, torch.full((3,), -math.log(V)))
    torch.testing.assert_close(ent0, torch.full((3,), math.log(V)))


def test_chunked_logprobs_never_hold_more_than_a_chunk_of_logits() -> None:
    """Every [n, V] tensor the head produces, forward and backward (recomputation), has n ≤ the chunk."""
    from learner.losses import chunked_token_logprobs

    N, H, V, chunks = 40, 4, 30, 5
    seen: list[int] = []
    lin = torch.nn.Linear(H, V)

    def head(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return lin(x)

    hidden = torch.randn(N, H, requires_grad=True)
    lp, ent = chunked_token_logprobs(hidden, head, torch.randint(0, V, (N,)), chunks)
    # A metric-only entropy stays out of the graph: its saved [n, V] tensors would outlive their chunk.
    assert lp.requires_grad and not ent.requires_grad
    lp.sum().backward()
    assert seen == [N // chunks] * (2 * chunks)  # forward, then one recomputation per chunk in backward
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("weight", [None, 2.0])
def test_dual_clip_caps_the_gradient_of_a_huge_ratio_with_negative_advantage(loss_agg: str, weight: float | None) -> None:
    """Ratios 20, 2.5, 1.1 with A = −1 on three tokens of one row. Without the dual clip the objective is
    r·A (A < 0 takes the unclipped term above 1 + ε_high), so d loss / d logp = −r·A·w / 3 = (20, 2.5, 1.1)·w/3:
    the r = 20 token dominates. With c = 3 that token's objective is c·A = −3, a constant: gradient 0, and
    the others (r < c) are unchanged. Hand-derived; the same in every aggregation and with an importance weight."""
    ratios = torch.tensor([[20.0, 2.5, 1.1]])
    adv, mask = -torch.ones(1, 3), torch.ones(1, 3)
    iw = None if weight is None else torch.full((1, 3), weight)
    w = 1.0 if weight is None else weight
    grads, losses = {}, {}
    for c in (0.0, 3.0):
        logp = torch.log(ratios).requires_grad_(True)
        loss, st = policy_loss(logp, torch.zeros(1, 3), adv, mask, 0.2, 0.28, loss_agg=loss_agg,
                               importance_weight=iw, clip_ratio_c=c)
        loss.backward()
        grads[c], losses[c] = logp.grad[0], float(loss)
        assert st["clip_fraction_dual"].item() == pytest.approx(0.0 if c == 0 else 1 / 3)
    torch.testing.assert_close(grads[0.0], torch.tensor([20.0, 2.5, 1.1]) * w / 3)
    torch.testing.assert_close(grads[3.0], torch.tensor([0.0, 2.5, 1.1]) * w / 3)
    assert losses[0.0] == pytest.approx((20 + 2.5 + 1.1) * w / 3, rel=1e-6)
    assert losses[3.0] == pytest.approx((3 + 2.5 + 1.1) * w / 3, rel=1e-6)
    # A positive advantage is bounded by clip-higher already: the dual clip leaves it alone.
    logp = torch.log(ratios).requires_grad_(True)
    policy_loss(logp, torch.zeros(1, 3), -adv, mask, 0.2, 0.28, loss_agg=loss_agg, clip_ratio_c=3.0)[0].backward()
    torch.testing.assert_close(logp.grad[0], torch.tensor([0.0, 0.0, -1.1]) / 3)


def test_behaviour_weight_masks_or_truncates_above_the_cap() -> None:
    """log π_prox − log π_behav = log 8, log 0.5, log 1.5 on one row, padding after. AReaL masks the token
    above the cap (weight 0), verl's truncated IS clamps it; per sequence the product 8·0.5·1.5 = 6 is
    truncated to the cap on every real token."""
    from learner.losses import behaviour_weight

    prox = torch.log(torch.tensor([[8.0, 0.5, 1.5, 1.0]]))
    behav = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(behaviour_weight(prox, behav, mask, 5.0, mode="mask"), torch.tensor([[0.0, 0.5, 1.5, 0.0]]))
    torch.testing.assert_close(behaviour_weight(prox, behav, mask, 5.0, mode="truncate"),
                               torch.tensor([[5.0, 0.5, 1.5, 0.0]]))
    torch.testing.assert_close(behaviour_weight(prox, behav, mask, 2.0, mode="truncate", level="sequence"),
                               torch.tensor([[2.0, 2.0, 2.0, 0.0]]))
    torch.testing.assert_close(behaviour_weight(prox, behav, mask, 10.0, mode="truncate", level="sequence"),
                               torch.tensor([[6.0, 6.0, 6.0, 0.0]]))
    with pytest.raises(ValueError):
        behaviour_weight(prox, behav, mask, 2.0, mode="mask", level="sequence")


def test_mismatch_stats_hand_derived() -> None:
    """k3 = (r − 1) − log r per real token: r = 2 gives 1 − log 2, r = 1 gives 0; padding (r = e^5) is
    ignored, so the max ratio is 2."""
    from learner.losses import mismatch_stats

    learner_lp = torch.tensor([[math.log(2.0), 0.0, 5.0]])
    kl_sum, n, top = mismatch_stats(learner_lp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
    assert n == 2 and kl_sum == pytest.approx(1 - math.log(2)) and top == pytest.approx(2.0)
    assert mismatch_stats(learner_lp, torch.zeros(1, 3), torch.zeros(1, 3)) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("chunks, bound", [(1, 3e-3), (7, 5e-3), (45, 1e-2)])
def test_bf16_chunked_head_weight_gradient_error_is_bounded(chunks: int, bound: float) -> None:
    """Under bf16 the LM head's weight gradient is summed over chunks in bf16 (autograd accumulates a
    parameter's gradient in its dtype; an fp32 accumulator would be a [V, H] fp32 buffer, 3 GB for a
    152k × 5120 head, outside ZeRO-3's parameter hooks). Measured against float64 math on the same bf16
    inputs (2880 tokens, H 64, V 1000): 2.3e-3 relative (Frobenius) with one chunk (bf16's own rounding of
    the product), 4.2e-3 with 8, 7.9e-3 with 45 (a 20k-token row): ≈ 2.4e-3·sqrt(1 + (n − 1)/4). The
    documented bound (docs/ALGORITHM.md, "Data parallelism and numerics") is this test's."""
    from learner.losses import chunked_token_logprobs

    g = torch.Generator().manual_seed(1)
    N, H, V = 2880, 64, 1000
    hidden = torch.randn(N, H, generator=g).bfloat16().requires_grad_(True)
    head = torch.nn.Linear(H, V, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_((torch.randn(V, H, generator=g) * 0.05).bfloat16())
    tokens = torch.randint(0, V, (N,), generator=g)
    coef = torch.randn(N, generator=g) / N
    lp, _ = chunked_token_logprobs(hidden, head, tokens, chunks, entropy=False)
    (coef * lp).sum().backward()
    w = head.weight.detach().double().requires_grad_(True)
    ref = torch.log_softmax(hidden.detach().double() @ w.T, -1).gather(-1, tokens[:, None]).squeeze(-1)
    (coef.double() * ref).sum().backward()
    rel = float((head.weight.grad.double() - w.grad).norm() / w.grad.norm())
    assert rel < bound, rel


@pytest.mark.parametrize("adv", [1.0, -1.0])
@pytest.mark.parametrize("clip_ratio_c", [0.0, 3.0])
def test_huge_log_ratio_gives_a_finite_loss_and_gradient(adv: float, clip_ratio_c: float) -> None:
    """log r = 100 on one token (exp overflows fp32 past 88.7): without a clamp the ratio is inf and the
    gradient 0·inf = NaN (A > 0: the clipped branch wins; A < 0 with the dual clip: the bound wins) or the
    loss −inf. With the clamp both stay finite; the ordinary token beside it keeps its exact gradient −A/2."""
    logp = torch.tensor([[100.0, 0.0]], requires_grad=True)
    loss, st = policy_loss(logp, torch.zeros(1, 2), torch.full((1, 2), adv), torch.ones(1, 2), 0.2, 0.28,
                           clip_ratio_c=clip_ratio_c)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1].item() == pytest.approx(-adv / 2)
    assert math.isfinite(float(st["ratio_mean"]))
