"""Collation: alignment of logits/values with response tokens, padding, truncation, replay rows."""

from __future__ import annotations

import numpy as np
import torch

from common.protocol import Sample
from learner.advantages import terminal_rewards
from learner.batch import collate, collate_samples, concat, gather_positions
from learner.synthetic import synth_groups


def _sample(prompt: list[int], out: list[int], reward: float, reason: str = "stop") -> Sample:
    return Sample(prompt_ids=np.array(prompt, np.int32), output_ids=np.array(out, np.int32),
                  output_logprobs=-np.arange(1, len(out) + 1, dtype=np.float32) / 10, reward=reward,
                  finish_reason=reason, weight_version=3, response_length=len(out))


def test_positions_point_at_the_token_before_each_response_token() -> None:
    b = collate_samples([_sample([5, 6, 7], [8, 9], 1.0), _sample([5], [10, 11, 12, 13], 1.0, "length")], pad_id=0)
    assert b.positions[0, :2].tolist() == [2, 3] and b.positions[1].tolist() == [0, 1, 2, 3]
    # The token right after each scoring position is the response token it scores.
    nxt = b.input_ids.gather(1, (b.positions + 1).clamp(max=b.input_ids.shape[1] - 1))
    assert torch.equal(nxt * b.mask.long(), b.response_ids * b.mask.long())
    assert b.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert b.attention_mask.sum(-1).tolist() == [5, 5]
    assert b.truncated.tolist() == [False, True] and b.lengths.tolist() == [2, 4]
    # Reward only on the last real token; padding carries nothing. The truncated row is terminal too:
    # its verifier reward sits on its last token (nothing is bootstrapped past the length limit).
    r = terminal_rewards(b.scores, b.mask)
    assert r.tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
    assert torch.allclose(b.behaviour_logprobs[0], torch.tensor([-0.1, -0.2, 0.0, 0.0]))
    x = torch.arange(10).view(2, 5)
    assert gather_positions(x, b.positions)[0, :2].tolist() == [2, 3]


def test_select_trims_and_concat_pads() -> None:
    groups = synth_groups(3, 2, 40, seed=0)
    b = collate(groups, pad_id=0)
    assert b.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    sub = b.select([0, 1])
    assert sub.input_ids.shape[1] == int((sub.prompt_lengths + sub.lengths).max())
    assert sub.mask.shape[1] == int(sub.lengths.max())
    rep = collate_samples([_sample([4], [9] * 20, 1.0)], pad_id=0, is_replay=True)
    both = concat(b, rep, pad_id=0)
    assert both.size == 7 and both.is_replay.tolist() == [False] * 6 + [True]
    assert both.ppo_mask[-1].sum() == 0 and both.mask[-1].sum() == 20


def test_overlong_penalty_changes_scores_not_rewards() -> None:
    b = collate_samples([_sample([4], [9] * 10, 1.0), _sample([4], [9] * 4, 1.0)], pad_id=0,
                        max_new_tokens=10, overlong_buffer=4, overlong_penalty_value=1.0)
    assert b.rewards.tolist() == [1.0, 1.0]
    assert b.scores.tolist() == [0.0, 1.0]


def test_scored_collate_applies_the_runs_overlong_shaping_and_truncation_policy() -> None:
    # What the RL step and value pretraining both train on: pretraining the critic on the raw verifier
    # reward of a truncated row would fit it to returns RL never asks for.
    from common.config import load_config
    from common.protocol import SampleGroup
    from learner.batch import collate_scored

    group = SampleGroup(group_id="g", prompt_id="p", task="t", actor_id=0, created_at=0.0, samples=[
        _sample([5], [6] * 10, 1.0, "length"), _sample([5], [6] * 7, 1.0), _sample([5], [6] * 3, 0.0)])
    cfg = load_config(None, ["actors.max_new_tokens=10", "algo.truncated=zero_reward", "algo.overlong_buffer=4",
                             "algo.overlong_penalty=1.0"])
    b = collate_scored([group], 0, cfg)
    # DAPO: length 10 of L_max 10 with a 4-token buffer -> -1; 7 -> (10 - 4 - 7) / 4 = -0.25; 3 -> 0.
    # zero_reward takes the verifier's 1.0 out of the truncated row only.
    assert b.scores.tolist() == [-1.0, 0.75, 0.0]
    keep = load_config(None, ["actors.max_new_tokens=10", "algo.truncated=keep", "algo.overlong_buffer=0"])
    assert collate_scored([group], 0, keep).scores.tolist() == [1.0, 1.0, 0.0]
