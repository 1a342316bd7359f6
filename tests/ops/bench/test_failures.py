"""ops/bench/failures.py's figures from step times (worked by hand) and its scenario names; the runs
themselves are manual (minutes each)."""

from __future__ import annotations

import pytest

from ops.bench.failures import main, went_on


def test_a_run_that_went_on_is_judged_against_its_own_step_interval() -> None:
    # Steps 1 s apart, killed at t = 3.5, the next step 4 s after the one before it, then 1 s again.
    steps = [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0), (5, 7.0), (6, 8.0)]
    assert went_on(steps, 3.5) == {"interval_before_s": 1.0, "gap_s": 4.0, "cost_s": 3.0, "steps": 6}


def test_no_step_after_the_kill_gives_no_cost() -> None:
    assert went_on([(1, 0.0), (2, 2.0)], 5.0) == {"interval_before_s": 2.0, "gap_s": None, "cost_s": None,
                                                  "steps": 2}


def test_an_unknown_scenario_is_refused_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--only", "engine,disk"])
    assert e.value.code == 2 and "unknown scenario(s) ['disk']" in capsys.readouterr().err
