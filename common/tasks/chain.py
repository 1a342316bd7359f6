"""Long-horizon chain: add a digit modulo 10, step after step, counting down. The long-horizon task.

Prompt ``Q:3+7x05\n``: start at 3 and add 7 five times, modulo 10. The expected response writes one line
per step, ``<steps left after this one>:<value>+<increment>=<new value>`` (the counter has two digits),
then the final value::

    04:3+7=0        4 steps left after this one; 10 mod 10
    03:0+7=7
    02:7+7=4
    01:4+7=1
    00:1+7=8
    A:8

Each line copies its inputs next to each other (the previous line's result, the prompt's increment) and
adds them there, so a tiny transformer learns the procedure from a few minutes of SFT. (Two formats that
did not train in 400 SFT steps: writing only the new value, which needs the sum of two far-apart numbers,
and two-digit values modulo 100, whose tens digit needs the units' carry before it is written.) A
response is ``9n + 4`` tokens with EOS: the step count ``n`` is drawn log-uniformly from
``[min_steps, max_steps]`` (default 5-44, i.e. 49-400 tokens), so short responses are common and long
ones form a tail. One wrong line makes every later value
and the answer wrong, so a mistake can happen at any step and only the first one matters: the setting
where a value model that sees the mistake should assign credit better than a per-response baseline
(VAPO's claim for long chains of thought). The reward is 1 when the last line is exactly ``A:<x_n>``.

Held-out split: the item ``(start, increment, n)`` is hashed with the task seed into ``eval_buckets``
buckets; bucket 0 is evaluation-only and training draws skip it. Evaluation buckets by length:
``short`` (n < 10: under 94 tokens), ``medium`` (10 <= n < 20) and ``long`` (n >= 20: 184 tokens or more).

``teacher_response`` writes the trace; with probability ``error_rate`` per line it writes the sum one too
high and carries on from the wrong value (the imperfect teacher of the SFT bootstrap).
"""

from __future__ import annotations

import math
import random
import re

from common.config import TaskConfig
from common.tasks.base import Prompt, Task, Verdict, final_answer, in_eval_bucket, stable_hash

MODULUS = 10
_MAX_DRAWS = 1000
_PROMPT = re.compile(r"Q:(\d)\+(\d)x(\d\d)\n")


def length_bucket(steps: int) -> str:
    """short (< 10 lines, < 94 tokens), medium (10-19) or long (>= 20 lines, >= 184 tokens)."""
    return "short" if steps < 10 else "medium" if steps < 20 else "long"


class ChainTask(Task):
    name = "chain"

    def __init__(self, cfg: TaskConfig) -> None:
        if not 1 <= cfg.min_steps <= cfg.max_steps <= 99:
            raise ValueError(f"chain: need 1 <= min_steps <= max_steps <= 99, got {cfg.min_steps}, {cfg.max_steps}")
        if cfg.eval_buckets < 2:
            raise ValueError(f"chain: eval_buckets must be >= 2 (bucket 0 is held out), got {cfg.eval_buckets}")
        self.min_steps, self.max_steps = cfg.min_steps, cfg.max_steps
        self.eval_buckets, self.eval_size, self.seed = cfg.eval_buckets, cfg.eval_size, cfg.seed
        self._eval: list[Prompt] | None = None

    def _draw(self, rng: random.Random) -> tuple[int, int, int]:
        # Log-uniform step count: density ~ 1/n, so the long responses are a tail, not the bulk.
        lo, hi = self.min_steps, self.max_steps + 1
        n = min(int(math.exp(rng.uniform(math.log(lo), math.log(hi)))), self.max_steps)
        return rng.randrange(MODULUS), rng.randrange(1, MODULUS), n

    def is_eval_item(self, start: int, inc: int, n: int) -> bool:
        return in_eval_bucket(self.seed, self.eval_buckets, f"{start}+{inc}x{n}")

    def _prompt(self, start: int, inc: int, n: int, split: str, index: int) -> Prompt:
        return Prompt(prompt_id=f"chain:{split}:{index}", text=f"Q:{start}+{inc}x{n:02d}\n",
                      answer=str((start + n * inc) % MODULUS), split=split, index=index, bucket=length_bucket(n))

    def train_prompt(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"train_prompt: index must be >= 0, got {index}")
        for attempt in range(_MAX_DRAWS):
            item = self._draw(random.Random(stable_hash(self.seed, "train", index, attempt)))
            if not self.is_eval_item(*item):
                return self._prompt(*item, "train", index)
        raise RuntimeError(f"chain: no training item found for index {index}")

    def eval_prompts(self) -> list[Prompt]:
        if self._eval is None:
            rng = random.Random(stable_hash(self.seed, "eval"))
            seen: set[tuple[int, int, int]] = set()
            out: list[Prompt] = []
            for _ in range(max(self.eval_size, 1) * 200):
                if len(out) >= self.eval_size:
                    break
                item = self._draw(rng)
                if item in seen or not self.is_eval_item(*item):
                    continue
                seen.add(item)
                out.append(self._prompt(*item, "eval", len(out)))
            self._eval = out
        return list(self._eval)

    @staticmethod
    def parse(response: str) -> str | None:
        """The final value: the last line must be ``A:<one digit>`` (trailing whitespace allowed)."""
        ans = final_answer(response)
        return ans if ans is not None and re.fullmatch(r"[0-9]", ans) else None

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        parsed = self.parse(response)
        return Verdict(reward=1.0 if parsed is not None and parsed == prompt.answer else 0.0, parsed=parsed)

    def teacher_response(self, prompt: Prompt, rng: random.Random | None = None, error_rate: float = 0.0) -> str:
        return teacher_response(prompt, rng, error_rate)


def parse_prompt(prompt: Prompt) -> tuple[int, int, int]:
    m = _PROMPT.fullmatch(prompt.text)
    if m is None:
        raise ValueError(f"not a chain prompt: {prompt.text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def teacher_response(prompt: Prompt, rng: random.Random | None = None, error_rate: float = 0.0) -> str:
    """The trace for ``prompt``; each line's sum is one too high with probability ``error_rate``.

    A wrong line carries on from its wrong value, so the final answer of a trace with an error is wrong.
    Slips always overshoot: the answer is linear in the slips, so -1 and +1 slips would cancel and half of
    the two-slip traces would end in the right answer (rewarded despite their mistakes); with overshoots
only, ten slips are needed to cancel.
    """
    x, inc, n = parse_prompt(prompt)
    lines = []
    for left in range(n - 1, -1, -1):
        new = (x + inc) % MODULUS
        if error_rate > 0 and rng is not None and rng.random() < error_rate:
            new = (new + 1) % MODULUS
        lines.append(f"{left:02d}:{x}+{inc}={new}")
        x = new
    return "\n".join(lines) + f"\nA:{x}"


# --------------------------------------------------------------------------------------- the oracle's state
# What a critic that knows the task could know at each state of a response: how many step lines are left
# to write and whether a mistake has been made already (every later value is then wrong). It cannot foresee
# a slip, so an intact prefix is worth the chance of writing the remaining lines right.

LINE_CHARS = 9  # "kk:x+i=y\n"
RESULT_COL = 7  # where a line's result digit sits (the column a slip changes)


def correct_trace(prompt_text: str) -> str:
    """The error-free response to ``Q:<start>+<inc>x<nn>\\n`` (without EOS)."""
    return teacher_response(Prompt(prompt_id="", text=prompt_text, answer="", split="", index=0))


def lines_left(trace: str, written: int) -> int:
    """Step lines of ``trace`` whose result digit is not among the first ``written`` characters."""
    n_lines = trace.count("\n")  # one newline per step line; the answer line has none
    return sum(1 for i in range(n_lines) if LINE_CHARS * i + RESULT_COL >= written)


def first_mistake(trace: str, response: str, stopped: bool) -> int | None:
    """Index of the first character where ``response`` leaves ``trace``; ``len(trace)`` when it ran on past the
    end or stopped (``stopped``: the EOS came) before it; None when it is still on the trace."""
    for j, (a, b) in enumerate(zip(response, trace, strict=False)):
        if a != b:
            return j
    if len(response) > len(trace) or (stopped and len(response) < len(trace)):
        return min(len(response), len(trace))
    return None


def oracle_value(trace: str, prefix: str, line_accuracy: float) -> float:
    """P(reward 1 | prefix) for a policy that writes each remaining line right with ``line_accuracy``:
    0 once the prefix has left the trace, else line_accuracy ** (step lines left)."""
    if first_mistake(trace, prefix, stopped=False) is not None:
        return 0.0
    return float(line_accuracy ** lines_left(trace, len(prefix)))


def line_outcome(trace: str, response: str, stopped: bool) -> tuple[int, int]:
    """(step lines written right before the first mistake, 1 if there is a mistake else 0): one response's
    share of the line accuracy p = 1 − mistakes / (lines right + mistakes)."""
    j = first_mistake(trace, response, stopped)
    end = len(response) if j is None else j
    right = len(trace.split("\n")[:-1]) - lines_left(trace, end)
    return right, int(j is not None)
