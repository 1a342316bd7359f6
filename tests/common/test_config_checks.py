"""common.config_checks: the first broken rule named by its key (choices, then item choices, then the checks in
order), reward names, and the evaluation sets' entries."""

from __future__ import annotations

import pytest

from common.config import Config, TaskConfig
from common.config_checks import first_problem, named_rewards, reward_name_problem
from common.config_sections import EvalSetConfig


def test_the_defaults_break_no_rule() -> None:
    assert first_problem(Config()) is None


def test_a_choice_is_named_with_its_allowed_values_before_any_other_problem() -> None:
    cfg = Config()
    cfg.metrics.trackers = ["tensorboard", "mlflow"]
    assert first_problem(cfg) == "metrics.trackers: 'mlflow' is not one of tensorboard, wandb"
    cfg.actors.weight_sync = "later"  # a plain choice comes before an item choice
    assert first_problem(cfg) == "actors.weight_sync: 'later' is not one of wait, abort"


def test_evaluation_sets_need_safe_unique_names_a_path_and_non_negative_sizes() -> None:
    cfg = Config()
    cfg.task.eval_sets = [EvalSetConfig(name="gsm8k", path="a.jsonl"), EvalSetConfig(name="gsm8k", path="b.jsonl")]
    assert first_problem(cfg) == "task.eval_sets: set names must be unique; repeated: gsm8k"
    cfg.task.eval_sets = [EvalSetConfig(name="heldout", path="a.jsonl")]
    assert (first_problem(cfg) or "").startswith("task.eval_sets[0].name: 'heldout': needs 1-64 of")
    cfg.task.eval_sets = [EvalSetConfig(name="math", path="", k=2)]
    assert (first_problem(cfg) or "").startswith("task.eval_sets[0].path: must name the set's file")
    cfg.task.eval_sets = [EvalSetConfig(name="math", path="m.jsonl", k=-1)]
    assert first_problem(cfg) == "task.eval_sets[0].k: must be >= 0 (0 = learner.eval_k)"


@pytest.mark.parametrize("name", ["", "boxed", "answer_line", "exact", "file:rewards.py:score", "file:/a:b.py:f_1"])
def test_reward_names_that_are_allowed(name: str) -> None:
    assert reward_name_problem(name) is None


@pytest.mark.parametrize(
    "name, needle",
    [("file:rewards.py", "expected file:<path>:<function>"), ("file::f", "expected file:<path>:<function>"),
     ("file:r.py:1f", "expected file:<path>:<function>"), ("gsm8k", "is not a reward: use ''")],
)
def test_reward_names_that_are_refused_say_why(name: str, needle: str) -> None:
    assert needle in (reward_name_problem(name) or "")


def test_the_named_rewards_leave_out_the_tasks_own_verifier() -> None:
    task = TaskConfig(reward="boxed", reward_by_source={"a": "", "b": "exact", "c": "boxed"})
    assert named_rewards(task) == {"boxed", "exact"}
    assert named_rewards(TaskConfig()) == set()
