"""Step-by-step column addition: the embedded default task.

Prompt ``Q:472+38\n``. The expected response adds one column per line, right to left. Each line writes the
column's carry-out and sum digit, then what is left of the two operands once that column is consumed; the
last line is the final answer::

    10:47+3        2+8   = 10 -> carry 1, digit 0; 47 and 3 remain
    11:4+          7+3+1 = 11 -> carry 1, digit 1; 4 and nothing remain
    05:+           4+0+1 =  5 -> carry 0, digit 5; done
    A:510

Every input of a column sits at a fixed landmark of the line above (its first character is the carry, the
digits before ``+`` and before the newline are the next column's digits), so a tiny transformer can learn
the procedure from a few minutes of SFT; a format that reads the i-th digit from the right of the prompt
instead needs position counting that a 0.6M-parameter model does not learn in that budget. A response has
10 tokens (with EOS) for one-digit operands and up to 70 for two six-digit ones, so a batch mixes short and
long responses (the regime VAPO's length-adaptive GAE is for). The reward is 1 when the last line is exactly
``A:<a+b>`` (no leading zeros, nothing after it), else 0; the steps are not graded.

Held-out split: the unordered operand pair ``{a, b}`` is hashed with the task seed into ``eval_buckets``
buckets; bucket 0 is evaluation-only. Training draws skip bucket 0, so neither ``a+b`` nor ``b+a`` of an
evaluation item ever appears in training.

``teacher_response`` writes the expected trace, optionally with wrong column sums (the imperfect teacher
the SFT bootstrap learns from, so that the base policy leaves room for RL).
"""

from __future__ import annotations

import random
import re

from common.config import TaskConfig
from common.tasks.base import Prompt, Task, Verdict, final_answer, in_eval_bucket, stable_hash

_MAX_DRAWS = 1000  # a training index that keeps landing in the eval bucket this often means eval_buckets=1


class AdditionTask(Task):
    name = "addition"

    def __init__(self, cfg: TaskConfig) -> None:
        if not 1 <= cfg.min_digits <= cfg.max_digits:
            raise ValueError(f"addition: need 1 <= min_digits <= max_digits, got {cfg.min_digits}, {cfg.max_digits}")
        if cfg.eval_buckets < 2:
            raise ValueError(f"addition: eval_buckets must be >= 2 (bucket 0 is held out), got {cfg.eval_buckets}")
        self.min_digits = cfg.min_digits
        self.max_digits = cfg.max_digits
        self.eval_buckets = cfg.eval_buckets
        self.eval_size = cfg.eval_size
        self.seed = cfg.seed
        self._eval: list[Prompt] | None = None

    # ------------------------------------------------------------------------------------ items

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        def number() -> int:
            nd = rng.randint(self.min_digits, self.max_digits)
            return rng.randint(0, 9) if nd == 1 else rng.randint(10 ** (nd - 1), 10**nd - 1)

        return number(), number()

    def is_eval_pair(self, a: int, b: int) -> bool:
        lo, hi = min(a, b), max(a, b)
        return in_eval_bucket(self.seed, self.eval_buckets, f"{lo}+{hi}")

    def _prompt(self, a: int, b: int, split: str, index: int) -> Prompt:
        cols = max(len(str(a)), len(str(b)))
        return Prompt(
            prompt_id=f"addition:{split}:{index}",
            text=f"Q:{a}+{b}\n",
            answer=str(a + b),
            split=split,
            index=index,
            bucket=f"{cols}d",
        )

    def train_prompt(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"train_prompt: index must be >= 0, got {index}")
        for attempt in range(_MAX_DRAWS):
            a, b = self._draw(random.Random(stable_hash(self.seed, "train", index, attempt)))
            if not self.is_eval_pair(a, b):
                return self._prompt(a, b, "train", index)
        raise RuntimeError(f"addition: no training pair found for index {index}; is the operand space too small?")

    def eval_prompts(self) -> list[Prompt]:
        if self._eval is None:
            rng = random.Random(stable_hash(self.seed, "eval"))
            seen: set[tuple[int, int]] = set()
            out: list[Prompt] = []
            # Small operand spaces (max_digits=1) hold fewer eval pairs than eval_size: stop after a bound.
            for _ in range(max(self.eval_size, 1) * 200):
                if len(out) >= self.eval_size:
                    break
                a, b = self._draw(rng)
                key = (min(a, b), max(a, b))
                if key in seen or not self.is_eval_pair(a, b):
                    continue
                seen.add(key)
                out.append(self._prompt(a, b, "eval", len(out)))
            if not out:
                raise RuntimeError("addition: the held-out split is empty; widen the digit range")
            self._eval = out
        return list(self._eval)

    # ------------------------------------------------------------------------------------ verifier

    @staticmethod
    def parse(response: str) -> str | None:
        """The final answer string: the last line must be ``A:<digits>`` (trailing whitespace allowed)."""
        ans = final_answer(response)
        return ans if ans is not None and re.fullmatch(r"[0-9]+", ans) else None

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        parsed = self.parse(response)
        return Verdict(reward=1.0 if parsed is not None and parsed == prompt.answer else 0.0, parsed=parsed)

    def teacher_response(self, prompt: Prompt, rng: random.Random | None = None, error_rate: float = 0.0) -> str:
        return teacher_response(prompt, rng, error_rate)


# ---------------------------------------------------------------------------------------- teacher


def operands(prompt: Prompt) -> tuple[int, int]:
    m = re.fullmatch(r"Q:(\d+)\+(\d+)\n", prompt.text)
    if m is None:
        raise ValueError(f"not an addition prompt: {prompt.text!r}")
    return int(m.group(1)), int(m.group(2))


def teacher_response(prompt: Prompt, rng: random.Random | None = None, error_rate: float = 0.0) -> str:
    """The column-by-column trace for ``prompt``; each column sum is off by one with prob ``error_rate``.

    A wrong column propagates like a human slip: its written digit and carry follow the wrong sum, so the
    final answer of a trace with an error is wrong (and consistent with the trace).
    """
    a, b = operands(prompt)
    ra, rb = str(a), str(b)
    lines: list[str] = []
    digits: list[int] = []
    carry = 0
    while ra or rb:
        s = (int(ra[-1]) if ra else 0) + (int(rb[-1]) if rb else 0) + carry
        if error_rate > 0 and rng is not None and rng.random() < error_rate:
            s = s + 1 if s == 0 else s - 1 if s == 19 else s + rng.choice((-1, 1))
        ra, rb = ra[:-1], rb[:-1]
        carry = s // 10
        digits.append(s % 10)
        lines.append(f"{carry}{s % 10}:{ra}+{rb}")
    if carry:
        digits.append(carry)
    answer = str(int("".join(str(d) for d in reversed(digits))))
    return "\n".join(lines) + f"\nA:{answer}"
