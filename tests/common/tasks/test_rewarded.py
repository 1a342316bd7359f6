"""common.tasks.rewarded: the reward the config names scores a prompt by its data_source, through the pool;
the task's own verifier stays the default; out-of-range values are clipped and counted; evaluation scores
as training does; the config refuses what it cannot run."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from common.modeling import build_char_tokenizer
from common.tasks import Prompt, get_task
from common.tasks.addition import AdditionTask
from common.tasks.rewarded import RewardedTask
from learner.eval_score import score

USER = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return {"score": 0.5 if ground_truth in solution_str else 0.0, "length": len(solution_str)}

    def negative(data_source, solution_str, ground_truth, extra_info):
        return 1.0 if solution_str.strip() == ground_truth else -1.0

    def hang(data_source, solution_str, ground_truth, extra_info):
        while True:
            pass
''')


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "r.py").write_text(USER)
    lines = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(40)]
    (tmp_path / "qa.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    return tmp_path


@pytest.fixture
def rewarded(files: Path) -> Iterator[RewardedTask]:
    by_source = {"plain": "exact", "user": f"file:{files}/r.py:compute_score", "neg": f"file:{files}/r.py:negative",
                 "stuck": f"file:{files}/r.py:hang"}
    cfg = load_config(None, [f"task.name=jsonl:{files}/qa.jsonl", "task.reward_timeout_s=1",
                             f"task.reward_by_source={json.dumps(by_source)}"])
    task = get_task(cfg.task)
    assert isinstance(task, RewardedTask)
    yield task
    task.close()


def _prompt(source: str, answer: str = "42") -> Prompt:
    return Prompt(f"p-{source}", "question", answer, data_source=source, extra_info='{"id": 1}')


def test_without_a_reward_the_task_verifies_itself(files: Path) -> None:
    task = get_task(load_config(None, []).task)
    assert isinstance(task, AdditionTask)  # unwrapped: every existing run scores as it did
    p = task.train_prompt(3)
    assert task.verify_batch(p, [f"A:{p.answer}", "A:0"]) == [task.verify(p, f"A:{p.answer}"), task.verify(p, "A:0")]
    assert not task.verify_blocks(p)


def test_each_data_source_gets_its_reward(rewarded: RewardedTask) -> None:
    responses = ["42", "it is 42", "\\boxed{42}"]
    assert [v.reward for v in rewarded.verify_batch(_prompt("plain"), responses)] == [1.0, 0.0, 0.0]  # exact
    user = rewarded.verify_batch(_prompt("user"), responses)
    assert [v.reward for v in user] == [0.5, 0.5, 0.5] and user[1].extra == {"length": 8.0}
    # a source with no entry: task.reward '' = the jsonl task's own math-verify check
    assert [v.reward for v in rewarded.verify_batch(_prompt("other"), responses)] == [0.0, 0.0, 1.0]
    assert rewarded.verify_blocks(_prompt("plain")) and not rewarded.verify_blocks(_prompt("other"))
    assert rewarded.verify(_prompt("plain"), "42").reward == 1.0


def test_the_prompts_are_the_tasks(rewarded: RewardedTask, files: Path) -> None:
    plain = get_task(load_config(None, [f"task.name=jsonl:{files}/qa.jsonl"]).task)
    assert rewarded.train_prompt(5) == plain.train_prompt(5) and rewarded.eval_prompts() == plain.eval_prompts()
    assert rewarded.name == plain.name


def test_the_prompts_fitted_to_the_context_are_the_tasks(files: Path) -> None:
    """A user's data set wrapped in a reward: fitting the context drops its too-long rows, as unwrapped."""
    rows = [{"question": f"Q:{i}+1\n", "answer": str(i + 1)} for i in range(20)]
    rows[6]["question"] = "Q:" + "1+" * 30 + "1\n"  # 64 tokens with BOS
    (files / "own.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"task.name=dataset:{files}/own.jsonl", "task.reward=exact"])
    task, plain = get_task(cfg.task), get_task(dataclasses.replace(cfg.task, reward=""))
    assert isinstance(task, RewardedTask) and not isinstance(plain, RewardedTask)
    try:
        for t in (task, plain):
            t.fit_context(build_char_tokenizer(), 40)
        assert [task.train_prompt(i) for i in range(40)] == [plain.train_prompt(i) for i in range(40)]
        assert rows[6]["question"] not in {task.train_prompt(i).text for i in range(40)}
    finally:
        task.close()


def test_out_of_range_is_clipped_and_counted_and_a_failure_is_zero(rewarded: RewardedTask) -> None:
    got = rewarded.verify_batch(_prompt("neg"), ["42", "41"])
    assert [(v.reward, v.error) for v in got] == [(1.0, ""), (0.0, "out_of_range")]
    stuck = rewarded.verify_batch(_prompt("stuck"), ["42"])
    assert [(v.reward, v.error) for v in stuck] == [(0.0, "timeout")]


def test_evaluation_scores_through_the_same_rewards(rewarded: RewardedTask) -> None:
    tok = build_char_tokenizer()
    prompts = [_prompt("plain"), _prompt("user")]
    sampled = [[tok.encode(r, add_special_tokens=False) for r in ("42", "x")] for _ in prompts]
    rep = score(rewarded, tok, prompts, sampled, None, [tok.eos_token_id])
    assert rep["avg_at_k"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.0) / 4)


def test_the_config_checks_reward_names(files: Path) -> None:
    with pytest.raises(ConfigError, match="task.reward: 'boxd' is not a reward"):
        load_config(None, ["task.reward=boxd"])
    with pytest.raises(ConfigError, match=r"task.reward_by_source\['s'\]"):
        load_config(None, ["task.reward_by_source={s: 'file:r.py'}"])
    with pytest.raises(ConfigError, match="task.reward_by_source: expected a mapping"):
        load_config(None, ["task.reward_by_source=[a, b]"])
    with pytest.raises(ConfigError, match="reward_min <= 0"):
        load_config(None, ["task.reward=exact", "task.reward_min=0.5"])
    cfg_file = files / "c.yaml"
    cfg_file.write_text("task:\n  reward: answer_line\n  reward_by_source:\n    openai/gsm8k: boxed\n")
    task_cfg = load_config(cfg_file, []).task
    assert (task_cfg.reward, task_cfg.reward_by_source) == ("answer_line", {"openai/gsm8k": "boxed"})
    assert dataclasses.replace(task_cfg).reward_by_source == {"openai/gsm8k": "boxed"}
    with pytest.raises(ValueError, match="reward file not found"):
        get_task(load_config(None, [f"task.reward=file:{files}/missing.py:f"]).task)
