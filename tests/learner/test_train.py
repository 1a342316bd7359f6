"""One DeepSpeed learner step against a hand-written plain-torch VAPO update; edge cases of the step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from learner.batch import collate
from learner.models import load_critic_module, load_policy_module
from learner.schedule import minibatch_rows
from learner.synthetic import synth_groups
from learner.train import Learner
from tests.learner.synth import reference_gae
from tests.learner.train_fixtures import VOCAB, make_cfg, max_diff


def lambda_gae_loop(b, vals: torch.Tensor, alpha: float) -> torch.Tensor:
    """GAE with per-sample λ = 1 - 1/(α l), γ = 1, terminal reward, by the python-loop reference: [B, T]."""
    lam = torch.tensor([min(1.0, max(0.0, 1.0 - 1.0 / (alpha * max(int(n), 1)))) for n in b.lengths])
    rewards = torch.zeros(b.mask.shape)
    for i, n in enumerate(b.lengths.tolist()):
        if n > 0:
            rewards[i, n - 1] = float(b.scores[i])
    adv, _ = reference_gae(rewards, vals, b.mask, 1.0, lam)
    return adv


def reference_update(cfg, policy_state, critic_state, groups, pad_id: int, coupled: bool = False,
                     pre_update: bool = False):
    """The VAPO step written out in plain torch, one forward per mini-batch, python-loop GAE.
    ``coupled``: the critic's targets are the actor's λ-returns A^λ + V (the no-decoupled-GAE ablation);
    ``pre_update``: the actor's advantages use the critic's values from before its update (verl's order).
    Returns (policy state, critic state, {actor_grad_norm, critic_grad_norm}: the mean over mini-batches of
    the gradient norm before clipping, which sees a lost or doubled normaliser that AdamW's update hides)."""
    policy = load_policy_module(cfg.model.path)
    policy.load_state_dict(policy_state)
    critic = load_critic_module(cfg)
    critic.load_state_dict(critic_state)
    lc, ac = cfg.learner, cfg.algo
    b = collate(groups, pad_id, max_new_tokens=cfg.actors.max_new_tokens)
    B, T = b.mask.shape
    rows_b = torch.arange(B).unsqueeze(-1)
    mbs = minibatch_rows(B, lc.mini_batches, cfg.run.seed, 0)

    def values(rows):
        v = critic(b.input_ids[rows], b.attention_mask[rows])  # [n, S]
        return v[torch.arange(len(rows)).unsqueeze(-1), b.positions[rows]]  # V(s_t) at prompt_len + t - 1

    # Critic first: Monte-Carlo targets (λ_critic = 1, γ = 1): the final reward at every real token.
    returns = b.scores.unsqueeze(-1) * b.mask
    with torch.no_grad():
        v_old = values(torch.arange(B)) * b.mask
    if coupled:
        returns = (lambda_gae_loop(b, v_old, ac.alpha) + v_old) * b.mask
    opt_c = torch.optim.AdamW(critic.parameters(), lr=lc.critic_lr, weight_decay=lc.weight_decay)
    norms = {"actor_grad_norm": 0.0, "critic_grad_norm": 0.0}
    for rows in mbs:
        v = values(rows)
        m = b.mask[rows]
        loss = 0.5 * (((v - returns[rows]) ** 2) * m).sum() / m.sum()
        opt_c.zero_grad()
        loss.backward()
        norms["critic_grad_norm"] += float(torch.nn.utils.clip_grad_norm_(critic.parameters(), lc.grad_clip)) / len(mbs)
        opt_c.step()
    # Advantages from the UPDATED critic (or the one before its update), per-sample λ = 1 - 1/(α l).
    with torch.no_grad():
        vals = v_old if pre_update else values(torch.arange(B)) * b.mask
    adv = lambda_gae_loop(b, vals, ac.alpha)
    m = b.mask
    mean = (adv * m).sum() / m.sum()
    var = (((adv - mean) ** 2) * m).sum() / (m.sum() - 1)
    adv = (adv - mean) / torch.sqrt(var + 1e-8) * m
    # Actor: clip-higher token-level PPO against behaviour logprobs + μ·NLL on reward-1 samples.
    opt_p = torch.optim.AdamW(policy.parameters(), lr=lc.actor_lr, weight_decay=lc.weight_decay)
    for rows in mbs:
        logits = policy(input_ids=b.input_ids[rows], attention_mask=b.attention_mask[rows]).logits
        logits = logits[torch.arange(len(rows)).unsqueeze(-1), b.positions[rows]]
        logp = torch.log_softmax(logits, -1).gather(-1, b.response_ids[rows].unsqueeze(-1)).squeeze(-1)
        mm = m[rows]
        ratio = torch.exp((logp - b.behaviour_logprobs[rows]) * mm)
        A = adv[rows]
        obj = torch.minimum(ratio * A, ratio.clamp(1 - ac.clip_low, 1 + ac.clip_high) * A)
        pg = -(obj * mm).sum() / mm.sum()
        pos = mm * (b.rewards[rows] >= 1).float().unsqueeze(-1)
        nll = -(logp * pos).sum() / pos.sum().clamp(min=1)
        loss = pg + cfg.nll.coef * nll
        opt_p.zero_grad()
        loss.backward()
        norms["actor_grad_norm"] += float(torch.nn.utils.clip_grad_norm_(policy.parameters(), lc.grad_clip)) / len(mbs)
        opt_p.step()
    del rows_b
    return policy.state_dict(), critic.state_dict(), norms


@pytest.mark.parametrize("decoupled, actor_values", [(True, "post_update"), (False, "post_update"),
                                                      (True, "pre_update")])
def test_step_matches_plain_torch_reference(tiny_model_dir: Path, decoupled: bool, actor_values: str) -> None:
    cfg = make_cfg(tiny_model_dir, f"algo.decoupled_gae={str(decoupled).lower()}", f"algo.actor_values={actor_values}")
    learner = Learner(cfg, None)
    p0 = {k: v.clone() for k, v in learner.policy.module.state_dict().items()}
    c0 = {k: v.clone() for k, v in learner.critic.module.state_dict().items()}
    # The critic starts as the base policy's backbone.
    assert torch.equal(c0["backbone.embed_tokens.weight"], p0["model.embed_tokens.weight"])
    groups = synth_groups(4, 4, VOCAB, seed=3, max_new_tokens=cfg.actors.max_new_tokens)
    stats = learner.step(groups)
    ref_p, ref_c, ref_norms = reference_update(cfg, p0, c0, groups, learner.pad_id, coupled=not decoupled,
                                               pre_update=actor_values == "pre_update")
    got_p = learner.policy.module.state_dict()
    got_c = learner.critic.module.state_dict()
    assert max_diff(p0, got_p) > 1e-4 and max_diff(c0, got_c) > 1e-4  # the step changed both models
    assert max_diff(ref_c, got_c) < 2e-5
    assert max_diff(ref_p, got_p) < 2e-5
    # Gradients before the optimizer step: AdamW hides a uniform scale of the gradient, the norm does not.
    for k, v in ref_norms.items():
        assert stats[k] == pytest.approx(v, rel=1e-4), (k, stats[k], v)
    assert stats["weight_version"] == 1 and learner.version == 1
    phases = {"collate", "values", "critic_update", "advantages", "actor_update"}
    assert set(stats["phase_seconds"]) >= phases | ({"fresh_values"} if actor_values == "post_update" else set())
    assert ("fresh_values" in stats["phase_seconds"]) == (actor_values == "post_update")


@pytest.mark.parametrize("reward", [0.0, 1.0])
def test_uniform_rewards_stay_finite(tiny_model_dir: Path, reward: float) -> None:
    cfg = make_cfg(tiny_model_dir)
    learner = Learner(cfg, None)
    groups = synth_groups(4, 4, VOCAB, seed=1)
    for g in groups:
        for s in g.samples:
            s.reward = reward
    stats = learner.step(groups)
    for k in ("critic_loss", "policy_loss", "nll_loss", "entropy", "approx_kl", "actor_grad_norm"):
        assert math.isfinite(stats[k]), (k, stats[k])
    for v in learner.policy.module.state_dict().values():
        assert torch.isfinite(v).all()
    if reward == 0.0:
        assert stats["nll_loss"] == 0.0 and stats["positives_fraction"] == 0.0
    else:
        assert stats["nll_loss"] > 0.0


def test_grpo_seq_mean_decoupled_configs_run(tiny_model_dir: Path) -> None:
    cfg = make_cfg(tiny_model_dir, "algo.advantage=grpo", "algo.loss_agg=seq_mean", "learner.off_policy=decoupled",
                   "algo.whiten_advantages=false")
    learner = Learner(cfg, None)
    assert learner.critic is None
    stats = learner.step(synth_groups(4, 4, VOCAB, seed=2))
    assert "critic_loss" not in stats and "proximal" in stats["phase_seconds"]
    assert math.isfinite(stats["policy_loss"]) and stats["weight_version"] == 1


def test_decoupled_equals_behaviour_when_on_policy(tiny_model_dir: Path) -> None:
    """With behaviour logprobs equal to the current policy's, AReaL's decoupled objective (proximal ratio,
    behaviour weight 1) must give exactly the behaviour-ratio update."""
    import numpy as np

    from learner.forwards import compute_logprobs

    groups = synth_groups(4, 4, VOCAB, seed=5)
    probe = Learner(make_cfg(tiny_model_dir), None)
    b = collate(groups, probe.pad_id)
    lp = compute_logprobs(probe.policy, b, torch.arange(b.size), 64)
    for i, s in enumerate(s for g in groups for s in g.samples):
        s.output_logprobs = lp[i, : s.response_length].numpy().astype(np.float32)
    a = Learner(make_cfg(tiny_model_dir), None)
    a.step(groups)
    d = Learner(make_cfg(tiny_model_dir, "learner.off_policy=decoupled"), None)
    d.step(groups)
    assert max_diff(a.policy.module.state_dict(), d.policy.module.state_dict()) < 1e-6
    assert abs(a.last["approx_kl"] - d.last["approx_kl"]) < 1e-6


def test_replayed_positives_feed_only_the_nll(tiny_model_dir: Path) -> None:
    from learner.data import ListSource

    groups = synth_groups(4, 4, VOCAB, seed=12)
    stored = [s for g in synth_groups(3, 2, VOCAB, seed=13) for s in g.samples]
    for s in stored:
        s.reward = 1.0
    # finished rewarded rows only: a truncated one is never replayed against (the buffer does not store those)
    n_pos = sum(s.reward >= 1.0 and s.finish_reason != "length" for g in groups for s in g.samples)
    cfg = make_cfg(tiny_model_dir, "nll.replay_fraction=0.5")
    learner = Learner(cfg, ListSource(groups, positives=stored))
    stats = learner.step()  # fetch path: groups + round(0.5 * n_pos) stored positives
    assert stats["replay_positives"] == round(0.5 * n_pos) > 0
    assert stats["samples"] == 16  # replayed rows are not counted as trained samples
    assert math.isfinite(stats["nll_loss"]) and stats["nll_loss"] > 0
    # With μ = 0 and one mini-batch, replayed rows must not change the PPO/critic update at all.
    plain = Learner(make_cfg(tiny_model_dir, "nll.coef=0", "learner.mini_batches=1"), None)
    plain.step(groups)
    replay = Learner(make_cfg(tiny_model_dir, "nll.coef=0", "learner.mini_batches=1"), None)
    replay.step(groups, stored[:3])
    # Replayed rows change how micro-batches are cut (summation order: ~1e-6 after Adam, which divides
    # near-zero gradient entries by their own size); a leak into the PPO or value loss moves ~lr = 1e-3.
    assert max_diff(plain.policy.module.state_dict(), replay.policy.module.state_dict()) < 2e-5
    assert max_diff(plain.critic.module.state_dict(), replay.critic.module.state_dict()) < 2e-5


def _with_truncated_positives(seed: int):
    """4 groups of 4 where every reward-1 row is a truncated one (12 tokens, the limit) and vice versa."""
    groups = synth_groups(4, 4, VOCAB, seed=seed)
    for i, s in enumerate(s for g in groups for s in g.samples):
        s.reward = float(i % 2)
        s.finish_reason = "length" if s.reward == 1.0 else "stop"
    return groups


@pytest.mark.parametrize("policy", ["keep", "mask", "zero_reward"])
def test_truncated_responses_never_feed_the_nll_and_follow_the_policy(tiny_model_dir: Path, policy: str) -> None:
    """Reward-1 rows cut at the length limit are never NLL positives (the NLL is exactly 0 here, where
    they are the only reward-1 rows); ``algo.truncated`` decides their RL return (keep: the verifier's,
    zero_reward: 0 plus any overlong shaping) or removes them from the policy and value losses (mask)."""
    groups = _with_truncated_positives(seed=6)
    learner = Learner(make_cfg(tiny_model_dir, f"algo.truncated={policy}"), None)
    b = learner.make_batch(groups=groups, extra=[])
    cut = b.truncated
    assert bool(cut.any()) and bool((b.rewards[cut] == 1).all())
    assert torch.equal(b.scores[cut], torch.full((int(cut.sum()),), 0.0 if policy == "zero_reward" else 1.0))
    assert bool((b.ppo_mask[cut].sum(-1) == 0).all()) == (policy == "mask")
    assert bool((b.ppo_mask[~cut].sum(-1) == b.lengths[~cut]).all())
    stats = learner.step(groups)
    assert stats["nll_loss"] == 0.0 and math.isfinite(stats["policy_loss"])


def test_soft_overlong_punishment_uses_its_own_max_length(tiny_model_dir: Path) -> None:
    """DAPO: R_length = 0 up to L_max − L_cache, then ((L_max − L_cache) − l) / L_cache, −1 from L_max on;
    here L_max = 10 (algo.overlong_max_length, below actors.max_new_tokens) and L_cache = 4."""
    groups = synth_groups(4, 4, VOCAB, seed=7)
    learner = Learner(make_cfg(tiny_model_dir, "algo.overlong_buffer=4", "algo.overlong_max_length=10",
                               "algo.truncated=keep"), None)
    b = learner.make_batch(groups=groups, extra=[])
    expected = torch.tensor([-min(max(int(n) - 6, 0) / 4, 1.0) for n in b.lengths])
    assert bool((expected < 0).any()) and bool((expected == -1).any())
    torch.testing.assert_close(b.scores - b.rewards, expected)


def _on_policy(groups, model: Path):
    """``groups`` with behaviour logprobs equal to the untrained policy's own (fp32, the same weights)."""
    import numpy as np

    from learner.forwards import compute_logprobs

    probe = Learner(make_cfg(model), None)
    b = collate(groups, probe.pad_id)
    lp = compute_logprobs(probe.policy, b, torch.arange(b.size), 64)
    for i, s in enumerate(s for g in groups for s in g.samples):
        s.output_logprobs = lp[i, : s.response_length].numpy().astype(np.float32)
    return groups


def test_mismatch_is_measured_at_version_equality(tiny_model_dir: Path) -> None:
    """The learner's own log-probs against the behaviour ones on rows generated by the weights being
    updated: 0 KL and ratio 1 when they are the same; > 0 for the synthetic (unrelated) logprobs; no
    measurement at all (0 tokens) when every row comes from another version."""
    same = Learner(make_cfg(tiny_model_dir), None).step(_on_policy(synth_groups(4, 4, VOCAB, seed=8), tiny_model_dir))
    assert same["mismatch_tokens"] > 0 and abs(same["mismatch_kl"]) < 1e-6
    assert same["mismatch_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    learner = Learner(make_cfg(tiny_model_dir), None)
    off = learner.step(synth_groups(4, 4, VOCAB, seed=8))
    assert off["mismatch_kl"] > 0.1 and off["mismatch_tokens"] == same["mismatch_tokens"]
    # The next step's rows are a version old: no measurement; the gauges keep the last one, tokens say 0.
    stale = learner.step(synth_groups(4, 4, VOCAB, seed=10))
    reg = learner.metrics.registry
    assert stale["mismatch_tokens"] == 0 and reg.get_sample_value("vapo_learner_mismatch_tokens") == 0
    assert reg.get_sample_value("vapo_learner_mismatch_kl") == pytest.approx(off["mismatch_kl"])
    assert reg.get_sample_value("vapo_learner_mismatch_ratio_max") == pytest.approx(off["mismatch_ratio_max"])
    other = Learner(make_cfg(tiny_model_dir), None).step(synth_groups(4, 4, VOCAB, seed=8, version=3))
    assert other["mismatch_tokens"] == 0 and other["mismatch_kl"] == 0.0


@pytest.mark.parametrize("off_policy", ["decoupled", "rollout_correction"])
def test_behaviour_weight_with_an_active_cap(tiny_model_dir: Path, off_policy: str) -> None:
    """Tokens whose behaviour logprob is far below the learner's (weight π_prox/π_behav ≈ e^6 > cap):
    AReaL's decoupled objective masks them (weight 0), verl's rollout correction truncates them (weight =
    cap); every other token keeps its exact weight."""
    groups = synth_groups(4, 4, VOCAB, seed=9)
    for s in (s for g in groups[:2] for s in g.samples):
        s.output_logprobs[0] = -10.0
    learner = Learner(make_cfg(tiny_model_dir, f"learner.off_policy={off_policy}"), None)
    d = learner.step_data(learner.make_batch(groups=groups, extra=[]))
    prox, w = learner.proximal(d)
    raw = torch.exp(prox - d.batch.behaviour_logprobs) * d.batch.mask
    cap = learner.cfg.learner.decoupled_weight_cap if off_policy == "decoupled" else learner.cfg.learner.rollout_correction_cap
    over = raw > cap
    assert int(over.sum()) >= 8
    assert torch.equal(w[over], torch.full((int(over.sum()),), 0.0 if off_policy == "decoupled" else cap))
    torch.testing.assert_close(w[~over], raw[~over])
    assert math.isfinite(learner.step(groups)["policy_loss"])


def test_group_loo_baseline_sets_each_responses_first_advantage(tiny_model_dir: Path, monkeypatch) -> None:
    """algo.baseline=group_loo with λ = 1 and no whitening: the first token's advantage is the response's reward
    minus its group's leave-one-out mean reward, whatever the critic says; algo.baseline=critic: R − V(s_0)."""
    import learner.train as train

    seen: list[torch.Tensor] = []
    real = train.actor_update

    def recording(policy, batch, **kw):
        seen.append(kw["advantages"].clone())
        return real(policy, batch, **kw)

    monkeypatch.setattr(train, "actor_update", recording)
    groups = synth_groups(2, 4, VOCAB, seed=8)
    common = ("algo.length_adaptive=false", "algo.lambda_actor=1.0", "algo.whiten_advantages=false")
    for baseline in ("group_loo", "critic"):
        learner = Learner(make_cfg(tiny_model_dir, f"algo.baseline={baseline}", *common), None)
        learner.step(groups)
    b = collate(groups, pad_id=0)
    r = b.scores.reshape(2, 4)
    loo = ((r.sum(1, keepdim=True) - r) / 3).reshape(-1)
    torch.testing.assert_close(seen[0][:, 0], b.scores - loo)
    assert float((seen[1][:, 0] - (b.scores - loo)).abs().max()) > 1e-3  # the critic's own baseline differs
