"""One engine output as the buffer's ``Sample``: the response with the reward it was scored, stamped with the oldest
weight version among its tokens (``GenerateOutput.min_weight_version``; what the worker loaded when the
engine reports none), its per-version token spans kept when its tokens came from several versions.

Not a CLI; used by ``actors.worker``, which first checks that the output carries finite behaviour logprobs
(``has_behaviour_logprobs``).
"""

from __future__ import annotations

import math

import numpy as np

from common.protocol import FINISH_REASONS, Sample
from common.sglang_client import GenerateOutput


def has_behaviour_logprobs(output: GenerateOutput) -> bool:
    """The output carries a logprob for every token, all finite (the learner's importance ratios need them)."""
    return output.output_logprobs is not None and all(math.isfinite(x) for x in output.output_logprobs)


def engine_sample(prompt_ids: list[int], output: GenerateOutput, fallback_version: int, reward: float) -> Sample:
    """``output`` (with behaviour logprobs) as a version-stamped ``Sample`` with the ``reward`` its decoded
    response was scored (``Task.verify_batch``, by ``actors.groups``)."""
    assert output.output_logprobs is not None
    version = output.weight_version_int
    if version is None:  # SGLang started without --weight-version: what this worker loaded
        version = fallback_version
    spans = None
    if output.version_spans and len(output.version_spans) > 1 and min(v for v, _ in output.version_spans) == version:
        spans = np.asarray([x for pair in output.version_spans for x in pair], dtype=np.int64)  # tokens of several versions
    return Sample(
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        output_ids=np.asarray(output.output_ids, dtype=np.int32),
        output_logprobs=np.asarray(output.output_logprobs, dtype=np.float32),
        reward=float(reward),
        finish_reason=output.finish_reason if output.finish_reason in FINISH_REASONS else "stop",
        weight_version=int(version),
        response_length=len(output.output_ids),
        version_spans=spans,
    )


__all__ = ["engine_sample", "has_behaviour_logprobs"]
