"""common.rewards: the return a sample is trained on is the one the learner's collate gives it."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import load_config
from common.protocol import Sample, SampleGroup
from common.rewards import trained_score, uniform_trained_reward
from learner.batch import collate_scored


def _group(specs: list[tuple[float, int, str]]) -> SampleGroup:
    samples = [Sample(prompt_ids=np.ones(2, np.int32), output_ids=np.ones(n, np.int32),
                      output_logprobs=np.zeros(n, np.float32), reward=r, finish_reason=fin, weight_version=0,
                      response_length=n) for r, n, fin in specs]
    return SampleGroup(group_id="g", prompt_id="p", task="t", actor_id=0, samples=samples, created_at=0.0)


@pytest.mark.parametrize("truncated", ["keep", "mask", "zero_reward"])
@pytest.mark.parametrize("overlong", [[], ["algo.overlong_buffer=4", "algo.overlong_penalty=0.5"]])
def test_trained_score_is_what_the_learner_trains_on(truncated: str, overlong: list[str]) -> None:
    cfg = load_config(None, ["actors.max_new_tokens=10", f"algo.truncated={truncated}", *overlong])
    group = _group([(1.0, 3, "stop"), (1.0, 8, "stop"), (1.0, 10, "length"), (0.0, 10, "length"), (0.0, 9, "stop")])
    batch = collate_scored([group], 0, cfg)
    for i, s in enumerate(group.samples):
        got = trained_score(s.reward, len(s.output_ids), s.finish_reason == "length", cfg)
        if bool(batch.excluded[i]):
            assert got is None
        else:
            assert got == pytest.approx(float(batch.scores[i]))


def test_uniform_is_judged_on_trained_returns() -> None:
    """Rewards 1, 0 with the 1 cut at the limit: uniform under zero_reward (0, 0) and mask (only the 0 is
    trained), not under keep (1, 0)."""
    group = _group([(1.0, 10, "length"), (0.0, 4, "stop")])
    for policy, uniform in (("zero_reward", True), ("mask", True), ("keep", False)):
        cfg = load_config(None, ["actors.max_new_tokens=10", f"algo.truncated={policy}"])
        assert uniform_trained_reward(group, cfg) is uniform, policy
