"""Task registry: prompts, held-out split and verifiers (``get_task(cfg.task)``).

Tasks: ``addition`` (embedded default, step-by-step column addition), ``chain`` (the long-horizon
miniature: a modular sum repeated 8-66 times, one line per step), ``reasoning_gym:<generator>``
(reasoning-gym's procedural generators and checkers), ``jsonl:<path>`` (question/answer lines checked
with math-verify) and ``dataset:<path>`` (a user's own .jsonl, .parquet or ``datasets.save_to_disk`` rows,
string or chat prompts; docs/DATA.md). See ``common.tasks.base`` for the interface and the prompt encoding
every part shares; ``fit_task`` drops the prompts too long for the run's engines, with the run's tokenizer.

When the config names a reward (``task.reward``, ``task.reward_by_source``) the task comes wrapped in
``common.tasks.rewarded.RewardedTask``, which scores through those rewards (built-ins or a user's function in a
guarded process pool); without one, the task verifies its responses itself, as it always has.
"""

from __future__ import annotations

from typing import Any

from common.config import Config, TaskConfig, named_rewards
from common.limits import model_shape
from common.tasks.addition import AdditionTask
from common.tasks.base import Prompt, Task, Verdict, decode_response, encode_prompt, stable_hash
from common.tasks.chain import ChainTask
from common.tasks.rewarded import REWARD_ERROR_KINDS, RewardedTask

__all__ = ["REWARD_ERROR_KINDS", "Prompt", "Task", "Verdict", "decode_response", "encode_prompt", "fit_task",
           "get_task", "prompt_token_budget", "stable_hash"]


def get_task(cfg: TaskConfig) -> Task:
    """Build the task named by ``cfg.name`` (raises ValueError with the choices on a bad name), wrapped in
    ``RewardedTask`` when the config names a reward."""
    task = _named_task(cfg)
    return RewardedTask(task, cfg) if named_rewards(cfg) else task


def _named_task(cfg: TaskConfig) -> Task:
    name = cfg.name
    if name == "addition":
        return AdditionTask(cfg)
    if name == "chain":
        return ChainTask(cfg)
    if name.startswith("reasoning_gym:"):
        from common.tasks.reasoning_gym_task import ReasoningGymTask  # noqa: PLC0415 - reasoning_gym takes seconds to import; only its tasks pay them

        return ReasoningGymTask(name.split(":", 1)[1], cfg)
    if name.startswith("jsonl:"):
        from common.tasks.jsonl_task import JsonlTask  # noqa: PLC0415 - math_verify loads sympy; only jsonl tasks pay for it

        return JsonlTask(name.split(":", 1)[1], cfg)
    if name.startswith("dataset:"):
        from common.tasks.dataset_task import DatasetTask  # noqa: PLC0415 - pyarrow and math_verify; only dataset tasks pay for them

        return DatasetTask(name.split(":", 1)[1], cfg)
    raise ValueError(f"unknown task {name!r}; use addition | chain | reasoning_gym:<generator> | jsonl:<path> | dataset:<path>")


def prompt_token_budget(cfg: Config) -> int:
    """The longest prompt, in tokens, an engine of the run accepts: its context (``engine.context_length``,
    else model.path's max_position_embeddings) less ``actors.max_new_tokens``; 0 when the context is unknown."""
    context = cfg.engine.context_length or model_shape(cfg.model.path)[1]
    return max(context - cfg.actors.max_new_tokens, 1) if context > 0 else 0


def fit_task(task: Task, cfg: Config, tokenizer: Any) -> None:
    """``task.fit_context`` with the run's prompt budget: every process that draws or evaluates prompts calls
    it with the model's tokenizer, so all of them see the same rows (ValueError under task.bad_rows=error)."""
    task.fit_context(tokenizer, prompt_token_budget(cfg))
