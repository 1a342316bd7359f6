"""common.tasks.addition: the held-out split never meets training, prompts are deterministic and well formed,
the teacher's traces and their near-miss errors, and a verifier that rejects near misses by value."""

from __future__ import annotations

import random

import pytest

from common.config import TaskConfig
from common.modeling import build_char_tokenizer
from common.tasks import Prompt, Verdict, get_task
from common.tasks.addition import AdditionTask, operands, teacher_response


def _addition(**kw: object) -> AdditionTask:
    task = get_task(TaskConfig(**kw))  # type: ignore[arg-type]
    assert isinstance(task, AdditionTask)
    return task


def _pair(p: Prompt) -> tuple[int, int]:
    a, b = operands(p)
    return min(a, b), max(a, b)


def test_addition_eval_never_overlaps_training() -> None:
    task = _addition()
    held = {_pair(p) for p in task.eval_prompts()}
    assert len(held) == 256
    train = {_pair(task.train_prompt(i)) for i in range(50_000)}
    assert not held & train
    # Small operand spaces are the dangerous case: every pair gets drawn many times over.
    small = _addition(min_digits=1, max_digits=2, eval_size=64)
    held_small = {_pair(p) for p in small.eval_prompts()}
    assert held_small
    assert not held_small & {_pair(small.train_prompt(i)) for i in range(20_000)}


def test_addition_prompts_are_deterministic_and_well_formed() -> None:
    t1, t2 = _addition(), _addition()
    for i in (0, 1, 17, 10_000, 123_456_789):
        assert t1.train_prompt(i) == t2.train_prompt(i)
    assert t1.eval_prompts() == t2.eval_prompts()
    assert len({p.prompt_id for p in t1.eval_prompts()}) == len(t1.eval_prompts())
    other_seed = _addition(seed=99)
    assert [p.text for p in other_seed.eval_prompts()] != [p.text for p in t1.eval_prompts()]
    for i in range(200):
        p = t1.train_prompt(i)
        a, b = operands(p)
        assert p.answer == str(a + b) and p.split == "train" and p.index == i
        assert 1 <= len(str(a)) <= 6 and 1 <= len(str(b)) <= 6
        assert p.bucket == f"{max(len(str(a)), len(str(b)))}d"
    with pytest.raises(ValueError):
        t1.train_prompt(-1)


def test_addition_response_lengths_are_heterogeneous() -> None:
    task, tok = _addition(), build_char_tokenizer()
    lengths = [len(tok.encode(teacher_response(task.train_prompt(i)), add_special_tokens=False)) + 1 for i in range(500)]
    assert 9 <= min(lengths) <= 14 and 60 <= max(lengths) <= 70
    assert len(set(lengths)) > 20


def test_teacher_trace_format() -> None:
    p = Prompt("x", "Q:472+38\n", "510", "train", 0, "3d")
    assert teacher_response(p) == "10:47+3\n11:4+\n05:+\nA:510"
    assert teacher_response(Prompt("x", "Q:999999+999999\n", "1999998")).endswith("\n19:+\nA:1999998")
    assert teacher_response(Prompt("x", "Q:0+0\n", "0")) == "00:+\nA:0"


def test_addition_verifier_accepts_right_rejects_near_misses() -> None:
    task = _addition()
    p = Prompt("x", "Q:472+38\n", "510", "train", 0, "3d")
    right = teacher_response(p)
    assert right.endswith("\nA:510")
    assert task.verify(p, right) == Verdict(1.0, "510")
    assert task.verify(p, right + "\n").reward == 1.0  # trailing whitespace is not an answer
    assert task.verify(p, right + " ").reward == 1.0
    assert task.verify(p, "A:510").reward == 1.0  # steps are not graded, only the final answer
    near_misses = [
        right[:-1] + "1",  # off by one
        right[:-3] + "5100",  # extra digit
        right[:-3] + "51",  # dropped digit
        right[:-3] + "0510",  # leading zero
        right[:-3] + "410",  # wrong carry
        right + "\nA:511",  # a later, wrong final answer wins
        right + "0",
        right + "x",
        right.replace("A:", "A: "),
        right.replace("A:", "a:"),
        right.replace("\nA:", "A:"),  # final answer not on its own line
        right + "\n2+2",  # answer is not the last line
        "",
        "garbage",
        "A:",
        "A:-510",
        "A:510.0",
        "A:5 10",
    ]
    for resp in near_misses:
        assert task.verify(p, resp).reward == 0.0, resp
    assert task.verify(p, right[:-1] + "1").parsed == "511"
    assert task.verify(p, "garbage").parsed is None


def test_teacher_errors_are_near_misses_at_the_configured_rate() -> None:
    task = _addition()
    rng = random.Random(0)
    prompts = [task.train_prompt(i) for i in range(2000)]
    clean = [task.verify(p, teacher_response(p)).reward for p in prompts]
    assert all(r == 1.0 for r in clean)
    noisy = [task.verify(p, teacher_response(p, rng, 0.1)) for p in prompts]
    cols = [len(teacher_response(p).splitlines()) - 1 for p in prompts]  # one line per column + answer
    expected = sum(0.9**c for c in cols) / len(cols)
    acc = sum(v.reward for v in noisy) / len(noisy)
    assert abs(acc - expected) < 0.04
    # Wrong traces still end in a well-formed (wrong) answer: the verifier must reject them by value.
    assert all(v.parsed is not None for v in noisy)
