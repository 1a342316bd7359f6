"""Evaluation sets scored and recorded: avg@k and pass@k per set and per data_source, computed by hand from
fixed responses that the addition task's exact verifier checks, through ``learner.evaluate.evaluate_sets``
(generation scripted) into the ``eval`` record, its log line and the learner's gauges."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import learner.evaluate
from common.config import TaskConfig
from common.metrics import Metrics
from common.modeling import build_char_tokenizer
from common.tasks import encode_prompt, get_task
from common.tasks import eval_sets as task_sets
from common.tasks.eval_sets import EvalSet, load_eval_set
from learner import eval_record
from learner.eval_record import eval_line, record_sets, set_eval_gauges
from learner.evaluate import evaluate_sets


def _set_file(tmp_path: Path, name: str, rows: list[dict[str, str]]) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _scripted(tok: Any, answers: dict[tuple[int, ...], list[str]], calls: list[tuple[int, int]]) -> Any:
    """Stands in for generation: prompt -> its scripted answers, sample i answering ``A:<answers[i]>`` (the
    greedy pass answers the first); an answer ending in ``~`` is cut before EOS (a truncated response)."""

    def response(ans: str) -> list[int]:
        ids = tok.encode(f"A:{ans.rstrip('~')}", add_special_tokens=False)
        return ids if ans.endswith("~") else [*ids, tok.eos_token_id]

    def fake(model: Any, prompt_ids: Any, passes: Any, max_new_tokens: int, *args: Any) -> list:
        calls.append((len(prompt_ids), max_new_tokens))
        return [[[response(answers[tuple(p)][i]) for i in range(n)] for p in prompt_ids] for n, _ in passes]

    return fake


@pytest.fixture
def scored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    tok, tc = build_char_tokenizer(), TaskConfig(eval_size=2)
    task = get_task(tc)  # addition: reward 1 exactly when the last line is A:<the sum>
    heldout = EvalSet("heldout", tuple(task.eval_prompts()), 2, 30)
    mix = load_eval_set(_set_file(tmp_path, "mix", [
        {"question": "Q:1+2\n", "answer": "3", "data_source": "x"},
        {"question": "Q:2+2\n", "answer": "4", "data_source": "x"},
        {"question": "Q:3+3\n", "answer": "6", "data_source": "y"}]), "mix", tc)
    solo = load_eval_set(_set_file(tmp_path, "solo", [
        {"question": "Q:5+5\n", "answer": "10"}, {"question": "Q:6+1\n", "answer": "7"}]), "solo", tc)
    answers = {tuple(encode_prompt(tok, p)): [p.answer] * 2 for p in heldout.prompts}
    for p, a in zip(mix + solo, [["3", "4"], ["5", "5"], ["6", "6"], ["1", "2", "10"], ["1", "2", "3~"]], strict=True):
        answers[tuple(encode_prompt(tok, p))] = a
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(learner.evaluate, "_generate", _scripted(tok, answers, calls))
    sets = [heldout, EvalSet("mix", tuple(mix), 2, 30), EvalSet("solo", tuple(solo), 3, 7)]
    return evaluate_sets(torch.nn.Linear(1, 1), tok, task, sets), calls


def test_each_set_is_scored_with_its_k_and_response_limit_per_data_source(scored) -> None:
    rec, calls = scored
    assert calls == [(2, 30), (3, 30), (2, 7)]  # each set generated with its own response limit
    # The held-out slice stays at the top level, as old readers expect.
    assert rec["avg_at_k"] == 1.0 and rec["pass_at_k"] == 1.0 and rec["n_prompts"] == 2 and rec["k"] == 2
    assert "by_bucket" in rec and "by_response_length" in rec
    assert list(rec["sets"]) == ["heldout", "mix", "solo"]
    mix, solo = rec["sets"]["mix"], rec["sets"]["solo"]
    # mix, k=2: x = {1+2: [right, wrong], 2+2: [wrong, wrong]}, y = {3+3: [right, right]}
    assert mix["avg_at_k"] == pytest.approx(3 / 6) and mix["pass_at_k"] == pytest.approx(2 / 3)
    assert mix["greedy_accuracy"] == pytest.approx(2 / 3) and (mix["n_prompts"], mix["k"], mix["max_new_tokens"]) == (3, 2, 30)
    assert mix["by_data_source"] == {"x": {"n_prompts": 2, "avg_at_k": 0.25, "pass_at_k": 0.5},
                                     "y": {"n_prompts": 1, "avg_at_k": 1.0, "pass_at_k": 1.0}}
    assert mix["mean_response_length"] == 4.0 and mix["truncated_fraction"] == 0.0  # "A:3" + EOS
    # solo, k=3: {5+5: [wrong, wrong, right], 6+1: [wrong, wrong, wrong (cut before EOS)]}; no data_source
    assert solo["avg_at_k"] == pytest.approx(1 / 6) and solo["pass_at_k"] == 0.5 and solo["k"] == 3
    assert solo["max_new_tokens"] == 7 and solo["truncated_fraction"] == pytest.approx(1 / 6)
    assert solo["by_data_source"] == {"solo": {"n_prompts": 2, "avg_at_k": pytest.approx(1 / 6), "pass_at_k": 0.5}}
    assert rec["sets"]["heldout"]["avg_at_k"] == 1.0 and rec["sets"]["heldout"]["by_data_source"]["addition"]["n_prompts"] == 2
    json.dumps(rec)  # a metrics.jsonl line
    assert eval_line(rec) == ("eval heldout avg@2 1.000 pass@2 1.000 | eval mix avg@2 0.500 pass@2 0.667 | "
                              "eval solo avg@3 0.167 pass@3 0.500")


def test_the_gauges_carry_every_set_and_data_source(scored) -> None:
    rec, _ = scored
    m = Metrics("learner")
    set_eval_gauges(m, rec)

    def value(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(f"vapo_learner_{name}", labels)

    assert value("eval_avg_at_k", set="mix", data_source="all") == 0.5
    assert value("eval_pass_at_k", set="mix", data_source="x") == 0.5
    assert value("eval_avg_at_k", set="mix", data_source="y") == 1.0
    assert value("eval_pass_at_k", set="solo", data_source="all") == 0.5
    assert value("eval_avg_at_k", set="heldout", data_source="addition") == 1.0
    assert value("eval_accuracy", metric="avg_at_k") == 1.0  # the held-out gauges as before


def test_the_held_out_slice_alone_is_recorded_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    tok, task = build_char_tokenizer(), get_task(TaskConfig(eval_size=3))
    answers = {tuple(encode_prompt(tok, p)): [p.answer] for p in task.eval_prompts()}
    monkeypatch.setattr(learner.evaluate, "_generate", _scripted(tok, answers, []))
    rec = evaluate_sets(torch.nn.Linear(1, 1), tok, task, [EvalSet("heldout", tuple(task.eval_prompts()), 1, 30)])
    assert "sets" not in rec and rec["avg_at_k"] == 1.0 and rec["n_prompts"] == 3
    assert record_sets(rec) == {"heldout": rec} and eval_line(rec) == "eval heldout avg@1 1.000 pass@1 1.000"
    m = Metrics("learner")
    set_eval_gauges(m, rec)
    assert m.registry.get_sample_value("vapo_learner_eval_pass_at_k", {"set": "heldout", "data_source": "all"}) == 1.0


def test_a_record_of_an_engine_evaluation_spans_every_sets_weight_versions() -> None:
    a, b = EvalSet("heldout", (), 1, 1), EvalSet("aime", (), 1, 1)
    rec = eval_record.eval_record([(a, {"avg_at_k": 0.5, "k": 1, "weight_versions_evaluated": [3, 4]}),
                                   (b, {"avg_at_k": 0.0, "k": 1, "weight_versions_evaluated": [4, 6]})])
    assert rec["weight_versions_evaluated"] == [3, 6] and rec["avg_at_k"] == 0.5 and rec["sets"]["aime"]["avg_at_k"] == 0.0


def test_the_held_out_set_name_is_the_tasks() -> None:
    assert eval_record.HELDOUT == task_sets.HELDOUT
