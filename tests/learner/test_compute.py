"""learner.compute: a step's token passes per model, by hand and from a real learner step."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.batch import collate
from learner.compute import batch_tokens, step_token_passes
from learner.synthetic import synth_groups
from learner.train import Learner
from tests.learner.train_fixtures import VOCAB, make_cfg


def test_token_passes_by_hand() -> None:
    """A batch of N tokens, 2 epochs: the value pass, two critic epochs and the fresh values make 4 critic
    forwards and 2 backwards; the proximal pass and two actor epochs 3 policy forwards and 2 backwards."""
    b = collate(synth_groups(2, 3, VOCAB, seed=1), 0)
    n = batch_tokens(b)
    assert n == int((b.prompt_lengths + b.lengths).sum()) > 0
    phases = dict.fromkeys(("values", "critic_update", "fresh_values", "advantages", "proximal", "actor_update"), 0.1)
    out = step_token_passes(b, phases, epochs=2, value_pass=True)
    assert out == {"response_tokens": int(b.lengths.sum()), "policy_forward_tokens": 3 * n,
                   "policy_backward_tokens": 2 * n, "critic_forward_tokens": 4 * n, "critic_backward_tokens": 2 * n}
    # GRPO: no critic phase ran, so no critic pass.
    grpo = step_token_passes(b, {"advantages": 0.1, "actor_update": 0.1}, epochs=1, value_pass=False)
    assert grpo["critic_forward_tokens"] == grpo["critic_backward_tokens"] == 0
    assert grpo["policy_forward_tokens"] == grpo["policy_backward_tokens"] == n


@pytest.mark.parametrize("actor_values, critic_fwd", [("post_update", 2), ("pre_update", 2)])
def test_a_learner_step_records_its_token_passes(tiny_model_dir: Path, actor_values: str, critic_fwd: int) -> None:
    """post_update with Monte-Carlo targets: no value pass, the update, the fresh values (2 forwards);
    pre_update: the value pass and the update (2 forwards). One backward each, one policy pass."""
    groups = synth_groups(4, 3, VOCAB, seed=5)
    stats = Learner(make_cfg(tiny_model_dir, f"algo.actor_values={actor_values}"), None).step(groups)
    n = batch_tokens(collate(groups, 0))
    assert stats["critic_forward_tokens"] == critic_fwd * n and stats["critic_backward_tokens"] == n
    assert stats["policy_forward_tokens"] == stats["policy_backward_tokens"] == n
    assert stats["response_tokens"] == sum(s.response_length for g in groups for s in g.samples)
