"""In-process generation to completion through the rollout server's own decode loop
(``common.generation.scheduler.Scheduler``, on a private instance over the caller's model): what
``learner.evaluate`` samples with, so an evaluation decodes exactly as the actors' engines do."""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from common.generation.sampling import SamplingParams
from common.generation.scheduler import Scheduler, Sequence

Job = tuple[Seq[int], SamplingParams]


def generate_batch(model: torch.nn.Module, jobs: Seq[Job], *, eos_token_ids: set[int], seed: int = 0,
                   max_batch_size: int = 512, progress: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """Generate every job ``(prompt ids, params)`` (``params.n`` is ignored: one sequence per job) through a
    private ``Scheduler`` over ``model`` and return each job's output ids, EOS or stop token included.
    One pass of :func:`generate_passes`."""
    return generate_passes(model, [jobs], eos_token_ids=eos_token_ids, seed=seed, max_batch_size=max_batch_size,
                           progress=progress)[0]


def generate_passes(model: torch.nn.Module, passes: Seq[Seq[Job]], *, eos_token_ids: set[int], seed: int = 0,
                    max_batch_size: int = 512,
                    progress: Callable[[int, int], None] | None = None) -> list[list[list[int]]]:
    """Each pass's jobs, one pass after the other, through ONE private ``Scheduler`` over ``model``: the
    weights are fused and the KV cache allocated once (an evaluation's sampled and greedy passes share them).

    The model's parameters are left where they are (``reseat_weights=False``); the KV cache holds the longest
    prompt plus the largest ``max_new_tokens``. Every pass starts from ``seed`` with all its jobs queued at
    once, so a pass's outputs depend only on its jobs and the seed. ``progress(done, total)`` follows the
    first pass, called from this thread. The model's train/eval mode is restored. Raises ``RuntimeError`` if
    the scheduler fails.
    """
    jobs = [j for p in passes for j in p]
    if not jobs:
        return [[] for _ in passes]
    context = max(len(p) for p, _ in jobs) + max(max(sp.max_new_tokens for _, sp in jobs), 1)
    widest = max(len(p) for p in passes)
    was_training = model.training  # the scheduler puts the model in eval mode; the caller gets it back as it was
    scheduler = Scheduler(model, max_batch_size=max(1, min(max_batch_size, widest)), context_length=context,
                          eos_token_ids=eos_token_ids, seed=seed, reseat_weights=False)
    try:
        return [_run_pass(scheduler, p, seed, progress if i == 0 else None) for i, p in enumerate(passes)]
    finally:
        scheduler.shutdown()
        model.train(was_training)


def _run_pass(scheduler: Scheduler, jobs: Seq[Job], seed: int,
              progress: Callable[[int, int], None] | None) -> list[list[int]]:
    done = threading.Condition()
    finished: list[Sequence] = []

    def on_done(s: Sequence) -> None:
        with done:
            finished.append(s)
            done.notify()

    seqs = [Sequence(rid=str(i), prompt_ids=list(p), params=sp, on_done=on_done) for i, (p, sp) in enumerate(jobs)]
    for s in seqs:
        scheduler.validate_prompt(s.prompt_ids, s.params)
    scheduler.generator.manual_seed(seed)  # the scheduler is idle between passes: nothing else draws from it
    scheduler.submit(seqs)
    reported = 0
    with done:
        while len(finished) < len(seqs):
            done.wait()
            if progress is not None and len(finished) - reported >= scheduler.max_batch_size:
                reported = len(finished)
                progress(reported, len(seqs))
    failed = next((s.finish for s in seqs if s.finish is not None and s.finish.get("type") == "abort"), None)
    if failed is not None:
        raise RuntimeError(f"generation failed: {failed['message']}") from scheduler.error
    if progress is not None and reported < len(seqs):
        progress(len(seqs), len(seqs))
    return [s.output_ids for s in seqs]
