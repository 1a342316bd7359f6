"""common.tasks.reward_rules: the built-in rewards on hand-worked responses."""

from __future__ import annotations

import pytest

from common.tasks.reward_rules import answer_line, answer_line_text, boxed, exact, normalise_answer


@pytest.mark.parametrize(("response", "truth", "want"), [
    ("so the sum is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # math-verify: the same number however written
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
    ("first \\boxed{4} then \\boxed{3}", "4", 0.0),
    ("\\boxed{x^{2}}", "x^2", 1.0),
    ("no box, Answer: 7", "7", 1.0),  # the jsonl verifier's fallback: a final one-line Answer:
    ("no answer at all", "7", 0.0),
    ("\\boxed{41}", "42", 0.0),
])
def test_boxed_is_the_jsonl_check(response: str, truth: str, want: float) -> None:
    assert boxed("any", response, truth, None) == want


@pytest.mark.parametrize(("response", "truth", "want"), [
    ("work...\nAnswer: 42", "42", 1.0),
    ("answer: 42\nmore text", "42", 1.0),  # any case; the line ends the answer, not the response
    ("Answer: 41\nwait, Answer: 42", "42", 1.0),  # the last one counts
    ("Answer: 42\nActually Answer: 41", "42", 0.0),
    ("Answer: $x = 42$", "42", 1.0),  # the right-hand side, without math delimiters
    ("Answer: \\boxed{\\text{12}} dollars.", "12", 1.0),
    ("Answer: 1,000", "1000", 1.0),  # thousands separators
    ("Answer: 1,2", "12", 0.0),  # a list, not a number
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", 1.0),
    ("Answer: 0.5", "\\frac{1}{2}", 0.0),  # no symbolic maths: strings after normalising
    ("Answer: 90^\\circ", "90", 1.0),
    ("Answer:", "42", 0.0),
    ("The result is 42", "42", 0.0),  # no Answer: line
])
def test_answer_line_is_dapos_rule(response: str, truth: str, want: float) -> None:
    assert answer_line("any", response, truth, None) == want


def test_answer_line_text_and_normalisation() -> None:
    assert answer_line_text("a\nAnswer:  x \nb") == "x "
    assert answer_line_text("none") is None
    assert normalise_answer(" $\\text{5}$ ways. ") == "5"
    assert normalise_answer("y = 3x + 1") == "3x+1"


@pytest.mark.parametrize(("response", "truth", "want"), [
    ("42", "42", 1.0), (" 42\n", "42", 1.0), ("42.0", "42", 0.0), ("4 2", "42", 0.0), ("", "", 1.0),
])
def test_exact_is_stripped_equality(response: str, truth: str, want: float) -> None:
    assert exact("any", response, truth, None) == want
