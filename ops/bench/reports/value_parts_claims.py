"""The numbers the value_parts reading quotes, taken from the study's summary (so from its ledger) and never
typed by hand: the hand-written reading (``docs/results/value_parts_notes.md``) writes ``{{kind|...}}`` where a
number goes, and the report fills it in (``fill``). The claims other pages quote (README, docs/CRITIC.md) are
checked against the same ``fill`` by tests/ops/bench/reports/test_value_parts_claims.py. Kinds:

- ``{{d|<difference>|<column>}}``: a seed-blocked difference a − b in points of held-out avg@8, ± its standard
  error, with df and p (``paired.fmt``), read where the table reads it; ``{{own|...}}`` at the pair's own budget;
- ``{{drange|<a − b>|<column>}}``: the smallest and largest of that pair's differences over every regime;
- ``{{acc|<arm>|<column>}}``: an arm's mean accuracy (3 decimals);
- ``{{xg|<arm without g>|<G>}}``: an arm's mean accuracy at the study's common generated-token budget;
- ``{{ev|<arm>|<pretrain_ev, rl_ev or oracle_ev>}}``: an arm's mean critic reading (2 decimals);
- ``{{xgbudget}}``: that common budget, in millions of tokens;
- ``{{budget|<G>|<column>}}`` and ``{{ownbudget|<difference>|<column>}}``: where a column is read (tokens and
  passes in millions, seconds whole).

``<column>``: final, samples, gen, learner, critic, policy, wall. ``bare_numbers`` lists what a template still
says in digits outside ``{{...}}`` beyond the study's fixed design (G, α, seeds, steps), for a test to reject.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from ops.bench.reports import paired

CLAIM = re.compile(r"\{\{([^{}]+)\}\}")
COLUMNS = {"final": "final", "samples": "at_equal_samples", "gen": "at_equal_gen_tokens",
           "learner": "at_equal_learner_passes", "critic": "at_equal_critic_passes",
           "policy": "at_equal_policy_passes", "wall": "at_equal_wall_s"}
# Digits a reading may write itself: the study's design, not its results.
DESIGN = re.compile(r"G = (2|16)\b|α = (1|0\.05)\b|\b(3|three) seeds\b|\b40 steps\b|avg@8|\bdf 2\b|\b78 runs\b|"
                    r"\bg(2|16)\b|\ba(1|0\.05)\b|\b256\b|\b26 arms\b|p < 0\.05|"
                    r"\b4\.3 standard errors|\b32B\b")  # 4.3: t's 97.5% point at df 2; 32B: the paper's model
NUMBER = re.compile(r"\d")


def _budget(value: float, column: str) -> str:
    return f"{value:.0f} s" if column == "wall" else f"{value / 1e6:.2f}M"


def value(summary: dict[str, Any], claim: str) -> str:
    """The text of one claim (the inside of ``{{...}}``); KeyError/ValueError for a claim the summary lacks."""
    kind, *args = [a.strip() for a in claim.split("|")]
    if kind in ("d", "own"):
        d = summary["differences"][args[0]]["paired" if kind == "d" else "own"][COLUMNS[args[1]]]
        if d is None:
            raise KeyError(claim)
        return paired.fmt(d, scale=100, digits=1)
    if kind == "drange":  # the smallest and largest of one pair's differences over every regime
        ds = [d["paired"][COLUMNS[args[1]]]["diff"] for k, d in summary["differences"].items()
              if k.split(": ", 1)[1] == args[0]]
        return f"{min(ds) * 100:+.1f} to {max(ds) * 100:+.1f}"
    if kind == "acc":
        return f"{statistics.fmean(summary['arms'][args[0]][COLUMNS[args[1]]]):.3f}"
    if kind == "xg":
        return f"{statistics.fmean(summary['cross_g']['arms'][args[0]][int(args[1])].values()):.3f}"
    if kind == "ev":
        return f"{statistics.fmean(summary['critic'][args[0]][args[1]]):.2f}"
    if kind == "xgbudget":
        return _budget(summary["cross_g"]["budget"], "gen")
    if kind == "budget":
        return _budget(summary["budgets"][int(args[0])][COLUMNS[args[1]].removeprefix("at_equal_")], args[1])
    if kind == "ownbudget":
        return _budget(summary["differences"][args[0]]["own_budgets"][COLUMNS[args[1]].removeprefix("at_equal_")],
                       args[1])
    raise ValueError(f"unknown claim kind {kind!r} in {{{{{claim}}}}}")


def fill(template: str, summary: dict[str, Any]) -> str:
    """``template`` with every ``{{...}}`` replaced by its ``value``."""
    return CLAIM.sub(lambda m: value(summary, m.group(1)), template)


def bare_numbers(template: str) -> list[str]:
    """The lines of ``template`` that still hold a digit once its claims and its design's numbers are taken out."""
    out = []
    for line in template.splitlines():
        rest = DESIGN.sub("", CLAIM.sub("", line))
        if NUMBER.search(rest):
            out.append(line)
    return out
