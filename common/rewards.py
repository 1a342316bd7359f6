"""The return a sample is trained on, from its verifier reward: what the actors' verifier says, shaped as the
learner shapes it (DAPO's soft overlong punishment, ``algo.overlong_*``) and with the truncation policy
(``algo.truncated``) applied. ``learner.batch.collate_scored`` does the same on tensors.

The buffer's dynamic-sampling filter (``buffer.filter_uniform_groups``) judges a group by these returns, not
by the raw rewards: a group whose only right answer was cut at the length limit (``zero_reward``: trained as
0) or is masked out (``mask``) gives the actor no signal, though its raw rewards differ. Not a CLI.
"""

from __future__ import annotations

from common.config import Config
from common.protocol import SampleGroup


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO soft overlong punishment: 0 up to ``max_new_tokens − buffer``, then linear down to −penalty."""
    if buffer <= 0:
        return 0.0
    excess = max(0.0, float(length) - (max_new_tokens - buffer))
    return -min(excess / buffer, 1.0) * penalty


def trained_score(reward: float, length: int, truncated: bool, cfg: Config) -> float | None:
    """The RL return of one sample (None: ``algo.truncated=mask`` keeps it out of every loss)."""
    ac = cfg.algo
    if truncated and ac.truncated == "mask":
        return None
    shaped = overlong_penalty(length, ac.overlong_max_length or cfg.actors.max_new_tokens, ac.overlong_buffer,
                              ac.overlong_penalty)
    return shaped if truncated and ac.truncated == "zero_reward" else reward + shaped


def uniform_trained_reward(group: SampleGroup, cfg: Config) -> bool:
    """Whether every trained sample of ``group`` has the same return (or none is trained): no signal."""
    scores = {trained_score(float(s.reward), len(s.output_ids), s.finish_reason == "length", cfg)
              for s in group.samples}
    scores.discard(None)
    return len(scores) <= 1
