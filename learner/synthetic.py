"""Deterministic synthetic sample groups (no actors needed): what the learner benchmarks (``ops/bench/learner.py``)
and the learner tests train on."""

from __future__ import annotations

import numpy as np

from common.protocol import Sample, SampleGroup


def synth_groups(n_groups: int, group_size: int, vocab: int, seed: int = 0, prompt_len: tuple[int, int] = (3, 8),
                 resp_len: tuple[int, int] = (1, 12), p_correct: float = 0.5, version: int = 0,
                 max_new_tokens: int = 12) -> list[SampleGroup]:
    """Random prompts/responses over token ids [3, vocab); reward 1 with probability ``p_correct``;
    responses of max length are marked finish_reason 'length' (truncated)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(*prompt_len, endpoint=True))).astype(np.int32)
        samples = []
        for _ in range(group_size):
            n = int(rng.integers(*resp_len, endpoint=True))
            out = rng.integers(3, vocab, size=n).astype(np.int32)
            lp = (-rng.random(n) * 3.0 - 0.05).astype(np.float32)
            samples.append(Sample(prompt_ids=prompt, output_ids=out, output_logprobs=lp,
                                  reward=float(rng.random() < p_correct),
                                  finish_reason="length" if n >= max_new_tokens else "stop",
                                  weight_version=version, response_length=n))
        groups.append(SampleGroup(group_id=f"g{seed}-{g}", prompt_id=f"p{g}", task="synthetic", actor_id=0,
                                  samples=samples, created_at=0.0))
    return groups


__all__ = ["synth_groups"]
