"""learner.synthetic: the synthetic groups benchmarks and tests train on are deterministic per seed and obey
their own rules (token range, lengths, truncation mark, version)."""

from __future__ import annotations

import numpy as np

from learner.synthetic import synth_groups


def test_groups_follow_their_rules_and_repeat_per_seed() -> None:
    groups = synth_groups(5, 4, 20, seed=3, prompt_len=(2, 4), resp_len=(1, 6), version=7, max_new_tokens=6)
    assert [g.group_id for g in groups] == [f"g3-{i}" for i in range(5)]
    for g in groups:
        assert len(g.samples) == 4
        assert all(s.prompt_ids is g.samples[0].prompt_ids for s in g.samples)  # one prompt per group
        for s in g.samples:
            assert 2 <= len(s.prompt_ids) <= 4 and 1 <= len(s.output_ids) <= 6
            assert int(min(s.prompt_ids.min(), s.output_ids.min())) >= 3
            assert int(max(s.prompt_ids.max(), s.output_ids.max())) < 20
            assert s.response_length == len(s.output_ids) == len(s.output_logprobs)
            assert bool((s.output_logprobs < 0).all()) and s.reward in (0.0, 1.0) and s.weight_version == 7
            assert s.finish_reason == ("length" if len(s.output_ids) == 6 else "stop")
    again = synth_groups(5, 4, 20, seed=3, prompt_len=(2, 4), resp_len=(1, 6), version=7, max_new_tokens=6)
    assert all(np.array_equal(a.output_ids, b.output_ids) and a.reward == b.reward
               for g, h in zip(groups, again, strict=True) for a, b in zip(g.samples, h.samples, strict=True))
    other = synth_groups(5, 4, 20, seed=4)
    assert any(not np.array_equal(a.output_ids, b.output_ids) for a, b in zip(groups[0].samples, other[0].samples, strict=True))


def test_p_correct_sets_the_rewards_at_its_ends() -> None:
    assert {s.reward for g in synth_groups(3, 4, 20, seed=1, p_correct=1.0) for s in g.samples} == {1.0}
    assert {s.reward for g in synth_groups(3, 4, 20, seed=1, p_correct=0.0) for s in g.samples} == {0.0}
