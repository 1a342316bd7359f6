"""actors.rollout_server.scheduler in-process (with its sampler): sampling maths, parameter checks, batching
invariants against the HF model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from actors.rollout_server.sampling import RequestError, SamplingParams, sample
from actors.rollout_server.scheduler import Scheduler, Sequence
from common.modeling import load_model
from learner.losses import token_logprobs

EOS = 2


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    torch.set_num_threads(1)
    return load_model(tiny_model_dir).eval()


def run(scheduler: Scheduler, seqs: list[Sequence], timeout_s: float = 60.0) -> list[Sequence]:
    done: list[Sequence] = []
    ev = threading.Event()
    lock = threading.Lock()

    def cb(s: Sequence) -> None:
        with lock:
            done.append(s)
            if len(done) == len(seqs):
                ev.set()

    for s in seqs:
        s.on_done = cb
    scheduler.submit(seqs)
    assert ev.wait(timeout_s), "scheduler did not finish"
    return seqs


def seq(prompt: list[int], **params) -> Sequence:
    return Sequence(rid=str(id(prompt)), prompt_ids=prompt, params=SamplingParams.from_dict(params, 89),
                    on_done=lambda s: None)


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


def test_mixed_lengths_shared_prompts_and_compaction_match_hf(model: torch.nn.Module) -> None:
    """Sequences of different lengths finish at different steps (slots get compacted), several share a
    prompt (shared prefill), and more sequences than slots arrive: every one must still match the HF model."""
    scheduler = Scheduler(model, max_batch_size=8, eos_token_ids={EOS}, seed=1)
    try:
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 80, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(6)]
        seqs = [seq(prompts[i % 6], max_new_tokens=5 + 7 * (i % 4), ignore_eos=i % 3 == 0,
                    temperature=0 if i % 2 else 1.0) for i in range(20)]
        run(scheduler, seqs)
        for s in seqs:
            assert s.finish is not None and len(s.logprobs) == len(s.output_ids) == len(s.versions)
            if s.finish["type"] == "length":
                assert len(s.output_ids) == s.params.max_new_tokens
            else:
                assert s.finish == {"type": "stop", "matched": EOS} and s.output_ids[-1] == EOS
                assert not s.params.ignore_eos
            ids = torch.tensor([s.prompt_ids + s.output_ids])
            with torch.no_grad():
                logits = model(ids).logits[:, len(s.prompt_ids) - 1 : -1]
            ref = token_logprobs(logits, torch.tensor([s.output_ids]))[0]
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4)
            if s.params.greedy:
                assert s.output_ids == logits[0].argmax(-1).tolist()
        assert scheduler.running == [] and scheduler.num_waiting() == 0
    finally:
        scheduler.shutdown()


def test_validate_prompt_and_bad_weights(model: torch.nn.Module, tmp_path: Path) -> None:
    scheduler = Scheduler(model, max_batch_size=2, context_length=32)
    try:
        p = SamplingParams(max_new_tokens=-1)  # None in the request: up to the context length
        assert scheduler.validate_prompt([5, 6, 7], p) == [5, 6, 7] and p.max_new_tokens == 29
        with pytest.raises(RequestError, match="longer than the model's context length"):
            scheduler.validate_prompt(list(range(3, 40)), SamplingParams())
        with pytest.raises(RequestError, match="maximum context length of 32"):
            scheduler.validate_prompt([5, 6], SamplingParams(max_new_tokens=31))
        ok, msg = scheduler.update_weights(str(tmp_path / "absent"), "1").result(10)
        assert not ok and "not a directory" in msg and scheduler.weight_version == "default"
    finally:
        scheduler.shutdown()


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


def test_scheduler_failure_answers_every_caller(model: torch.nn.Module) -> None:
    deaths: list[BaseException] = []
    scheduler = Scheduler(model, max_batch_size=2, on_death=deaths.append)
    try:
        def boom(*_a, **_k):
            raise RuntimeError("simulated forward failure")

        scheduler.runner.prefill = boom  # type: ignore[method-assign]
        seqs = run(scheduler, [seq([5, 6, 7], max_new_tokens=4) for _ in range(5)])
        assert all(s.finish and s.finish["type"] == "abort" and "simulated" in s.finish["message"] for s in seqs)
        assert not scheduler.alive
        assert [str(e) for e in deaths] == ["simulated forward failure"]  # the server exits on this
        with pytest.raises(RuntimeError, match="not running"):
            scheduler.submit([seq([5], max_new_tokens=1)])
    finally:
        scheduler.shutdown()
