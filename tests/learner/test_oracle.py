"""learner.oracle: the chain oracle's values on real token ids of the shipped chain base's tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common import protocol
from common.modeling import load_tokenizer
from common.tasks import Prompt, encode_prompt
from common.tasks.chain import oracle_value
from learner.batch import collate
from learner.oracle import ChainOracle

BASE = Path(__file__).resolve().parents[2] / "ops" / "bases" / "chain-tiny"
PROMPT = Prompt(prompt_id="p", text="Q:3+7x02\n", answer="7", split="train", index=0)
RIGHT = "01:3+7=0\n00:0+7=7\nA:7"  # result digits at characters 7 and 16
SLIP = "01:3+7=1\n00:1+7=8\nA:8"  # line 1's result one too high


def _sample(tok: object, text: str) -> protocol.Sample:
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]  # type: ignore[attr-defined]
    return protocol.Sample(prompt_ids=np.asarray(encode_prompt(tok, PROMPT), np.int32),
                           output_ids=np.asarray(ids, np.int32), output_logprobs=np.zeros(len(ids), np.float32),
                           reward=float(text == RIGHT), finish_reason="stop", weight_version=0, response_length=len(ids))


def _group(tok: object, texts: list[str]) -> protocol.SampleGroup:
    return protocol.SampleGroup(group_id="g", prompt_id="p", task="chain", actor_id=0,
                                samples=[_sample(tok, t) for t in texts], created_at=0.0)


def test_oracle_values_are_what_the_task_state_says() -> None:
    """One right response, one with a slip on line 1 (char-level tokens: token t is character t, then EOS).
    With p = 0.8: the right row is 0.8² up to and including the state before its first result digit (t ≤ 7),
    0.8 until the second (t ≤ 16), then 1 to its EOS. The slipped row matches up to t = 7, where its wrong
    digit is written: 0.64 for t ≤ 7 and 0 from t = 8 on. Padding stays 0."""
    tok = load_tokenizer(str(BASE))
    batch = collate([_group(tok, [RIGHT, SLIP])], pad_id=0)
    v = ChainOracle(tok, line_accuracy=0.8).values(batch)
    n = len(RIGHT) + 1
    assert batch.lengths.tolist() == [n, n]
    want_right = [0.64] * 8 + [0.8] * 9 + [1.0] * (n - 17)
    want_slip = [0.64] * 8 + [0.0] * (n - 8)
    torch.testing.assert_close(v[0, :n], torch.tensor(want_right))
    torch.testing.assert_close(v[1, :n], torch.tensor(want_slip))
    # The same as the task's own per-prefix formula, which the oracle walks in O(lines) instead.
    for row, text in enumerate([RIGHT, SLIP]):
        assert [oracle_value(RIGHT, text[:t], 0.8) for t in range(n)] == pytest.approx(v[row, :n].tolist())
    # Blind to mistakes (the step-count-only baseline): p^2 = 0.64 on every state of both rows.
    blind = ChainOracle(tok, line_accuracy=0.8, sees_mistakes=False).values(batch)
    torch.testing.assert_close(blind[:, :n], torch.full((2, n), 0.64))


def test_line_accuracy_is_estimated_from_the_batch() -> None:
    """Two right rows (2 lines each) and a slipped one (0 lines right, 1 mistake): p = 1 − 1 / (4 + 1) = 0.8,
    so the right rows' first state is worth 0.8²."""
    tok = load_tokenizer(str(BASE))
    batch = collate([_group(tok, [RIGHT, RIGHT, SLIP])], pad_id=0)
    oracle = ChainOracle(tok)
    v = oracle.values(batch)
    assert oracle.last_line_accuracy == pytest.approx(0.8)
    assert float(v[0, 0]) == pytest.approx(0.64)


def test_learner_step_reads_the_oracle_and_reports_both_explained_variances(tiny_model_dir: Path) -> None:
    """``algo.critic=oracle``: the step still trains the critic (its EV is reported) and adds the oracle's EV,
    which is the EV of ``ChainOracle.values`` against the Monte-Carlo returns (γ = λ_critic = 1: the reward
    on every token)."""
    from learner.losses import explained_variance
    from learner.train import Learner
    from tests.learner.train_fixtures import make_cfg

    cfg = make_cfg(tiny_model_dir, "task.name=chain", "algo.critic=oracle", "algo.oracle_line_accuracy=0.8",
                   "learner.batch_groups=2")
    learner = Learner(cfg, None)
    tok = learner.tokenizer
    groups = [_group(tok, [RIGHT, SLIP, RIGHT]), _group(tok, [SLIP, SLIP, RIGHT])]
    stats = learner.step(groups)
    batch = collate(groups, pad_id=learner.pad_id)
    returns = batch.rewards.unsqueeze(-1) * batch.mask
    ev, mean = explained_variance(ChainOracle(tok, 0.8).values(batch), returns, batch.mask)
    assert stats["oracle_line_accuracy"] == 0.8
    assert stats["oracle_explained_variance"] == pytest.approx(ev, abs=1e-6)
    assert stats["oracle_value_mean"] == pytest.approx(mean, abs=1e-6)
    assert ev > 0.5  # the slipped rows are 0 from their slip on: most of the return's variance is explained
    assert "value_explained_variance" in stats
