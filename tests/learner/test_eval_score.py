"""learner.eval_score on scripted responses to the real addition task: avg@k, pass@k, greedy accuracy,
lengths (EOS counted; none: truncated) and the same by bucket, data source and response length, by hand."""

from __future__ import annotations

import pytest

from common.config import load_config
from common.modeling import build_char_tokenizer
from common.tasks import Prompt, get_task
from learner.eval_score import _length_bin, score


def test_the_report_of_two_prompts_with_two_samples_each() -> None:
    task = get_task(load_config(None, ["task.name=addition"]).task)
    tok = build_char_tokenizer()
    eos = tok.eos_token_id

    def ids(text: str, end: bool = True) -> list[int]:
        return tok.encode(text, add_special_tokens=False) + ([eos] if end else [])

    prompts = [Prompt("p0", "Q:1+1\n", "2", split="eval", bucket="1d"),
               Prompt("p1", "Q:10+20\n", "30", split="eval", bucket="2d", data_source="mine")]
    sampled = [[ids("A:2"), ids("A:3", end=False)],  # right (4 tokens); wrong and cut (3 tokens, no EOS)
               [ids("A:30"), ids("A:31")]]  # right, wrong (5 tokens each)
    greedy = [ids("A:2"), ids("A:29")]
    rep = score(task, tok, prompts, sampled, greedy, [eos])
    assert (rep["task"], rep["n_prompts"], rep["k"]) == ("addition", 2, 2)
    assert rep["avg_at_k"] == 0.5 and rep["pass_at_k"] == 1.0
    assert (rep["mean_response_length"], rep["min_response_length"], rep["max_response_length"]) == (4.25, 3, 5)
    assert rep["truncated_fraction"] == 0.25
    assert rep["greedy_accuracy"] == 0.5 and rep["greedy_mean_response_length"] == (4 + 5) / 2
    assert rep["by_bucket"] == {"1d": {"n_prompts": 1, "avg_at_k": 0.5, "greedy_accuracy": 1.0},
                                "2d": {"n_prompts": 1, "avg_at_k": 0.5, "greedy_accuracy": 0.0}}
    # A prompt without a data source counts under the task's name.
    assert rep["by_data_source"] == {"addition": {"n_prompts": 1, "avg_at_k": 0.5, "pass_at_k": 1.0},
                                     "mine": {"n_prompts": 1, "avg_at_k": 0.5, "pass_at_k": 1.0}}
    assert rep["by_response_length"] == {"1-16": {"n_samples": 4, "avg_at_k": 0.5}}
    assert list(rep)[-1] == "by_response_length"
    no_greedy = score(task, tok, prompts, sampled, None, [eos])
    assert "greedy_accuracy" not in no_greedy and no_greedy["by_bucket"]["1d"] == {"n_prompts": 1, "avg_at_k": 0.5}


@pytest.mark.parametrize(("n", "label"), [(1, "1-16"), (16, "1-16"), (17, "17-32"), (400, "321-400"), (401, ">400")])
def test_length_bins(n: int, label: str) -> None:
    assert _length_bin(n) == label
