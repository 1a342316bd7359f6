"""common.tasks.jsonl_task: a question/answer file split into training and held-out prompts, verified by
value with math_verify (other notations of the same value count), from any thread; bad lines named."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from common.config import TaskConfig
from common.tasks import Prompt, Verdict, get_task


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
