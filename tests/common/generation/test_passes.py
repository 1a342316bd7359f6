"""common.generation.passes: in-process generation through a private scheduler (what learner.evaluate runs),
against HF argmax decoding on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.generation.passes import generate_batch, generate_passes
from common.generation.sampling import SamplingParams
from common.modeling import load_model

EOS = 2


def test_generate_batch_repeats_with_its_seed_matches_hf_greedy_and_leaves_the_model_alone(tiny_model_dir: Path) -> None:
    """In-process generation (what learner.evaluate runs): more jobs than slots, greedy and sampled rows mixed;
    the same jobs and seed give the same outputs, greedy rows equal HF argmax decoding, and the model's
    parameters neither move (no fused views) nor change."""
    model = load_model(tiny_model_dir).eval()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    vocab = model.config.vocab_size
    greedy = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 10}, vocab)
    sampled = SamplingParams.from_dict({"temperature": 1.0, "max_new_tokens": 10}, vocab)
    jobs = [([5, 6, 7], greedy), ([5, 6, 7], sampled), ([8, 9], sampled), ([3] * 20, greedy), ([4, 11], sampled)]
    first = generate_batch(model, jobs, eos_token_ids={EOS}, seed=3, max_batch_size=2)
    assert generate_batch(model, jobs, eos_token_ids={EOS}, seed=3, max_batch_size=2) == first
    for (prompt, params), out in zip(jobs, first, strict=True):
        assert 1 <= len(out) <= 10 and (out[-1] == EOS or len(out) == 10) and EOS not in out[:-1]
        if params.greedy:
            ctx = list(prompt)
            with torch.no_grad():
                for tok in out:
                    assert tok == int(model(input_ids=torch.tensor([ctx])).logits[0, -1].argmax())
                    ctx.append(tok)
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n


def test_each_pass_starts_from_the_seed_progress_follows_the_first_and_the_mode_is_restored(tiny_model_dir: Path) -> None:
    """Two passes of the same sampled jobs give the same outputs, each the one ``generate_batch`` gives alone
    (every pass restarts from the seed); ``progress`` sees the first pass only, ending at (n, n); a model in
    training mode is handed back in training mode; no jobs at all give one empty list per pass."""
    model = load_model(tiny_model_dir)
    model.train()
    sampled = SamplingParams.from_dict({"temperature": 1.0, "max_new_tokens": 6}, model.config.vocab_size)
    jobs = [([5, 6, 7], sampled), ([8, 9], sampled), ([4, 11, 12, 13], sampled)]
    calls: list[tuple[int, int]] = []
    first, second = generate_passes(model, [jobs, jobs], eos_token_ids={EOS}, seed=7, max_batch_size=2,
                                    progress=lambda done, total: calls.append((done, total)))
    assert model.training
    assert first == second == generate_batch(model, jobs, eos_token_ids={EOS}, seed=7, max_batch_size=2)
    assert calls and calls[-1] == (3, 3) and all(total == 3 for _, total in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert generate_passes(model, [[], []], eos_token_ids={EOS}) == [[], []]


def test_a_module_that_is_not_an_hf_model_is_refused() -> None:
    """The decode loop reads the HF config (heads, sizes, vocabulary): anything else is refused by name."""
    with pytest.raises(RuntimeError, match="HF models.*Linear"):
        generate_batch(torch.nn.Linear(2, 2), [([1], SamplingParams.from_dict({}, 10))], eos_token_ids={EOS})
