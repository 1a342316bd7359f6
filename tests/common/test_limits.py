"""common.limits: where the ingest bounds come from and where each one starts refusing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from common.config import load_config
from common.limits import LOGPROB_TOLERANCE, SampleLimits, limits_from_config, model_shape, sample_problem
from common.protocol import Sample


def _sample(p: int = 3, n: int = 4, top: int = 9, reward: float = 1.0, lp: float = -0.5) -> Sample:
    out = np.zeros(n, np.int32)
    out[-1] = top
    return Sample(prompt_ids=np.ones(p, np.int32), output_ids=out, output_logprobs=np.full(n, lp, np.float32),
                  reward=reward, finish_reason="stop", weight_version=0, response_length=n)


def test_bounds_come_from_the_model_and_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 500, "max_position_embeddings": 128}}))
    assert model_shape(tmp_path) == (500, 128)
    assert model_shape(tmp_path / "absent") == (0, 0)
    base = [f"model.path={tmp_path}", "actors.max_new_tokens=20", "task.reward_min=-1", "task.reward_max=2"]
    lim = limits_from_config(load_config(None, base))
    assert lim == SampleLimits(vocab_size=500, max_new_tokens=20, max_total_tokens=128, reward_min=-1.0, reward_max=2.0)
    lim = limits_from_config(load_config(None, [*base, "buffer.vocab_size=300", "engine.context_length=64"]))
    assert (lim.vocab_size, lim.max_total_tokens) == (300, 64)


def test_each_bound_refuses_just_past_its_edge() -> None:
    lim = SampleLimits(vocab_size=10, max_new_tokens=4, max_total_tokens=7, reward_min=0.0, reward_max=1.0)
    assert sample_problem(_sample(), lim) is None
    assert sample_problem(_sample(top=10), lim)[0] == "token_id"
    assert sample_problem(_sample(n=5), lim)[0] == "too_long"
    assert sample_problem(_sample(p=4), lim)[0] == "too_long"
    assert sample_problem(_sample(reward=1.0000001), lim)[0] == "reward"
    assert sample_problem(_sample(reward=math.inf), lim)[0] == "reward"
    assert sample_problem(_sample(lp=0.9 * LOGPROB_TOLERANCE), lim) is None  # the rounding of a sure token
    assert sample_problem(_sample(lp=2 * LOGPROB_TOLERANCE), lim)[0] == "logprob"
    assert sample_problem(_sample(lp=math.nan), lim)[0] == "logprob"
    assert sample_problem(_sample(p=0), lim)[0] == "empty_prompt"
    assert sample_problem(_sample(top=2**31 - 1), SampleLimits()) is None  # unknown vocabulary: not checked


def test_a_positive_is_rewarded_and_finished() -> None:
    import numpy as np

    from common.limits import is_positive
    from common.protocol import Sample

    def s(reward: float, finish: str) -> Sample:
        return Sample(prompt_ids=np.array([1], dtype=np.int32), output_ids=np.array([2], dtype=np.int32),
                      output_logprobs=np.array([-0.1], dtype=np.float32), reward=reward, finish_reason=finish,
                      weight_version=0, response_length=1)

    assert is_positive(s(1.0, "stop"), 1.0) and is_positive(s(0.7, "stop"), 0.5)
    assert not is_positive(s(1.0, "length"), 1.0)   # cut at the limit: never imitated
    assert not is_positive(s(0.4, "stop"), 0.5)
