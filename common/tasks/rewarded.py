"""A task whose responses are scored by the rewards the config names (``task.reward``, ``task.reward_by_source``)
instead of, or beside, its own verifier.

``get_task`` wraps the task in ``RewardedTask`` when the config names any reward. A prompt's reward is the
one ``task.reward_by_source`` gives its ``data_source``, else ``task.reward``; '' is the task's own
``verify`` (in the calling process, as without the wrapper). Every other name runs in a guarded process pool
(``common.reward_pool``, started on the first response it scores, so a process that only reads prompts starts
none): the built-ins ``boxed``, ``answer_line``, ``exact`` (``common.tasks.reward_rules``) and a user's
``file:<path>:<function>`` with verl's signature. Actors (training) and the learner's evaluation both score
through ``verify_batch``, so evaluation scores exactly as training does.

The reward range: a failed call (``timeout``, ``exception``, ``memory``, ``crash``, ``bad_value``) scores 0,
which the config requires inside [``task.reward_min``, ``task.reward_max``]; a value outside that range is
clipped into it and counted as ``out_of_range`` (the buffer would refuse the whole group otherwise, and a
function's -1 for a wrong answer still ranks below a right one). Each ends up in the ``Verdict``'s ``error``.

Not a CLI; ``python -m pytest tests/common/tasks/test_rewarded.py``.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from common.config import REWARD_BUILTINS, TaskConfig, named_rewards
from common.reward_pool import ERROR_KINDS, RateLimitedLog, RewardCall, RewardPool
from common.tasks.base import Prompt, Task, Verdict

log = logging.getLogger("vapo.reward")

REWARD_ERROR_KINDS = (*ERROR_KINDS, "out_of_range")
_RULES_MODULE = "common.tasks.reward_rules"


def pool_function(name: str) -> str:
    """The pool's name for a reward name: ``module:`` for a built-in, ``file:`` with an absolute path."""
    if name in REWARD_BUILTINS:
        return f"module:{_RULES_MODULE}:{name}"
    path, _, function = name[len("file:"):].rpartition(":")
    return f"file:{Path(path).expanduser().resolve()}:{function}"


class RewardedTask(Task):
    """``base``'s prompts, scored by the configured rewards (see the module docstring)."""

    def __init__(self, base: Task, cfg: TaskConfig) -> None:
        self.base, self.name = base, base.name
        self.default, self.by_source = cfg.reward, dict(cfg.reward_by_source)
        self.reward_min, self.reward_max = cfg.reward_min, cfg.reward_max
        functions = sorted({pool_function(n) for n in named_rewards(cfg)})
        self.pool = RewardPool(functions, workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s,
                               memory_mb=cfg.reward_memory_mb)
        self._out_of_range = RateLimitedLog(log, 10.0)

    def __getattr__(self, name: str) -> Any:
        # What a particular task offers beyond the interface (the chain task's oracle values) stays reachable.
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def train_prompt(self, index: int) -> Prompt:
        return self.base.train_prompt(index)

    def eval_prompts(self) -> list[Prompt]:
        return self.base.eval_prompts()

    def teacher_response(self, prompt: Prompt, rng: random.Random | None = None, error_rate: float = 0.0) -> str:
        return self.base.teacher_response(prompt, rng, error_rate)

    def fit_context(self, tokenizer: Any, max_prompt_tokens: int) -> None:
        self.base.fit_context(tokenizer, max_prompt_tokens)  # the prompts are the base task's

    def reward_name(self, prompt: Prompt) -> str:
        """The reward name that scores ``prompt`` ('' = the task's own verifier)."""
        return self.by_source.get(prompt.data_source, self.default)

    def verify_blocks(self, prompt: Prompt) -> bool:
        return bool(self.reward_name(prompt))

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        return self.verify_batch(prompt, [response])[0]

    def verify_batch(self, prompt: Prompt, responses: list[str]) -> list[Verdict]:
        name = self.reward_name(prompt)
        if not name:
            return self.base.verify_batch(prompt, responses)
        function = pool_function(name)
        calls = [RewardCall(function, prompt.data_source, r, prompt.answer, prompt.extra_info) for r in responses]
        return [self._verdict(prompt, name, res.score, res.extra, res.error) for res in self.pool.score(calls)]

    def _verdict(self, prompt: Prompt, name: str, score: float, extra: dict[str, float], error: str) -> Verdict:
        clipped = min(max(score, self.reward_min), self.reward_max)
        if clipped != score and not error:
            self._out_of_range.warn(name, "reward %s (data_source %r) gave %g outside [task.reward_min, "
                                    "task.reward_max] = [%g, %g]; clipped to %g", name, prompt.data_source, score,
                                    self.reward_min, self.reward_max, clipped)
            error = "out_of_range"
        return Verdict(clipped, None, extra, error)

    def close(self) -> None:
        self.pool.close()
        self.base.close()


__all__ = ["REWARD_ERROR_KINDS", "RewardedTask", "pool_function"]
