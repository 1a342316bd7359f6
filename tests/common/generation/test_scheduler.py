"""common.generation.scheduler in-process: batching invariants against the HF model, prompt checks, weight
updates, failure handling."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from common.generation.sampling import RequestError, SamplingParams
from common.generation.scheduler import Scheduler, Sequence
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
