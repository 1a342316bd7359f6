"""What a usable sample is, from the run's config and model: the buffer refuses a group at ingest that breaks
these bounds, and the learner drops a row that does (a buffer filled by an older version, a replayed positive).

The protocol (``common.protocol``) checks types and shapes only: any non-negative int32 token id, any finite
float. A protocol-valid sample can still crash or poison the learner: an empty prompt (no position scores
the first response token), a token id past the embedding table (an index error), a reward of 1e300 or a
logprob of 3e38 (inf/NaN losses, NaN weights). So::

    limits = limits_from_config(cfg)          # vocabulary and context read from model.path/config.json
    bad = group_problem(group, limits)        # None, or (reason, message); reason is a metric label

Reasons: ``empty_prompt``, ``empty_output``, ``token_id`` (>= vocabulary size), ``too_long`` (response
over ``actors.max_new_tokens``, or prompt + response over the context), ``reward`` (outside
``[task.reward_min, task.reward_max]``), ``logprob`` (above 0, the engine's rounding allowed).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config import Config
from common.protocol import Sample, SampleGroup

log = logging.getLogger("vapo.limits")

# A log-probability is <= 0; engines computing it in low precision may round a certain token's to a hair above.
LOGPROB_TOLERANCE = 1e-3
REASONS = ("empty_prompt", "empty_output", "token_id", "too_long", "reward", "logprob")


@dataclass(frozen=True)
class SampleLimits:
    """Bounds of a usable sample; 0 for ``vocab_size`` / ``max_total_tokens`` means unknown (not checked)."""

    vocab_size: int = 0
    max_new_tokens: int = 0
    max_total_tokens: int = 0
    reward_min: float = -math.inf
    reward_max: float = math.inf


def model_shape(model_path: str | Path) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) from an HF model directory's config.json; 0 for what it lacks."""
    p = Path(model_path) / "config.json"
    try:
        conf: Any = json.loads(p.read_text())
    except (OSError, ValueError):
        return 0, 0
    if not isinstance(conf, dict):
        return 0, 0
    conf = conf.get("text_config", conf) if isinstance(conf.get("text_config"), dict) else conf

    def num(key: str) -> int:
        v = conf.get(key, 0)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    return num("vocab_size"), num("max_position_embeddings")


def limits_from_config(cfg: Config) -> SampleLimits:
    """The run's bounds: vocabulary and context from ``model.path`` (``buffer.vocab_size`` overrides the
    vocabulary, ``engine.context_length`` the context), response length and reward range from the config."""
    vocab, positions = model_shape(cfg.model.path)
    if cfg.buffer.vocab_size > 0:
        vocab = cfg.buffer.vocab_size
    context = cfg.engine.context_length if cfg.engine.context_length > 0 else positions
    if vocab == 0:
        log.warning("no vocabulary size (model.path %s has no config.json, buffer.vocab_size=0): token ids are "
                    "not checked against it", cfg.model.path)
    return SampleLimits(vocab_size=vocab, max_new_tokens=cfg.actors.max_new_tokens, max_total_tokens=context,
                        reward_min=cfg.task.reward_min, reward_max=cfg.task.reward_max)


def sample_problem(s: Sample, lim: SampleLimits) -> tuple[str, str] | None:
    """Why ``s`` is unusable, as (reason, message); None when it is fine."""
    p, n = int(s.prompt_ids.shape[0]), int(s.output_ids.shape[0])
    if p == 0:
        return "empty_prompt", "a sample has no prompt tokens"
    if n == 0:
        return "empty_output", "a sample has no response tokens"
    if lim.max_new_tokens and n > lim.max_new_tokens:
        return "too_long", f"{n} response tokens > actors.max_new_tokens={lim.max_new_tokens}"
    if lim.max_total_tokens and p + n > lim.max_total_tokens:
        return "too_long", f"{p} + {n} tokens > the context of {lim.max_total_tokens}"
    if lim.vocab_size:
        top = max(int(s.prompt_ids.max()), int(s.output_ids.max()))
        if top >= lim.vocab_size:
            return "token_id", f"token id {top} >= the vocabulary size {lim.vocab_size}"
    if not (math.isfinite(s.reward) and lim.reward_min <= s.reward <= lim.reward_max):
        return "reward", f"reward {s.reward!r} outside [{lim.reward_min:g}, {lim.reward_max:g}] (task.reward_min/max)"
    top_lp = float(s.output_logprobs.max())
    if not top_lp <= LOGPROB_TOLERANCE:  # also catches NaN
        return "logprob", f"logprob {top_lp!r} > 0"
    return None


def group_problem(g: SampleGroup, lim: SampleLimits) -> tuple[str, str] | None:
    """Why a group is unusable (its first bad sample's reason); None when every sample is fine.

    One vectorised pass over the whole group first: at ingest this runs for every group, and the common
    case (all fine) then costs a few array reductions instead of a few per sample."""
    samples = g.samples
    if lim.vocab_size:
        ids = np.concatenate([a for s in samples for a in (s.prompt_ids, s.output_ids)])
        ok_ids = ids.size == 0 or int(ids.max()) < lim.vocab_size
    else:
        ok_ids = True
    lps = np.concatenate([s.output_logprobs for s in samples])
    ok_lp = lps.size == 0 or bool(lps.max() <= LOGPROB_TOLERANCE)
    if ok_ids and ok_lp and all(_cheap_ok(s, lim) for s in samples):
        return None
    for s in samples:
        bad = sample_problem(s, lim)
        if bad is not None:
            return bad
    return None


def _cheap_ok(s: Sample, lim: SampleLimits) -> bool:
    p, n = s.prompt_ids.shape[0], s.output_ids.shape[0]
    return (p > 0 and n > 0 and (not lim.max_new_tokens or n <= lim.max_new_tokens)
            and (not lim.max_total_tokens or p + n <= lim.max_total_tokens)
            and lim.reward_min <= s.reward <= lim.reward_max)


__all__ = ["SampleLimits", "REASONS", "LOGPROB_TOLERANCE", "limits_from_config", "model_shape", "sample_problem",
           "group_problem"]


def is_positive(sample: Sample, positive_reward: float) -> bool:
    """A verified-correct sample for the NLL term and the buffer's positives: reward >= ``positive_reward``
    (``buffer.positive_reward``) and a finished response. A response cut at the length limit can still hold a
    rewarded answer, but imitating it teaches the model not to stop."""
    return sample.reward >= positive_reward and sample.finish_reason != "length"
