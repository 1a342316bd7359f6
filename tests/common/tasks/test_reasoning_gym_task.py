"""common.tasks.reasoning_gym_task: a reasoning_gym generator as a task: disjoint held-out items,
deterministic training items past one chunk, answers verified inside <answer> tags only."""

from __future__ import annotations

from common.config import TaskConfig
from common.tasks import Verdict, get_task


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
