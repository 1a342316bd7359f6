"""common.generation.sampling: the token sampler's distribution and logprobs, SGLang's parameter checks."""

from __future__ import annotations

import pytest
import torch

from common.generation.sampling import RequestError, SamplingParams, sample


def test_sampling_distribution_and_truncation() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(40000, 1)
    cases = [(SamplingParams(), torch.softmax(logits[0], -1)),
             (SamplingParams(temperature=0.5), torch.softmax(logits[0] / 0.5, -1)),
             (SamplingParams(top_k=2), torch.softmax(logits[0, :2], -1)),
             (SamplingParams(top_p=0.7), torch.softmax(logits[0, :2], -1))]  # p = .64, .24: keeps 2 tokens
    for params, expected in cases:
        toks, lps = sample(logits, [params] * len(logits), g, scaled_logprobs=False)
        freq = torch.bincount(torch.tensor(toks), minlength=4).float() / len(toks)
        exp = torch.zeros(4)
        exp[: len(expected)] = expected
        assert torch.allclose(freq, exp, atol=0.01), (params, freq, exp)
        # logprobs are always log_softmax(logits) in "original" mode
        ref = torch.log_softmax(logits[0], -1)[torch.tensor(toks)]
        assert torch.allclose(torch.tensor(lps), ref, atol=1e-6)
    toks, lps = sample(logits[:3], [SamplingParams(temperature=0.5)] * 3, g, scaled_logprobs=True)
    assert torch.allclose(torch.tensor(lps), torch.log_softmax(logits[0] / 0.5, -1)[torch.tensor(toks)], atol=1e-6)
    greedy = SamplingParams.from_dict({"temperature": 0}, 4)
    assert greedy.greedy and sample(logits[:2], [greedy, SamplingParams()], g, False)[0][0] == 0


def test_sampling_params_validation_matches_sglang() -> None:
    assert SamplingParams.from_dict(None, 10).max_new_tokens == 128  # SGLang's default
    assert SamplingParams.from_dict({"temperature": 1e-9}, 10).top_k == 1
    for bad, msg in [({"top_p": 0}, "top_p must be in (0, 1]"), ({"min_p": 2}, "min_p must be in [0, 1]"),
                     ({"top_k": -2}, "top_k must be -1"), ({"max_new_tokens": 1.5}, "must be an integer"),
                     ({"stop_token_ids": [10]}, "stop_token_ids must be in [0, 9]"), ({"n": 0}, "n must be"),
                     ({"temperature": float("nan")}, "non-negative finite"), ({"ignore_eos": 1}, "boolean"),
                     ({"frequency_penalty": 0.5}, "not supported"), ({"frequency_penalty": 0.0, "nope": 1}, "unknown")]:
        with pytest.raises(RequestError, match=msg.replace("(", r"\(").replace("[", r"\[")):
            SamplingParams.from_dict(bad, 10)


def test_huge_top_k_cannot_overflow_the_sampler() -> None:
    """top_k far past the vocabulary (validation caps it at 2^30; the sampler clamps whatever it gets)
    beside a top-p row: no int64 overflow, and it samples like top_k = -1."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(2, 1)
    toks, _ = sample(logits, [SamplingParams(top_k=2**63 + 5), SamplingParams(top_p=0.5)], torch.Generator(), False)
    assert toks[1] == 0 and 0 <= toks[0] < 4
    with pytest.raises(RequestError, match="top_k must be at most 1073741824"):
        SamplingParams.from_dict({"top_k": 2**63}, 4)
    with pytest.raises(RequestError, match="n must be at most 4"):
        SamplingParams.from_dict({"n": 5}, 4, max_n=4)
    with pytest.raises(RequestError, match="temperature must be at most 1e"):
        SamplingParams.from_dict({"temperature": 10**400}, 4)
