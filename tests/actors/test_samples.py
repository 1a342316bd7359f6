"""actors.samples: one engine output as the buffer's ``Sample``, stamped with the oldest weight version among
its tokens (the worker's loaded version when the engine reports none), spans kept only across versions."""

from __future__ import annotations

import math

import numpy as np

from actors.samples import engine_sample, has_behaviour_logprobs
from common.sglang_client import GenerateOutput


def _out(ids: list[int], logprobs: list[float] | None, *, finish: str = "stop", min_version: str | None = "3",
         spans: list[tuple[int, int]] | None = None) -> GenerateOutput:
    return GenerateOutput(ids, logprobs, finish, None, min_version, min_version, 2, len(ids), version_spans=spans)


def test_behaviour_logprobs_must_be_there_and_finite() -> None:
    assert has_behaviour_logprobs(_out([1, 2], [-0.1, -2.0]))
    assert not has_behaviour_logprobs(_out([1, 2], None))
    assert not has_behaviour_logprobs(_out([1, 2], [-0.1, math.nan]))
    assert not has_behaviour_logprobs(_out([1, 2], [-math.inf, -0.1]))


def test_a_sample_carries_the_output_its_reward_and_the_engines_version() -> None:
    s = engine_sample([5, 6, 7], _out([8, 9], [-0.5, -0.25], finish="length"), fallback_version=1, reward=1)
    assert s.prompt_ids.tolist() == [5, 6, 7] and s.prompt_ids.dtype == np.int32
    assert s.output_ids.tolist() == [8, 9] and s.output_logprobs.tolist() == [-0.5, -0.25]
    assert s.output_logprobs.dtype == np.float32 and s.reward == 1.0 and isinstance(s.reward, float)
    assert (s.finish_reason, s.weight_version, s.response_length, s.version_spans) == ("length", 3, 2, None)


def test_without_a_reported_version_the_workers_is_used_and_odd_finish_reasons_read_as_stop() -> None:
    s = engine_sample([1], _out([2], [-1.0], finish="weird", min_version="default"), fallback_version=4, reward=0.0)
    assert (s.weight_version, s.finish_reason) == (4, "stop")
    s = engine_sample([1], _out([2], [-1.0], min_version=None), fallback_version=6, reward=0.0)
    assert s.weight_version == 6


def test_token_spans_are_kept_only_when_the_tokens_came_from_several_versions() -> None:
    mixed = _out([1, 2, 3, 4, 5], [-1.0] * 5, min_version="2", spans=[(2, 3), (3, 2)])
    s = engine_sample([0], mixed, fallback_version=0, reward=0.0)
    assert s.weight_version == 2 and s.version_spans is not None
    assert s.version_spans.tolist() == [2, 3, 3, 2] and s.version_spans.dtype == np.int64  # (version, n) flat
    one = _out([1, 2], [-1.0] * 2, min_version="2", spans=[(2, 2)])
    assert engine_sample([0], one, fallback_version=0, reward=0.0).version_spans is None
    # Spans whose oldest version is not the stamp (the engine's report disagrees with itself): not trusted.
    odd = _out([1, 2], [-1.0] * 2, min_version="1", spans=[(2, 1), (3, 1)])
    assert engine_sample([0], odd, fallback_version=0, reward=0.0).version_spans is None
