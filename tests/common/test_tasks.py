"""Task registry: held-out split disjointness, verifier strictness, determinism, and the other task kinds."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest

from common.config import TaskConfig
from common.modeling import build_char_tokenizer
from common.tasks import Prompt, Verdict, decode_response, encode_prompt, get_task
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


def test_encode_and_decode_round_trip_with_char_tokenizer() -> None:
    tok = build_char_tokenizer()
    task = _addition()
    p = task.eval_prompts()[0]
    ids = encode_prompt(tok, p)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]) == p.text
    resp = teacher_response(p)
    out = tok.encode(resp, add_special_tokens=False) + [tok.eos_token_id, 5, 6]
    assert decode_response(tok, out) == resp  # cut at EOS
    assert task.verify(p, decode_response(tok, out)).reward == 1.0
    # Every character of every prompt and trace has its own token (the char tokenizer drops unknown ones).
    for i in range(300):
        q = task.train_prompt(i)
        for text in (q.text, teacher_response(q, random.Random(i), 0.5)):
            assert len(tok.encode(text, add_special_tokens=False)) == len(text)


def test_get_task_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        get_task(TaskConfig(name="nope"))
    with pytest.raises(ValueError, match="eval_buckets"):
        get_task(TaskConfig(eval_buckets=1))
    with pytest.raises(ValueError, match="unknown generator"):
        get_task(TaskConfig(name="reasoning_gym:no_such_generator"))
    with pytest.raises(ValueError, match="not found"):
        get_task(TaskConfig(name="jsonl:/no/such/file.jsonl"))


# --------------------------------------------------------------------------------------------- jsonl


def _write_jsonl(path: Path, n: int) -> Path:
    rows = [{"question": f"What is {i} halves plus one quarter, item {i}?", "answer": f"\\frac{{{2 * i + 1}}}{{4}}"} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_task_split_and_math_verify(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "qa.jsonl", 200)
    task = get_task(TaskConfig(name=f"jsonl:{path}", eval_size=8))
    held = task.eval_prompts()
    assert len(held) == 8
    held_q = {p.text for p in held}
    train = [task.train_prompt(i) for i in range(400)]
    assert not held_q & {p.text for p in train}
    assert train[0] == task.train_prompt(0)
    # Equal values in other notations count; near misses and missing answers do not.
    p = Prompt("q", "x", "\\frac{3}{4}", "train", 1)
    assert task.verify(p, "so the result is \\boxed{\\frac{3}{4}}").reward == 1.0
    assert task.verify(p, "so \\boxed{0.75}").reward == 1.0
    assert task.verify(p, "Answer: 3/4").reward == 1.0
    assert task.verify(p, "\\boxed{0.76}").reward == 0.0
    assert task.verify(p, "\\boxed{\\frac{4}{3}}").reward == 0.0
    assert task.verify(p, "three quarters") == Verdict(0.0, None)
    assert task.verify(p, "\\boxed{0.75}").parsed == "0.75"


def test_jsonl_task_verify_works_off_the_main_thread(tmp_path: Path) -> None:
    task = get_task(TaskConfig(name=f"jsonl:{_write_jsonl(tmp_path / 'qa.jsonl', 50)}"))
    p = Prompt("q", "x", "42", "train", 0)
    results: list[float] = []
    th = threading.Thread(target=lambda: results.append(task.verify(p, "\\boxed{42}").reward))
    th.start()
    th.join(timeout=60)
    assert results == [1.0]


def test_jsonl_task_rejects_bad_lines(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match=":1:"):
        get_task(TaskConfig(name=f"jsonl:{bad}"))


# ------------------------------------------------------------------------------------- reasoning_gym


def test_reasoning_gym_task() -> None:
    task = get_task(TaskConfig(name="reasoning_gym:basic_arithmetic", eval_size=16, eval_buckets=5))
    held = task.eval_prompts()
    assert len(held) == 16
    held_q = {p.text for p in held}
    train = [task.train_prompt(i) for i in range(400)]
    assert not held_q & {p.text for p in train}
    assert task.train_prompt(7) == train[7]
    for p in train[:5] + held[:5]:
        assert task.verify(p, f"thinking...\n<answer>{p.answer}</answer>") == Verdict(1.0, p.answer)
        assert task.verify(p, f"<answer>{p.answer}1</answer>").reward == 0.0
        assert task.verify(p, p.answer).reward == 0.0  # no answer tags: unparseable
    assert task.train_prompt(10_000 + 3).text != task.train_prompt(3).text  # past one chunk, new items
