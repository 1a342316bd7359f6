"""learner.advantages against hand-derived values and the per-token reference GAE (tests.learner.synth)."""

from __future__ import annotations

import pytest
import torch

from learner.advantages import (
    decoupled_gae,
    discounted_reverse_cumsum,
    gae,
    group_baseline_values,
    group_normalized_advantages,
    grpo_advantages,
    leave_one_out_means,
    length_adaptive_lambda,
    terminal_rewards,
)
from tests.learner.synth import reference_gae

# One 4-token response, reward 1 on the last token, γ = 1.
# V = [0.2, 0.4, 0.3, 0.6] → δ = [0.4-0.2, 0.3-0.4, 0.6-0.3, 1-0.6] = [0.2, -0.1, 0.3, 0.4]
R4 = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
V4 = torch.tensor([[0.2, 0.4, 0.3, 0.6]])
M4 = torch.ones(1, 4)


@pytest.mark.parametrize(
    "lam, adv, ret",
    [
        # λ = 0: A = δ (one-step TD error); returns = δ + V
        (0.0, [0.2, -0.1, 0.3, 0.4], [0.4, 0.3, 0.6, 1.0]),
        # λ = 0.5: A3 = .4; A2 = .3 + .5·.4 = .5; A1 = −.1 + .5·.5 = .15; A0 = .2 + .5·.15 = .275
        (0.5, [0.275, 0.15, 0.5, 0.4], [0.475, 0.55, 0.8, 1.0]),
        # λ = 1: A_t = Σ δ = R − V_t; returns = final reward at every token
        (1.0, [0.8, 0.6, 0.7, 0.4], [1.0, 1.0, 1.0, 1.0]),
    ],
)
def test_gae_hand_derived(lam: float, adv: list[float], ret: list[float]) -> None:
    a, r = gae(R4, V4, M4, gamma=1.0, lam=lam)
    torch.testing.assert_close(a, torch.tensor([adv]), atol=1e-6, rtol=0)
    torch.testing.assert_close(r, torch.tensor([ret]), atol=1e-6, rtol=0)
    # Same through the tensor-λ path.
    a2, r2 = gae(R4, V4, M4, gamma=1.0, lam=torch.tensor([lam]))
    torch.testing.assert_close(a2, a, atol=1e-6, rtol=0)
    torch.testing.assert_close(r2, r, atol=1e-6, rtol=0)


def test_lambda_one_returns_equal_final_reward_on_real_tokens_and_zero_on_padding() -> None:
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    scores = torch.tensor([1.0, 0.0, 1.0])
    rewards = terminal_rewards(scores, mask)
    values = torch.randn(3, 5)
    _, returns = gae(rewards, values, mask, 1.0, 1.0)
    expected = scores.unsqueeze(-1) * mask
    torch.testing.assert_close(returns, expected, atol=1e-6, rtol=0)


def test_lambda_zero_is_one_step_td_error() -> None:
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    values = torch.randn(1, 6)
    rewards = terminal_rewards(torch.tensor([1.0]), mask)
    adv, _ = gae(rewards, values, mask, 1.0, 0.0)
    v = values[0, :4]
    td = torch.stack([v[1] - v[0], v[2] - v[1], v[3] - v[2], 1.0 - v[3]])
    torch.testing.assert_close(adv[0, :4], td, atol=1e-6, rtol=0)
    assert torch.all(adv[0, 4:] == 0)


def random_batch(B: int, T: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = 0  # a zero-length row
    lengths[-1] = T  # a full row
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)
    scores = torch.randint(0, 2, (B,), generator=g).to(dtype)
    rewards = terminal_rewards(scores, mask)
    values = torch.rand(B, T, generator=g, dtype=dtype) * mask
    return rewards, values, mask, lengths


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("T", [1, 7, 33, 130, 257])
def test_vectorised_gae_matches_naive_reference(dtype: torch.dtype, tol: float, T: int) -> None:
    rewards, values, mask, lengths = random_batch(B=12, T=T, dtype=dtype, seed=T)
    # Per-row λ including l < 1/α (clamped to 0) and l = 0.
    lam = length_adaptive_lambda(lengths, alpha=0.05).to(dtype)
    assert (lam == 0).any()
    for lam_row in (lam, torch.full_like(lam, 0.95), torch.rand(12, generator=torch.Generator().manual_seed(1)).to(dtype)):
        adv, ret = gae(rewards, values, mask, 1.0, lam_row)
        ref_adv, ref_ret = reference_gae(rewards, values, mask, 1.0, lam_row)
        torch.testing.assert_close(adv, ref_adv, atol=tol, rtol=0)
        torch.testing.assert_close(ret, ref_ret, atol=tol, rtol=0)
        assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
        assert torch.all(adv[0] == 0)  # zero-length row


def test_gamma_below_one_matches_reference() -> None:
    rewards, values, mask, _ = random_batch(B=6, T=70, dtype=torch.float64, seed=3)
    lam = torch.tensor([0.0, 0.3, 0.9, 1.0, 0.5, 0.99], dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, 0.9, lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, 0.9, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-10, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=1e-10, rtol=0)


def test_long_sequences_do_not_overflow() -> None:
    # The c^{-t} rescaling trick overflows at T ~ 3000 with λ = 0.95; ours uses only powers ≤ 1.
    T = 4000
    mask = torch.ones(2, T)
    rewards = terminal_rewards(torch.tensor([1.0, 0.0]), mask)
    values = torch.full((2, T), 0.5)
    adv, ret = gae(rewards, values, mask, 1.0, torch.tensor([0.95, 0.0]))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    # Far from the end the λ = 0.95 advantage is the pure TD error (0 for constant values).
    assert abs(float(adv[0, 0])) < 1e-6
    torch.testing.assert_close(adv[0, -1], torch.tensor(0.5))


def test_discounted_reverse_cumsum_scalar_paths() -> None:
    x = torch.arange(1.0, 6.0).unsqueeze(0)
    torch.testing.assert_close(discounted_reverse_cumsum(x, 1.0), torch.tensor([[15.0, 14.0, 12.0, 9.0, 5.0]]))
    torch.testing.assert_close(discounted_reverse_cumsum(x, 0.0), x)
    torch.testing.assert_close(discounted_reverse_cumsum(x, 0.5)[0, -2], torch.tensor(4.0 + 2.5))


def test_length_adaptive_lambda_values() -> None:
    lengths = torch.tensor([0, 10, 20, 40, 100, 1000])
    lam = length_adaptive_lambda(lengths, alpha=0.05)
    # 1 − 1/(0.05·l): l=20 → 0, l=40 → 0.5, l=100 → 0.8, l=1000 → 0.98; l ≤ 20 clamps to 0.
    torch.testing.assert_close(lam, torch.tensor([0.0, 0.0, 0.0, 0.5, 0.8, 0.98]))
    lam1 = length_adaptive_lambda(torch.tensor([1, 2, 4]), alpha=1.0)
    torch.testing.assert_close(lam1, torch.tensor([0.0, 0.5, 0.75]))


def test_decoupled_gae_trains_critic_on_lambda_critic_not_lambda_actor() -> None:
    # Decoupled GAE: the critic target must be the λ_critic = 1 return (final reward), whatever λ_actor is.
    adv, ret = decoupled_gae(R4, V4, M4, gamma=1.0, lam_actor=torch.tensor([0.0]), lam_critic=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.2, -0.1, 0.3, 0.4]]))
    torch.testing.assert_close(ret, torch.ones(1, 4))


def test_terminal_rewards_places_score_on_last_real_token() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float32)
    r = terminal_rewards(torch.tensor([1.0, 0.5, 1.0]), mask)
    torch.testing.assert_close(r, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [0.0, 0.0, 0.0]]))


def test_group_normalized_advantages() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    a = group_normalized_advantages(scores, group_size=4)
    # group 1: mean .25, unbiased std .5 → [1.5, −.5, −.5, −.5]; group 2 uniform → 0
    torch.testing.assert_close(a, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        group_normalized_advantages(scores, group_size=3)


def test_grpo_advantages_per_group_on_real_tokens() -> None:
    # Rows 0, 2, 4 form group 0 (scores 1, 0, 0: mean 1/3, unbiased std sqrt(1/3)); rows 1, 3 group 1
    # (scores 1, 1: uniform → 0); row 5 is a replayed positive (index −1 → 0).
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    group_index = torch.tensor([0, 1, 0, 1, 0, -1])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    std = (1 / 3) ** 0.5
    a_pos, a_neg = (2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)  # ≈ 1.1547, −0.5774
    expected = torch.tensor([[a_pos, a_pos, 0], [0, 0, 0], [a_neg] * 3, [0, 0, 0], [a_neg, 0, 0], [0, 0, 0]])
    got = grpo_advantages(scores, group_index, mask, std_normalize=True)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # Without the std: r − mean only.
    centred = torch.tensor([[2 / 3, 2 / 3, 0], [0, 0, 0], [-1 / 3] * 3, [0, 0, 0], [-1 / 3, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(grpo_advantages(scores, group_index, mask, std_normalize=False), centred,
                               atol=1e-6, rtol=0)


def test_bad_shapes_and_params_raise() -> None:
    with pytest.raises(ValueError):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 4), 1.0, 0.5)
    with pytest.raises(ValueError):
        gae(R4, V4, M4, 1.5, 0.5)
    with pytest.raises(ValueError):
        gae(R4, V4, M4, 1.0, 1.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_host_copies() -> None:
    rewards, values, mask, lengths = random_batch(B=64, T=300, dtype=torch.float32, seed=5)
    lam = length_adaptive_lambda(lengths, 0.05)
    cpu = gae(rewards, values, mask, 1.0, lam)
    dev = [t.cuda() for t in (rewards, values, mask, lam)]
    torch.cuda.synchronize()
    gpu = gae(dev[0], dev[1], dev[2], 1.0, dev[3])
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], atol=1e-5, rtol=0)
    assert gpu[0].device.type == "cuda"


def test_leave_one_out_means_hand_derived() -> None:
    # Group 7 = rows 0, 2, 3 (rewards 1, 0, 1; sum 2), group 4 = rows 1, 4 (0, 1), row 5 alone, row 6 outside.
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    index = torch.tensor([7, 4, 7, 7, 4, 9, -1])
    got = leave_one_out_means(scores, index)
    # row 0: (2 − 1)/2 = .5; row 2: (2 − 0)/2 = 1; row 3: .5; row 1: 1/1 = 1; row 4: 0/1 = 0
    torch.testing.assert_close(got[:5], torch.tensor([0.5, 1.0, 1.0, 0.5, 0.0]))
    assert torch.isnan(got[5:]).all()


def test_group_baseline_values_give_the_loo_advantage_and_keep_the_critics_td_errors() -> None:
    """V' = V − V(s_0) + loo. Row 0 (reward 1, others 0 and 1: loo .5), V = [.2, .4, .3, .6] → V' = [.5, .7, .6, .9];
    with λ = γ = 1, A_t = R − V'_t = [.5, .3, .4, .1]: A_0 = r − loo. Row 1 (reward 0, 3 tokens, V = [.5, .1, 0],
    loo (1 + 1)/2 = 1) → V' = [1, .6, .5], A = [−1, −.6, −.5]. Row 2: reward 1, loo (1 + 0)/2 = .5, one token,
    V = [.9] → V' = [.5], A = [.5]. Inside a response δ_t is the critic's (the shift cancels), except at the end."""
    values = torch.tensor([[0.2, 0.4, 0.3, 0.6], [0.5, 0.1, 0.0, 0.0], [0.9, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    scores = torch.tensor([1.0, 0.0, 1.0])
    shifted = group_baseline_values(values, mask, scores, torch.tensor([0, 0, 0]))
    torch.testing.assert_close(shifted, torch.tensor([[0.5, 0.7, 0.6, 0.9], [1.0, 0.6, 0.5, 0.0], [0.5, 0, 0, 0]]))
    adv, _ = gae(terminal_rewards(scores, mask), shifted, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.3, 0.4, 0.1], [-1.0, -0.6, -0.5, 0.0], [0.5, 0, 0, 0]]))
    # A row outside every group (a replayed positive) keeps the critic's values.
    kept = group_baseline_values(values, mask, scores, torch.tensor([0, 0, -1]))
    torch.testing.assert_close(kept[2], values[2])
