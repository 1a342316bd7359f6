"""The learner drops (and counts) batch rows it cannot use instead of crashing on them: an empty prompt, a
token id past the vocabulary, a reward of 1e300, a logprob of 3e38 each used to end the run."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from common.config import load_config
from common.limits import SampleLimits
from common.protocol import SampleGroup
from learner.data import ListSource, drop_unusable
from learner.synthetic import synth_groups
from learner.train import Learner

VOCAB = 60


def _poisoned(vocab: int) -> dict[str, SampleGroup]:
    out: dict[str, SampleGroup] = {}
    for i, reason in enumerate(("empty_prompt", "token_id", "reward", "logprob")):
        g = synth_groups(1, 2, vocab, seed=100 + i)[0]
        g.group_id = f"bad-{reason}"
        s = g.samples[1]
        if reason == "empty_prompt":
            s.prompt_ids = np.zeros(0, np.int32)
        elif reason == "token_id":
            s.output_ids = s.output_ids.copy()
            s.output_ids[0] = 2**31 - 1
        elif reason == "reward":
            s.reward = 1e300
        else:
            s.output_logprobs = np.full(len(s.output_ids), 3e38, np.float32)
        out[reason] = g
    return out


def test_drop_unusable_keeps_good_rows_and_names_the_reason() -> None:
    lim = SampleLimits(vocab_size=VOCAB, max_new_tokens=12, max_total_tokens=64, reward_min=0.0, reward_max=1.0)
    good = synth_groups(3, 2, VOCAB, seed=1)
    bad = _poisoned(VOCAB)
    pos = [good[0].samples[0], bad["token_id"].samples[1]]
    kept, kept_pos, dropped = drop_unusable([good[0], *bad.values(), *good[1:]], pos, lim)
    assert [g.group_id for g in kept] == [g.group_id for g in good]
    assert kept_pos == [good[0].samples[0]]
    assert dropped == {"empty_prompt": 2, "token_id": 3, "reward": 2, "logprob": 2}


@pytest.mark.timeout(300)
def test_a_learner_step_survives_poisoned_groups_and_counts_them(tiny_model_dir: Path) -> None:
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", "learner.micro_batch_size=4", "learner.mini_batches=1", "learner.batch_groups=2",
        "metrics.prometheus=false", "actors.max_new_tokens=12",
    ])
    bad = list(_poisoned(VOCAB).values())
    good = synth_groups(4, 2, VOCAB, seed=7)
    # Each step's first fetch brings poison: dropped, counted, and the step asks for more until it has 2 groups.
    learner = Learner(cfg, ListSource([bad[0], bad[1], good[0], good[1], bad[2], bad[3], good[2], good[3]]))
    for _ in range(2):
        stats = learner.step()
        assert stats["samples"] == 4
    assert learner.version == 2
    for p in learner.policy.module.parameters():
        assert bool(p.detach().isfinite().all())
    m = learner.metrics.unusable_samples
    counted = {r: m.labels(reason=r)._value.get() for r in ("empty_prompt", "token_id", "reward", "logprob")}
    assert counted == {"empty_prompt": 2, "token_id": 2, "reward": 2, "logprob": 2}, counted
    assert not any(math.isnan(float(v)) for v in stats.values() if isinstance(v, float))
