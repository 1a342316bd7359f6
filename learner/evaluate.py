"""Held-out evaluation: avg@k sampled accuracy, greedy accuracy, accuracy by bucket and by length.

Library use (the learner calls it every ``learner.eval_every`` steps)::

    from learner.evaluate import evaluate, evaluate_on_engine
    stats = evaluate(model, tokenizer, task, k=8, max_new_tokens=96)          # in-process (one CPU learner)
    stats = evaluate_on_engine("http://127.0.0.1:30000", tokenizer, task, version=10, k=8)   # on a rollout engine

CLI::

    python -m learner.evaluate --model ops/bases/addition-tiny [--task addition] [--k 8] [--config cfg.yaml]

prints one JSON object. In-process generation runs the rollout server's scheduler and KV-cache model
runner on the given model (``common.generation.passes.generate_passes``: the decode loop the actors sample
with, per-sequence stopping at EOS; the model's parameters are not moved), seeded with its own
``torch.Generator`` so a call is reproducible and does not disturb the caller's RNG. It needs a
Llama-style decoder (Qwen2/Qwen3/Llama), as the rollout server does. Prompts are encoded with
``common.tasks.encode_prompt`` and responses decoded with ``decode_response``, exactly as the actors do.
Response length counts generated tokens including EOS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from common.config import ConfigError, load_config
from common.generation.passes import generate_passes
from common.generation.sampling import SamplingParams
from common.modeling import load_model, load_tokenizer
from common.placement import engine_tp, parse_gpus
from common.sglang_client import SGLangClient, SGLangError, as_int
from common.tasks import Prompt, Task, decode_response, encode_prompt, get_task

LENGTH_BINS = (16, 32, 48, 64, 96, 128, 192, 256, 320, 400)  # response-length bucket upper edges (tokens)


def _length_bin(n: int) -> str:
    lo = 0
    for hi in LENGTH_BINS:
        if n <= hi:
            return f"{lo + 1}-{hi}"
        lo = hi
    return f">{LENGTH_BINS[-1]}"


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
) -> list[list[list[int]]]:
    """One result per ``(n, temperature)`` pass, as :func:`generate` returns it, decoded by the rollout
    server's scheduler (``common.generation.passes.generate_passes``: the same KV-cache decode loop the
    actors sample with, on this process's model; one scheduler for all passes). Each pass starts from
    ``seed``, so a pass's samples do not depend on the others; ``progress`` follows the first."""
    vocab = int(model.config.vocab_size)
    jobs = []
    for n, temperature in passes:
        sp = SamplingParams.from_dict({"temperature": temperature, "max_new_tokens": max_new_tokens}, vocab)
        jobs.append([(p, sp) for p in prompt_ids for _ in range(n)])
    outs = generate_passes(model, jobs, eos_token_ids={int(e) for e in eos_ids}, seed=seed,
                           max_batch_size=batch_size, progress=progress)
    return [[out[j * n : (j + 1) * n] for j in range(len(prompt_ids))] for out, (n, _) in zip(outs, passes, strict=True)]


def score(
    task: Task, tokenizer: Any, prompts: Sequence[Prompt], sampled: Sequence[Sequence[Sequence[int]]],
    greedy: Sequence[Sequence[int]] | None, eos_ids: Sequence[int],
) -> dict[str, Any]:
    """The evaluation report for already generated responses (separate from sampling so it can be tested)."""
    eos_set = set(int(e) for e in eos_ids)
    k = len(sampled[0]) if sampled else 0
    rewards: list[float] = []
    lengths: list[int] = []
    truncated = 0
    pass_k = 0
    by_bucket: dict[str, list[float]] = defaultdict(list)
    greedy_by_bucket: dict[str, list[float]] = defaultdict(list)
    by_len: dict[str, list[float]] = defaultdict(list)
    for p, samples in zip(prompts, sampled, strict=True):
        rs = []
        for ids in samples:
            r = task.verify(p, decode_response(tokenizer, ids)).reward
            rs.append(r)
            lengths.append(len(ids))
            truncated += int(not ids or ids[-1] not in eos_set)
            by_len[_length_bin(len(ids))].append(r)
        rewards.extend(rs)
        by_bucket[p.bucket].extend(rs)
        pass_k += int(max(rs, default=0.0) >= 1.0)
    report: dict[str, Any] = {
        "task": task.name,
        "n_prompts": len(prompts),
        "k": k,
        "avg_at_k": _mean(rewards),
        "pass_at_k": pass_k / max(len(prompts), 1),
        "mean_response_length": _mean(lengths),
        "min_response_length": min(lengths, default=0),
        "max_response_length": max(lengths, default=0),
        "truncated_fraction": truncated / max(len(lengths), 1),
    }
    if greedy is not None:
        g_rewards, g_lengths = [], []
        for p, ids in zip(prompts, greedy, strict=True):
            r = task.verify(p, decode_response(tokenizer, ids)).reward
            g_rewards.append(r)
            g_lengths.append(len(ids))
            greedy_by_bucket[p.bucket].append(r)
        report["greedy_accuracy"] = _mean(g_rewards)
        report["greedy_mean_response_length"] = _mean(g_lengths)
    report["by_bucket"] = {
        b: {"n_prompts": len(v) // max(k, 1), "avg_at_k": _mean(v),
            **({"greedy_accuracy": _mean(greedy_by_bucket[b])} if greedy is not None else {})}
        for b, v in sorted(by_bucket.items(), key=lambda kv: _bucket_order(kv[0]))
    }
    report["by_response_length"] = {
        b: {"n_samples": len(v), "avg_at_k": _mean(v)} for b, v in sorted(by_len.items(), key=lambda kv: _bucket_order(kv[0]))
    }
    return report


_NAMED_BUCKETS = {"short": 0.0, "medium": 1.0, "long": 2.0}  # the chain task's length buckets


def _bucket_order(label: str) -> tuple[float, str]:
    if label in _NAMED_BUCKETS:
        return (_NAMED_BUCKETS[label], label)
    digits = "".join(ch for ch in label.split("-")[0] if ch.isdigit())
    return (float(digits) if digits else math.inf, label)


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


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


def eval_target(cfg: Any, world: int) -> tuple[str, list[str]]:
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


def eval_engine_urls(cfg: Any) -> list[str]:
    """The engines an engine evaluation is spread over: ``learner.eval_engine_urls``, else
    ``learner.eval_engine_url`` alone, else every external engine (``engine.urls``), else every engine of a
    one-host run (engine i at ``engine.host:engine.base_port + i``), else engine 0 (the only one a loopback
    engine on another host would leave reachable from learner rank 0)."""
    lc, e = cfg.learner, cfg.engine
    if lc.eval_engine_urls:
        return [u.rstrip("/") for u in lc.eval_engine_urls]
    if lc.eval_engine_url:
        return [lc.eval_engine_url.rstrip("/")]
    if e.kind == "external" and e.urls:
        return [u.rstrip("/") for u in e.urls]
    if e.base_port <= 0:
        raise ConfigError("learner.eval_engine_url: evaluating on an engine needs its URL; engine.base_port=0 gives "
                          "engines random ports (set engine.base_port or learner.eval_engine_urls)")
    n = cfg.actors.num_actors
    if cfg.run.device == "cuda" and cfg.placement.engine_gpus:
        n = len(parse_gpus(cfg.placement.engine_gpus, "placement.engine_gpus")) // engine_tp(cfg)
    if len(cfg.placement.hosts) > 1:
        n = 1
    return [f"http://{e.host}:{e.base_port + i}" for i in range(max(n, 1))]


class EngineEvalError(RuntimeError):
    """The engine did not serve the requested weights, or failed while generating, within the deadline."""


@dataclass
class _Shard:
    """One engine's part of an engine evaluation and what came back."""

    url: str
    ids: list[Sequence[int]]
    sampled: list[list[list[int]]] = field(default_factory=list)
    greedy: list[list[int]] = field(default_factory=list)
    served: str = ""
    versions: list[int] = field(default_factory=list)  # weight versions of the outputs (oldest token's, newest)


async def _engine_generate(shard: _Shard, k: int, max_new_tokens: int, temperature: float, version: int,
                           timeout_s: float, concurrency: int, request_timeout_s: float, version_wait_s: float) -> None:
    url, ids = shard.url, shard.ids
    deadline = time.monotonic() + timeout_s
    wait_deadline = min(deadline, time.monotonic() + version_wait_s)
    async with SGLangClient(url, timeout_s=min(timeout_s, request_timeout_s)) as client:
        # The engine's actor loads each published version; evaluate only once it serves ``version``.
        served: str | None = None
        delay = 0.05
        while True:
            try:
                served = await client.get_weight_version()
            except SGLangError:
                served = None
            v = as_int(served)
            if v is not None and v >= version:
                break
            if time.monotonic() > wait_deadline:
                raise EngineEvalError(f"{url} still serves weight version {served!r}, not {version}, after "
                                      f"{min(timeout_s, version_wait_s):.0f} s")
            await asyncio.sleep(delay)  # polling the engine's state with a deadline
            delay = min(delay * 2, 2.0)
        gate = asyncio.Semaphore(max(1, concurrency))

        async def one(p: Sequence[int], n: int, temp: float) -> list[list[int]]:
            # No per-request seed: SGLang honours one only in deterministic-inference mode and rollout_server
            # refuses the field, so engine evaluations are sampled afresh (the k samples average that out).
            sp: dict[str, Any] = {"n": n, "temperature": temp, "max_new_tokens": max_new_tokens}
            async with gate:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineEvalError(f"evaluation on {url} did not finish within {timeout_s:.0f} s")
                outs = await client.generate(list(p), sp, return_logprob=False, timeout_s=min(left, request_timeout_s))
            for o in outs:
                lo, hi = o.weight_version_int, as_int(o.weight_version)
                shard.versions += [v for v in (lo, hi) if v is not None]
            return [o.output_ids for o in outs]

        try:
            sampled = await asyncio.gather(*(one(p, k, temperature) for p in ids))
            greedy = await asyncio.gather(*(one(p, 1, 0.0) for p in ids))
        except SGLangError as e:
            raise EngineEvalError(f"evaluation on {url}: {e}") from e
    shard.sampled, shard.greedy, shard.served = list(sampled), [g[0] for g in greedy], str(served)


async def _generate_sharded(shards: list[_Shard], **kw: Any) -> None:
    await asyncio.gather(*(_engine_generate(sh, **kw) for sh in shards))


def evaluate_on_engines(
    urls: Sequence[str],
    tokenizer: Any,
    task: Task,
    version: int,
    k: int = 8,
    max_new_tokens: int = 96,
    temperature: float = 1.0,
    timeout_s: float = 0.0,
    concurrency: int = 64,
    prompts: Sequence[Prompt] | None = None,
    request_timeout_s: float = 0.0,
    version_wait_s: float = 0.0,
) -> dict[str, Any]:
    """The same report as :func:`evaluate`, generated by rollout engines (SGLang's native API) once each
    serves weight ``version`` or newer: how a sharded (ZeRO-3) or multi-rank learner evaluates, since
    generating through its training model would need every rank in every forward. The prompts are dealt
    round-robin to ``urls`` and generated on all of them at once; ``k`` samples per prompt in one request
    (``n = k``) plus a greedy one; responses end at the engine's EOS.

    Limits (0 = none): ``timeout_s`` for the whole evaluation, ``request_timeout_s`` for one request (a size-
    derived bound: the caller passes the actors' generate timeout), ``version_wait_s`` for an engine to
    serve ``version``. ``weight_versions_evaluated`` = [oldest, newest] weight version of the outputs: an
    engine may move to newer weights during an evaluation that runs beside training."""
    if k < 1:
        raise ValueError(f"evaluate_on_engines: k must be >= 1, got {k}")
    if not urls:
        raise ValueError("evaluate_on_engines: no engine URLs")
    t0 = time.perf_counter()
    prompts = list(task.eval_prompts() if prompts is None else prompts)
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    shards = [_Shard(u, ids[i::len(urls)]) for i, u in enumerate(urls)]
    shards = [sh for sh in shards if sh.ids]
    none = 1e9  # "no limit" in seconds that aiohttp's deadline arithmetic accepts (it cannot take inf)
    asyncio.run(_generate_sharded(shards, k=k, max_new_tokens=max_new_tokens, temperature=temperature,
                                  version=version, timeout_s=timeout_s or none, concurrency=concurrency,
                                  request_timeout_s=request_timeout_s or none, version_wait_s=version_wait_s or none))
    n = len(urls)
    sampled = [shards[i % n].sampled[i // n] for i in range(len(ids))]
    greedy = [shards[i % n].greedy[i // n] for i in range(len(ids))]
    report = score(task, tokenizer, prompts, sampled, greedy, [tokenizer.eos_token_id])
    versions = [v for sh in shards for v in sh.versions]
    report["temperature"] = temperature
    report["engine_url"] = shards[0].url
    report["engine_urls"] = [sh.url for sh in shards]
    report["prompts_per_engine"] = [len(sh.ids) for sh in shards]
    report["engine_weight_version"] = shards[0].served
    report["weight_versions_evaluated"] = [min(versions), max(versions)] if versions else None
    report["seconds"] = round(time.perf_counter() - t0, 3)
    return report


def evaluate_on_engine(url: str, tokenizer: Any, task: Task, version: int, **kw: Any) -> dict[str, Any]:
    """:func:`evaluate_on_engines` on one engine."""
    return evaluate_on_engines([url], tokenizer, task, version, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m learner.evaluate",
        description="Evaluate an HF model on a task's held-out split; prints one JSON object "
        "(avg@k sampled accuracy, greedy accuracy, accuracy by bucket and response length).",
    )
    ap.add_argument("--model", required=True, help="HF model directory (save_pretrained format)")
    ap.add_argument("--config", default=None, help="config YAML (task and sampling settings); default: built-in defaults")
    ap.add_argument("--task", default=None, help="task name, overrides task.name (addition | reasoning_gym:<gen> | jsonl:<path>)")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt for avg@k (default 8)")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: actors.temperature)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="response limit (default: actors.max_new_tokens)")
    ap.add_argument("--n-prompts", type=int, default=None, help="evaluate only the first N held-out prompts")
    ap.add_argument("--batch-size", type=int, default=512, help="sequences decoded together (default 512)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: learner.threads)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. task.eval_size=64)")
    args = ap.parse_args(argv)

    try:
        overrides = list(args.overrides) + ([f"task.name={args.task}"] if args.task else [])
        cfg = load_config(args.config, overrides)
        task = get_task(cfg.task)
    except (ConfigError, ValueError) as e:
        print(f"evaluate: {e}", file=sys.stderr)
        return 2
    if args.k < 1 or args.batch_size < 1:
        print("evaluate: --k and --batch-size must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads or cfg.learner.threads)
    try:
        tokenizer = load_tokenizer(args.model)
        model = load_model(args.model, cfg.model.dtype, cfg.run.device)
    except (OSError, ValueError) as e:
        print(f"evaluate: cannot load model from {args.model}: {e}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
