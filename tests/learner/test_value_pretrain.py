"""Value pretraining fits the critic to λ=1 targets: explained variance on held-out groups rises above 0."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.config import load_config
from learner.data import ListSource
from learner.models import load_critic_module
from learner.synthetic import synth_groups
from learner.value_pretrain import pretrain_critic


def learnable_groups(n: int, seed: int) -> list:
    """Reward is decided by the prompt (its first token is even), so V(s_t) can predict it exactly."""
    groups = synth_groups(n, 4, 40, seed=seed, prompt_len=(2, 4), resp_len=(2, 6))
    for g in groups:
        r = float(int(g.samples[0].prompt_ids[0]) % 2 == 0)
        for s in g.samples:
            s.reward = r
    return groups


def vp_config(model_dir: Path, root: Path, steps: int, eval_groups: int, *extra: str):
    return load_config(None, [f"model.path={model_dir}", f"run.root={root}", "run.name=vp",
                              f"value_pretrain.steps={steps}", f"value_pretrain.patience={steps}",
                              "value_pretrain.batch_groups=8", f"value_pretrain.eval_groups={eval_groups}",
                              "value_pretrain.lr=3e-3", "learner.mini_batches=1", "learner.micro_batch_size=32",
                              "metrics.prometheus=false", *extra])


def test_value_pretraining_learns_and_saves(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = vp_config(tiny_model_dir, tmp_path, 16, 16)
    out = pretrain_critic(cfg, ListSource(learnable_groups(48, seed=1)))
    recs = [json.loads(x) for x in (tmp_path / "vp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1))
    assert recs[-1]["best_explained_variance"] > 0.2, recs[-1]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    # The saved critic reloads with its trained value head.
    critic = load_critic_module(cfg, out)
    assert (out / "value_head.safetensors").is_file()
    assert float(critic.value_head.weight.detach().abs().sum()) > 0  # init std is 0: training moved the head
    assert pretrain_critic(cfg, None) == out  # idempotent: reuses the saved critic


def test_the_best_critic_is_saved_not_the_last(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """The held-out explained variance is scripted to peak at step 2 of 5 (the critic really trains; only
    the score it gets is fixed): the critic handed to RL is the one of step 2, exactly, not the last."""
    from learner import value_pretrain
    from learner.models import full_state_dict

    scripted = [0.10, 0.30, 0.90, 0.50, 0.40, 0.20]  # before training, then after steps 1..5
    states: list[dict[str, torch.Tensor]] = []
    real_heldout_ev = value_pretrain.heldout_ev

    def scored(critic, batch, gamma, mbs):
        states.append(full_state_dict(critic, copy=True))  # the critic this score is given to
        _, vmean = real_heldout_ev(critic, batch, gamma, mbs)
        return scripted[len(states) - 1], vmean

    monkeypatch.setattr(value_pretrain, "heldout_ev", scored)
    cfg = vp_config(tiny_model_dir, tmp_path, 5, 16)
    out = pretrain_critic(cfg, ListSource(learnable_groups(48, seed=2)))
    info = json.loads((out / "value_pretrain.json").read_text())
    assert (info["steps"], info["best_step"], info["explained_variance"]) == (5, 2, 0.90)
    recs = [json.loads(x) for x in (tmp_path / "vp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["best_explained_variance"] for r in recs] == [0.30, 0.90, 0.90, 0.90, 0.90]
    saved = load_critic_module(cfg, out).state_dict()
    best, last = states[2], states[5]
    assert max(float((best[k] - last[k]).abs().max()) for k in best) > 1e-5  # training went on after step 2
    assert set(saved) == set(best)
    assert all(torch.equal(saved[k], best[k]) for k in best)


def test_zero3_pretraining_saves_a_whole_critic(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = vp_config(tiny_model_dir, tmp_path, 3, 8, "learner.zero_stage=3")
    out = pretrain_critic(cfg, ListSource(learnable_groups(24, seed=3)))
    critic = load_critic_module(cfg, out)  # full shapes: the ZeRO-3 partitions were gathered before saving
    ref = load_critic_module(cfg)
    assert {k: v.shape for k, v in critic.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert json.loads((out / "value_pretrain.json").read_text())["steps"] == 3


def test_the_pretraining_critic_is_freed_before_pretrain_critic_returns(tiny_model_dir: Path, tmp_path: Path,
                                                                        monkeypatch) -> None:
    # The RL learner builds its policy and critic right after: the pretraining critic (weights, gradients,
    # Adam states) must be gone by then, not left to a garbage collection that may never run in time.
    import weakref

    from learner import value_pretrain

    built: list[weakref.ref] = []
    real_build = value_pretrain.build_critic

    def recording(*args, **kwargs):
        engine = real_build(*args, **kwargs)
        built.append(weakref.ref(engine.module))
        return engine

    monkeypatch.setattr(value_pretrain, "build_critic", recording)
    cfg = vp_config(tiny_model_dir, tmp_path, 2, 8, "learner.zero_stage=3")
    pretrain_critic(cfg, ListSource(learnable_groups(24, seed=4)))
    assert len(built) == 1 and built[0]() is None


def test_pretraining_records_its_critic_token_passes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each value-pretraining record counts the update's forward and backward over its batch and the
    held-out pass's forward (learner.compute): forward = backward + the held-out batch's tokens, the same
    held-out batch every step."""
    cfg = vp_config(tiny_model_dir, tmp_path, 16, 16)
    pretrain_critic(cfg, ListSource(learnable_groups(48, seed=1)))
    recs = [json.loads(x) for x in (tmp_path / "vp" / "metrics.jsonl").read_text().splitlines()]
    held = {r["critic_forward_tokens"] - r["critic_backward_tokens"] for r in recs}
    assert len(held) == 1 and held.pop() > 0
    assert all(r["critic_backward_tokens"] > 0 for r in recs)


def test_pretraining_in_epochs_over_a_pool_stops_on_its_plateau(tiny_model_dir: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """value_pretrain.pool_groups: 16 groups drawn once (after the 8 held out) and trained on in epochs of two
    8-group batches; the held-out EV is scripted to rise for 3 steps, then plateau: with patience 4 the run stops
    after step 3 + 4 = 7 of at most 50, having asked the source for 24 groups only."""
    from learner import value_pretrain

    scripted = iter([0.0, 0.1, 0.2, 0.3] + [0.3] * 100)
    real_heldout_ev = value_pretrain.heldout_ev
    monkeypatch.setattr(value_pretrain, "heldout_ev",
                        lambda *a: (next(scripted), real_heldout_ev(*a)[1]))
    cfg = vp_config(tiny_model_dir, tmp_path, 50, 8, "value_pretrain.patience=4", "value_pretrain.pool_groups=16")
    source = ListSource(learnable_groups(24, seed=5))
    out = pretrain_critic(cfg, source)
    info = json.loads((out / "value_pretrain.json").read_text())
    assert (info["steps"], info["best_step"]) == (7, 3)


def test_rl_refuses_a_critic_that_never_explained_anything(tiny_model_dir: Path, tmp_path: Path,
                                                           monkeypatch) -> None:
    """Best held-out EV <= 0: with value_pretrain.allow_untrained_critic=false the pretraining (and a reuse of
    its saved critic) ends in an error naming the key; with true it goes on."""
    import pytest

    from learner import value_pretrain

    real_heldout_ev = value_pretrain.heldout_ev
    monkeypatch.setattr(value_pretrain, "heldout_ev", lambda *a: (-0.05, real_heldout_ev(*a)[1]))
    cfg = vp_config(tiny_model_dir, tmp_path, 2, 8, "value_pretrain.allow_untrained_critic=false")
    with pytest.raises(RuntimeError, match="value_pretrain.allow_untrained_critic=true"):
        pretrain_critic(cfg, ListSource(learnable_groups(24, seed=6)))
    saved = tmp_path / "vp" / "critic_pretrained"
    assert (saved / "value_head.safetensors").is_file()  # kept for a look
    with pytest.raises(RuntimeError, match="-0.0500 <= 0"):
        pretrain_critic(cfg, None)
    allowed = vp_config(tiny_model_dir, tmp_path, 2, 8, "value_pretrain.allow_untrained_critic=true")
    assert pretrain_critic(allowed, None) == saved
