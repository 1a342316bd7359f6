"""The built-in reward rules ``task.reward`` names: ``boxed``, ``answer_line``, ``exact``.

Each has verl's reward-function signature, ``rule(data_source, solution_str, ground_truth, extra_info) ->
float`` (1.0 right, 0.0 wrong), so the reward pool (``common.reward_pool``) runs them exactly as it runs a
user's ``compute_score``:

- ``boxed``: the ``jsonl:`` task's own check (``common.tasks.jsonl_task``): the last ``\\boxed{...}`` of the
  response (else a final one-line ``Answer:``) compared with the reference by math-verify, so ``1/2``,
  ``0.5`` and ``\\frac{1}{2}`` all match. In a pool worker it runs on the main thread, where math-verify's
  own parse and verify timeouts work.
- ``answer_line``: DAPO's rule. The answer is what follows the last ``Answer:`` (any case) up to the end
  of that line; both it and the reference are normalised (``normalise_answer``) and must then be equal as
  strings. No symbolic maths: ``0.5`` and ``1/2`` differ. DAPO scores a wrong answer -1; here it is 0,
  inside the default ``task.reward_min``/``reward_max`` of [0, 1].
- ``exact``: the stripped response equals the stripped reference.

Not a CLI; ``python -m pytest tests/common/tasks/test_reward_rules.py`` checks each rule on hand-worked cases.
"""

from __future__ import annotations

import re
from typing import Any

_ANSWER = re.compile(r"answer\s*:[ \t]*([^\n]*)", re.IGNORECASE)
# Words that only name a unit or a kind of count ("5 dollars", "12 ways"): they do not change the answer.
_UNIT_WORDS = ("square", "ways", "integers", "dollars", "mph", "inches", "feet", "ft", "hours", "minutes",
               "km", "cm", "meters", "units", "points", "digits", "cents", "degrees", "pounds", "students")
_UNITS = re.compile(r"(?<![A-Za-z\\])(?:" + "|".join(_UNIT_WORDS) + r")(?![A-Za-z])")
_TEX_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|boxed|fbox)\{([^{}]*)\}")
_TEX_SPACING = re.compile(r"\\[,;:! ]|\\quad|\\qquad|\\left|\\right")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def normalise_answer(text: str) -> str:
    """A final answer in a canonical spelling, so that surface differences do not decide correctness.

    Only the right-hand side of an equation counts (``x = 5`` is ``5``); math delimiters, TeX spacing and
    ``\\text{}``/``\\boxed{}`` wrappers go (their content stays); ``\\dfrac``/``\\tfrac`` are ``\\frac``;
    degree signs, unit words and trailing full stops go; all whitespace goes; a number written with
    thousands separators loses them (``1,000`` is ``1000``, while ``1,2`` stays a list)."""
    s = text.strip().split("=")[-1]
    s = s.replace("$", "").replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    s = _TEX_SPACING.sub(" ", s)
    for _ in range(3):  # wrappers nest (\boxed{\text{5}}): peel a few layers
        s = _TEX_WRAPPERS.sub(r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("°", "")
    s = _UNITS.sub("", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


def answer_line_text(response: str) -> str | None:
    """What follows the response's last ``Answer:`` on its line (None when there is none)."""
    found = _ANSWER.findall(response)
    return found[-1] if found else None


def answer_line(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """DAPO's rule: the normalised last ``Answer:`` line equals the normalised reference (see the module)."""
    given = answer_line_text(solution_str)
    if given is None:
        return 0.0
    pred = normalise_answer(given)
    return 1.0 if pred and pred == normalise_answer(str(ground_truth)) else 0.0


def exact(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """The stripped response is the stripped reference."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def boxed(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """The ``jsonl:`` task's verifier: math-verify on the last ``\\boxed{}`` (see the module)."""
    from common.tasks.jsonl_task import extract_final, math_equal  # noqa: PLC0415 - math_verify loads sympy; only boxed pays for it

    parsed = extract_final(solution_str)
    if not parsed:
        return 0.0
    return 1.0 if math_equal(str(ground_truth), parsed) else 0.0


__all__ = ["answer_line", "answer_line_text", "boxed", "exact", "normalise_answer"]
