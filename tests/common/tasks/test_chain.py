"""The long-horizon chain task: held-out disjointness, hand-worked traces, strict verifier, length range."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from common.config import ConfigError, TaskConfig, load_config
from common.modeling import build_char_tokenizer
from common.tasks import Prompt, decode_response, encode_prompt, get_task
from common.tasks.chain import ChainTask, length_bucket, parse_prompt, teacher_response


def _chain(**kw: object) -> ChainTask:
    task = get_task(TaskConfig(name="chain", **kw))  # type: ignore[arg-type]
    assert isinstance(task, ChainTask)
    return task


def _p(text: str, answer: str) -> Prompt:
    return Prompt("x", text, answer)


def test_hand_worked_trace() -> None:
    # 3 -> 10 mod 10 = 0 -> 7 -> 14 mod 10 = 4 -> 1 -> 8; the counter is the number of steps left.
    assert teacher_response(_p("Q:3+7x05\n", "8")) == "04:3+7=0\n03:0+7=7\n02:7+7=4\n01:4+7=1\n00:1+7=8\nA:8"
    assert teacher_response(_p("Q:0+1x01\n", "1")) == "00:0+1=1\nA:1"
    assert teacher_response(_p("Q:9+9x12\n", "7")).startswith("11:9+9=8\n10:8+9=7\n09:7+9=6\n")
    with pytest.raises(ValueError, match="not a chain prompt"):
        teacher_response(_p("Q:3+7x5\n", "8"))


def test_eval_never_overlaps_training_and_is_deterministic() -> None:
    task = _chain()
    held = {parse_prompt(p) for p in task.eval_prompts()}
    assert len(held) == 256 and {p.bucket for p in task.eval_prompts()} == {"short", "medium", "long"}
    assert not held & {parse_prompt(task.train_prompt(i)) for i in range(50_000)}
    again = _chain()
    assert again.eval_prompts() == task.eval_prompts() and again.train_prompt(77) == task.train_prompt(77)
    assert [p.text for p in _chain(seed=5).eval_prompts()] != [p.text for p in task.eval_prompts()]
    with pytest.raises(ValueError):
        task.train_prompt(-1)


def test_answers_buckets_and_length_range() -> None:
    task = _chain()
    tok = build_char_tokenizer()
    lengths, steps = [], []
    for i in range(3000):
        p = task.train_prompt(i)
        start, inc, n = parse_prompt(p)
        assert 5 <= n <= 44 and 1 <= inc <= 9 and 0 <= start <= 9
        assert p.answer == str((start + n * inc) % 10) and p.bucket == length_bucket(n)
        resp = teacher_response(p)
        assert task.verify(p, resp).reward == 1.0
        lengths.append(len(tok.encode(resp, add_special_tokens=False)) + 1)  # + EOS
        assert lengths[-1] == 9 * n + 4
        steps.append(n)
    assert min(lengths) == 49 and max(lengths) == 400
    # Log-uniform steps: the median response is short (~140 tokens) and the long tail is real.
    lengths.sort()
    assert 120 <= lengths[len(lengths) // 2] <= 170
    assert sum(1 for n in steps if n >= 35) / len(steps) > 0.08
    share = Counter(length_bucket(n) for n in steps)
    expected = math.log(2) / math.log(45 / 5)  # short and medium each span a factor of 2 in n
    for bucket in ("short", "medium"):
        assert abs(share[bucket] / len(steps) - expected) < 0.04


def test_verifier_is_strict() -> None:
    task = _chain()
    p = _p("Q:3+7x05\n", "8")
    right = teacher_response(p)
    assert task.verify(p, right).reward == 1.0 and task.verify(p, right + "\n").reward == 1.0
    for resp in [right[:-1] + "9", right.replace("A:8", "A:08"), right.replace("A:8", "A:8.0"),
                 right + "\nA:9", right.replace("A:8", "A: 8"), right.replace("A:8", "A:18"), "", "8"]:
        assert task.verify(p, resp).reward == 0.0, resp
    assert task.verify(p, "A:8").reward == 1.0  # only the answer is graded, like the addition task


def test_teacher_errors_propagate_to_the_answer_at_the_configured_rate() -> None:
    task = _chain()
    rng = random.Random(0)
    prompts = [task.train_prompt(i) for i in range(3000)]
    verdicts = [task.verify(p, teacher_response(p, rng, 0.03)) for p in prompts]
    expected = sum(0.97 ** parse_prompt(p)[2] for p in prompts) / len(prompts)
    assert abs(sum(v.reward for v in verdicts) / len(verdicts) - expected) < 0.03
    assert all(v.parsed is not None for v in verdicts)
    # A slip adds one to that line's value and every later value follows from the wrong one; slips never
    # cancel (two opposite slips would leave a wrong trace with the right answer).
    bad = teacher_response(_p("Q:1+2x04\n", "9"), random.Random(1), 1.0)
    assert bad == "03:1+2=4\n02:4+2=7\n01:7+2=0\n00:0+2=3\nA:3"


def test_every_character_is_one_token_and_round_trips() -> None:
    tok = build_char_tokenizer()
    task = _chain()
    for i in range(100):
        q = task.train_prompt(i)
        resp = teacher_response(q, random.Random(i), 0.2)
        assert len(tok.encode(q.text + resp, add_special_tokens=False)) == len(q.text + resp)
        ids = encode_prompt(tok, q)
        assert tok.decode(ids[1:]) == q.text
        assert decode_response(tok, tok.encode(resp, add_special_tokens=False) + [tok.eos_token_id, 7]) == resp


def test_bad_step_ranges_are_rejected() -> None:
    with pytest.raises(ValueError, match="min_steps"):
        _chain(min_steps=10, max_steps=5)
    with pytest.raises(ValueError, match="eval_buckets"):
        _chain(eval_buckets=1)
    with pytest.raises(ConfigError, match="task.min_steps"):
        load_config(None, ["task.max_steps=120"])
    with pytest.raises(ValueError, match="not a chain prompt"):
        parse_prompt(_p("Q:12+3x05\n", "0"))


def test_evaluation_reports_the_length_buckets_in_order() -> None:
    from learner.evaluate import score

    tok = build_char_tokenizer()
    task = _chain()
    prompts = [next(p for p in task.eval_prompts() if p.bucket == b) for b in ("long", "short", "medium")]
    right = [tok.encode(teacher_response(p), add_special_tokens=False) + [tok.eos_token_id] for p in prompts]
    report = score(task, tok, prompts, [[right[0]], [right[1]], [[tok.eos_token_id]]], None, [tok.eos_token_id])
    assert list(report["by_bucket"]) == ["short", "medium", "long"]
    assert [report["by_bucket"][b]["avg_at_k"] for b in ("short", "medium", "long")] == [1.0, 0.0, 1.0]


def test_oracle_value_counts_the_step_lines_left_and_drops_to_zero_after_a_mistake() -> None:
    """Q:3+7x05: five step lines, result digits at characters 7, 16, 25, 34, 43. Before anything is written
    all five are left: p^5. Once line 1's result (char 7) is written right, four: p^4. A wrong result there
    leaves the trace: 0 for that state and every later one. The finished trace is worth p^0 = 1."""
    from common.tasks.chain import correct_trace, line_outcome, lines_left, oracle_value

    trace = correct_trace("Q:3+7x05\n")
    assert trace == "04:3+7=0\n03:0+7=7\n02:7+7=4\n01:4+7=1\n00:1+7=8\nA:8"
    assert [lines_left(trace, w) for w in (0, 7, 8, 16, 17, 43, 44, len(trace))] == [5, 5, 4, 4, 3, 1, 0, 0]
    assert oracle_value(trace, "", 0.9) == pytest.approx(0.9**5)
    assert oracle_value(trace, "04:3+7=0", 0.9) == pytest.approx(0.9**4)
    assert oracle_value(trace, "04:3+7=1", 0.9) == 0.0
    assert oracle_value(trace, "04:3+7=1\n03:1+7=8", 0.9) == 0.0
    assert oracle_value(trace, trace, 0.9) == 1.0
    # Lines right before the first mistake, and whether there is one: the line accuracy's counts.
    assert line_outcome(trace, trace, stopped=True) == (5, 0)
    assert line_outcome(trace, "04:3+7=0\n03:0+7=8\n", stopped=True) == (1, 1)  # slip on line 2
    assert line_outcome(trace, "04:3+7=0\n03:0+7=7", stopped=True) == (2, 1)  # stopped early
    assert line_outcome(trace, trace + "\n", stopped=False) == (5, 1)  # did not stop
