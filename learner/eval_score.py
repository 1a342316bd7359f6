"""The evaluation report of already generated responses: avg@k, pass@k, greedy accuracy, lengths, and the
same by task bucket, by data_source (a prompt without one counts under the task's name) and by response length.

Not a CLI. ``learner.evaluate`` (in-process generation) and ``learner.engine_eval`` (generation on rollout
engines) both end with ``score``; it is apart from sampling so that it can be tested on scripted responses.
Response length counts generated tokens including EOS; a response without EOS counts as truncated.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from common.tasks import Prompt, Task, decode_response

LENGTH_BINS = (16, 32, 48, 64, 96, 128, 192, 256, 320, 400)  # response-length bucket upper edges (tokens)
_NAMED_BUCKETS = {"short": 0.0, "medium": 1.0, "long": 2.0}  # the chain task's length buckets


def _length_bin(n: int) -> str:
    lo = 0
    for hi in LENGTH_BINS:
        if n <= hi:
            return f"{lo + 1}-{hi}"
        lo = hi
    return f">{LENGTH_BINS[-1]}"


def _bucket_order(label: str) -> tuple[float, str]:
    if label in _NAMED_BUCKETS:
        return (_NAMED_BUCKETS[label], label)
    digits = "".join(ch for ch in label.split("-")[0] if ch.isdigit())
    return (float(digits) if digits else math.inf, label)


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def _rewards(task: Task, tokenizer: Any, p: Prompt, samples: Sequence[Sequence[int]]) -> list[float]:
    # A prompt's samples together, as an actor scores its group: a configured reward scores them the same way.
    return [v.reward for v in task.verify_batch(p, [decode_response(tokenizer, list(ids)) for ids in samples])]


def _sampled_report(task: Task, tokenizer: Any, prompts: Sequence[Prompt],
                    sampled: Sequence[Sequence[Sequence[int]]], eos_set: set[int]) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The sampled responses' report (without the tables) and their rewards by task bucket."""
    rewards: list[float] = []
    lengths = [len(ids) for samples in sampled for ids in samples]
    truncated = sum(int(not ids or ids[-1] not in eos_set) for samples in sampled for ids in samples)
    pass_k = 0
    by_bucket: dict[str, list[float]] = defaultdict(list)
    by_len: dict[str, list[float]] = defaultdict(list)
    by_source: dict[str, list[list[float]]] = defaultdict(list)  # one list of k rewards per prompt
    for p, samples in zip(prompts, sampled, strict=True):
        rs = _rewards(task, tokenizer, p, samples)
        for ids, r in zip(samples, rs, strict=True):
            by_len[_length_bin(len(ids))].append(r)
        rewards.extend(rs)
        by_bucket[p.bucket].extend(rs)
        by_source[p.data_source or task.name].append(rs)
        pass_k += _passed(rs)
    report: dict[str, Any] = {
        "task": task.name,
        "n_prompts": len(prompts),
        "k": len(sampled[0]) if sampled else 0,
        "avg_at_k": _mean(rewards),
        "pass_at_k": pass_k / max(len(prompts), 1),
        "mean_response_length": _mean(lengths),
        "min_response_length": min(lengths, default=0),
        "max_response_length": max(lengths, default=0),
        "truncated_fraction": truncated / max(len(lengths), 1),
        "by_data_source": {ds: {"n_prompts": len(v), "avg_at_k": _mean([r for rs in v for r in rs]),
                                "pass_at_k": sum(_passed(rs) for rs in v) / len(v)} for ds, v in sorted(by_source.items())},
        "by_response_length": {b: {"n_samples": len(v), "avg_at_k": _mean(v)}
                               for b, v in sorted(by_len.items(), key=lambda kv: _bucket_order(kv[0]))},
    }
    return report, by_bucket


def _passed(rewards: Sequence[float]) -> int:
    """pass@k of one prompt: 1 when any of its k samples earned the full reward."""
    return int(max(rewards, default=0.0) >= 1.0)


def score(
    task: Task, tokenizer: Any, prompts: Sequence[Prompt], sampled: Sequence[Sequence[Sequence[int]]],
    greedy: Sequence[Sequence[int]] | None, eos_ids: Sequence[int],
) -> dict[str, Any]:
    """The evaluation report for already generated responses: ``sampled[prompt][sample]`` and, unless None,
    one ``greedy[prompt]`` response each."""
    report, by_bucket = _sampled_report(task, tokenizer, prompts, sampled, {int(e) for e in eos_ids})
    k = report["k"]
    greedy_by_bucket: dict[str, list[float]] = defaultdict(list)
    if greedy is not None:
        g_rewards = [_rewards(task, tokenizer, p, [ids])[0] for p, ids in zip(prompts, greedy, strict=True)]
        for p, r in zip(prompts, g_rewards, strict=True):
            greedy_by_bucket[p.bucket].append(r)
        report["greedy_accuracy"] = _mean(g_rewards)
        report["greedy_mean_response_length"] = _mean([len(ids) for ids in greedy])
    report["by_bucket"] = {
        b: {"n_prompts": len(v) // max(k, 1), "avg_at_k": _mean(v),
            **({"greedy_accuracy": _mean(greedy_by_bucket[b])} if greedy is not None else {})}
        for b, v in sorted(by_bucket.items(), key=lambda kv: _bucket_order(kv[0]))
    }
    report["by_response_length"] = report.pop("by_response_length")  # last, where every report has had it
    return report
