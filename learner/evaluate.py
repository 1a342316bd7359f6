"""Held-out and evaluation-set evaluation: avg@k, pass@k, greedy accuracy, by bucket, data_source and length.

Library use (the learner calls it every ``learner.eval_every`` steps)::

    from learner.evaluate import evaluate, evaluate_sets
    from learner.engine_eval import evaluate_on_engine
    stats = evaluate(model, tokenizer, task, k=8, max_new_tokens=96)          # in-process (one CPU learner)
    record = evaluate_sets(model, tokenizer, task, eval_sets(cfg, task))        # every set of task.eval_sets
    stats = evaluate_on_engine("http://127.0.0.1:30000", tokenizer, task, version=10, k=8)   # on a rollout engine

CLI::

    python -m learner.evaluate --model ops/bases/addition-tiny [--task addition] [--k 8] [--config cfg.yaml]

prints one JSON object. In-process generation runs the rollout server's scheduler and KV-cache model
runner on the given model (``common.generation.passes.generate_passes``: the decode loop the actors sample
with, per-sequence stopping at EOS; the model's parameters are not moved), seeded with its own
``torch.Generator`` so a call is reproducible and does not disturb the caller's RNG. It needs a
Llama-style decoder (Qwen2/Qwen3/Llama), as the rollout server does. Prompts are encoded with
``common.tasks.encode_prompt`` and responses decoded with ``decode_response``, exactly as the actors do.
The report is ``learner.eval_score.score``'s; ``eval_target`` chooses between this and ``learner.engine_eval``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from common.config import Config, ConfigError, load_config
from common.generation.passes import generate_passes
from common.generation.sampling import SamplingParams
from common.modeling import load_model, load_tokenizer
from common.tasks import Prompt, Task, encode_prompt, fit_task, get_task
from common.tasks.eval_sets import EvalSet
from learner.engine_eval import eval_engine_urls
from learner.eval_record import eval_record
from learner.eval_score import score


def generate(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    eos_ids: Sequence[int],
    batch_size: int = 512,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[list[int]]]:
    """``n`` responses for each prompt (temperature 0 = greedy): result[prompt][sample] = output ids, each
    ending at its EOS (included) or after ``max_new_tokens``."""
    return _generate(model, prompt_ids, [(n, temperature)], max_new_tokens, eos_ids, batch_size, seed, progress)[0]


def _generate(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    passes: Sequence[tuple[int, float]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    batch_size: int,
    seed: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[list[list[int]]]]:
    """One result per ``(n, temperature)`` pass, as :func:`generate` returns it, decoded by the rollout
    server's scheduler (``common.generation.passes.generate_passes``: the same KV-cache decode loop the
    actors sample with, on this process's model; one scheduler for all passes). Each pass starts from
    ``seed``, so a pass's samples do not depend on the others; ``progress`` follows the first."""
    hf_config: Any = model.config  # nn.Module's __getattr__ types an HF model's config as Tensor | Module
    vocab = int(hf_config.vocab_size)
    jobs = []
    for n, temperature in passes:
        sp = SamplingParams.from_dict({"temperature": temperature, "max_new_tokens": max_new_tokens}, vocab)
        jobs.append([(p, sp) for p in prompt_ids for _ in range(n)])
    outs = generate_passes(model, jobs, eos_token_ids={int(e) for e in eos_ids}, seed=seed,
                           max_batch_size=batch_size, progress=progress)
    return [[out[j * n : (j + 1) * n] for j in range(len(prompt_ids))] for out, (n, _) in zip(outs, passes, strict=True)]


def evaluate(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    k: int = 8,
    max_new_tokens: int = 96,
    temperature: float = 1.0,
    batch_size: int = 512,
    seed: int = 0,
    greedy: bool = True,
    prompts: Sequence[Prompt] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Sample ``k`` responses per held-out prompt (and one greedy) and report accuracy.

    Keys: task, n_prompts, k, avg_at_k (mean reward over all k samples of every prompt), pass_at_k,
    greedy_accuracy,
    mean/min/max_response_length, truncated_fraction, by_bucket (task buckets, e.g. digits),
    by_response_length, seconds. The model's train/eval mode is restored afterwards.
    """
    if k < 1:
        raise ValueError(f"evaluate: k must be >= 1, got {k}")
    t0 = time.perf_counter()
    prompts = list(task.eval_prompts() if prompts is None else prompts)
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    eos_ids = [tokenizer.eos_token_id]
    passes = [(k, temperature)] + ([(1, 0.0)] if greedy else [])
    out = _generate(model, ids, passes, max_new_tokens, eos_ids, batch_size, seed, progress)
    sampled = out[0]
    greedy_out = [g[0] for g in out[1]] if greedy else None
    report = score(task, tokenizer, prompts, sampled, greedy_out, eos_ids)
    report["temperature"] = temperature
    report["seconds"] = round(time.perf_counter() - t0, 3)
    return report


def evaluate_sets(model: torch.nn.Module, tokenizer: Any, task: Task, sets: Sequence[EvalSet], temperature: float = 1.0,
                  seed: int = 0, batch_size: int = 512) -> dict[str, Any]:
    """:func:`evaluate` of each set (``common.tasks.eval_sets``) with its own prompts, k and response limit,
    as one metrics.jsonl ``eval`` record (``learner.eval_record.eval_record``)."""
    return eval_record([(s, evaluate(model, tokenizer, task, k=s.k, max_new_tokens=s.max_new_tokens,
                                     temperature=temperature, batch_size=batch_size, seed=seed, prompts=s.prompts))
                        for s in sets])


def eval_target(cfg: Config, world: int) -> tuple[str, list[str]]:
    """(``local`` | ``engine``, engine URLs) for ``learner.eval_via`` with ``world`` learner ranks.

    Generating through the training model is right only for one process: under ZeRO-3 every forward is a
    collective that all ranks must join, so a rank-0-only evaluation would hang the others (and a gathered
    copy of a large policy does not fit one rank). Anything else evaluates on a rollout engine."""
    lc = cfg.learner
    mode = lc.eval_via
    if mode == "auto":
        mode = "local" if world == 1 and cfg.run.device == "cpu" else "engine"
    if mode == "local":
        if world > 1:
            raise ConfigError(f"learner.eval_via=local: the learner has {world} ranks; in-process evaluation needs one "
                              "(use engine or auto)")
        return "local", []
    return "engine", eval_engine_urls(cfg)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m learner.evaluate",
        description="Evaluate an HF model on a task's held-out split; prints one JSON object "
        "(avg@k sampled accuracy, greedy accuracy, accuracy by bucket and response length).",
    )
    ap.add_argument("--model", required=True, help="HF model directory (save_pretrained format)")
    ap.add_argument("--config", default=None, help="config YAML (task and sampling settings); default: built-in defaults")
    ap.add_argument("--task", default=None, help="task name, overrides task.name (addition | reasoning_gym:<gen> | jsonl:<path> | dataset:<path>)")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt for avg@k (default 8)")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: actors.temperature)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="response limit (default: actors.max_new_tokens)")
    ap.add_argument("--n-prompts", type=int, default=None, help="evaluate only the first N held-out prompts")
    ap.add_argument("--batch-size", type=int, default=512, help="sequences decoded together (default 512)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: learner.threads)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. task.eval_size=64)")
    return ap


def _load(args: argparse.Namespace) -> tuple[Any, Task, Any, torch.nn.Module]:
    """(config, task, tokenizer, model) of the command line; ValueError saying what is wrong."""
    try:
        overrides = list(args.overrides) + ([f"task.name={args.task}"] if args.task else [])
        cfg = load_config(args.config, overrides)
        task = get_task(cfg.task)
    except (ConfigError, ValueError) as e:
        raise ValueError(str(e)) from e
    if args.k < 1 or args.batch_size < 1:
        raise ValueError("--k and --batch-size must be >= 1")
    torch.set_num_threads(args.threads or cfg.learner.threads)
    try:
        tokenizer, model = load_tokenizer(args.model), load_model(args.model, cfg.model.dtype, cfg.run.device)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load model from {args.model}: {e}") from e
    fit_task(task, cfg, tokenizer)
    return cfg, task, tokenizer, model


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg, task, tokenizer, model = _load(args)
    except ValueError as e:
        print(f"evaluate: {e}", file=sys.stderr)
        return 2
    prompts = task.eval_prompts()
    if args.n_prompts is not None:
        prompts = prompts[: args.n_prompts]

    def progress(done: int, total: int) -> None:
        print(f"\r  sampled {done}/{total} sequences", end="", file=sys.stderr, flush=True)

    report = evaluate(
        model, tokenizer, task, k=args.k,
        max_new_tokens=args.max_new_tokens or cfg.actors.max_new_tokens,
        temperature=cfg.actors.temperature if args.temperature is None else args.temperature,
        batch_size=args.batch_size, seed=args.seed, greedy=not args.no_greedy, prompts=prompts,
        progress=progress,
    )
    print(file=sys.stderr)
    report["model"] = str(args.model)
    print(json.dumps(report))
    return 0


__all__ = ["generate"]


if __name__ == "__main__":
    sys.exit(main())
