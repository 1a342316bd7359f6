"""ops/bench/measure.py: rounds interleaved ABBA and repeated to their minimum length, quartiles, the verdict
from the interquartile range against the goal, figures' medians and ranges, the CPU's model and flags; every
expected value derived by hand."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from ops.bench.measure import (
    MIN_ROUNDS,
    EventWindow,
    Rounds,
    Run,
    Timed,
    combined_verdict,
    cpu_model_and_flags,
    figures,
    interleave,
    quartiles,
    rotate,
    summarise,
    verdict,
)


def logged_side(calls: list[str], name: str, work: float, seconds: float) -> Callable[[int], Timed]:
    """A side that does ``work`` in ``seconds`` per call and logs each call as ``<name><round>``."""
    def run(r: int) -> Timed:
        calls.append(f"{name}{r}")
        return Timed(work=work, seconds=seconds)
    return run


def test_interleave_alternates_which_side_runs_first_and_repeats_a_side_to_the_round_length() -> None:
    calls: list[str] = []
    side = partial(logged_side, calls, work=10)

    # baseline rounds take 1 s per call (3 calls to reach 2.5 s), subject 2 s (2 calls)
    rounds = interleave(side("b", seconds=1.0), side("s", seconds=2.0), rounds=2, min_round_s=2.5)
    assert calls == ["b0", "b0", "b0", "s0", "s0", "s1", "s1", "b1", "b1", "b1"]
    assert rounds.first == ["baseline", "subject"]
    assert rounds.baseline == [Timed(30, 3.0)] * 2 and rounds.subject == [Timed(20, 4.0)] * 2
    assert rounds.rate_ratios() == [0.5, 0.5]  # 20/4 = 5 per s over 30/3 = 10 per s
    assert rounds.time_ratios() == [2.0, 2.0]  # 0.2 s per unit over 0.1 s


def test_rotate_turns_the_order_by_one_each_round_and_keeps_each_side_to_the_round_length() -> None:
    calls: list[str] = []
    side = partial(logged_side, calls, work=6)
    seen: list[int] = []
    rounds = rotate({"a": side("a", seconds=1.0), "b": side("b", seconds=3.0), "c": side("c", seconds=2.0)}, rounds=4, min_round_s=2.0,
                    on_round=lambda r, t: seen.append(r))
    assert calls == ["a0", "a0", "b0", "c0",  "b1", "c1", "a1", "a1",  "c2", "a2", "a2", "b2",  "a3", "a3", "b3", "c3"]
    assert seen == [0, 1, 2, 3]
    # each round's sides are named in the order given, whatever order they ran in
    assert all(list(t) == ["a", "b", "c"] for t in rounds)
    assert rounds[1] == {"a": Timed(12, 2.0), "b": Timed(6, 3.0), "c": Timed(6, 2.0)}


def test_a_side_runs_once_when_no_minimum_and_a_zero_rate_has_ratio_zero() -> None:
    rounds = interleave(lambda r: Timed(4, 2.0), lambda r: Timed(0, 1.0), rounds=1)
    assert rounds.rate_ratios() == [0.0]
    assert Rounds([Timed(1, 0.0)], [Timed(1, 1.0)], ["baseline"]).rate_ratios() == [0.0]


def test_quartiles_by_the_inclusive_method() -> None:
    assert quartiles([5.0, 1.0, 3.0, 2.0, 4.0]) == (2.0, 4.0)
    assert quartiles([1.0, 2.0]) == (1.25, 1.75)  # 1 + 0.25 x (2 - 1), 1 + 0.75 x (2 - 1)
    assert quartiles([0.7]) == (0.7, 0.7)


def test_verdict_passes_fails_or_is_unclear_by_where_the_interquartile_range_lies() -> None:
    # quartiles of each list: (0.6, 0.8), (0.2, 0.4), (0.4, 0.6)
    assert verdict([0.5, 0.6, 0.7, 0.8, 0.9], 0.5) == "pass"  # one round at the goal, all IQR above
    assert verdict([0.1, 0.2, 0.3, 0.4, 0.9], 0.5) == "fail"  # one round above the goal does not save it
    assert verdict([0.3, 0.4, 0.5, 0.6, 0.7], 0.5) == "unclear"
    assert verdict([0.1, 0.6, 0.7, 0.8, 0.9], 0.5) == "pass"  # one load spike does not flip the verdict
    assert verdict([1.0, 1.5, 1.8, 1.9, 3.0], 2.0, higher_is_better=False) == "pass"  # IQR (1.5, 1.9)
    assert verdict([1.0, 2.5, 2.6, 2.7, 3.0], 2.0, higher_is_better=False) == "fail"  # IQR (2.5, 2.7)
    assert verdict([0.9, 0.9], 0.5) == "unclear"  # too few rounds to judge
    assert verdict([0.9] * MIN_ROUNDS, 0.5) == "pass"


def test_summarise_gives_median_rounds_range_iqr_goal_and_verdict() -> None:
    s = summarise([0.42, 0.55, 0.61, 0.48, 0.7], 0.5, name="ingest_over_raw_lmdb")
    assert s["ratio_name"] == "ingest_over_raw_lmdb"
    assert s["ratio"] == 0.55  # sorted: 0.42 0.48 0.55 0.61 0.7
    assert s["ratio_rounds"] == [0.42, 0.55, 0.61, 0.48, 0.7]
    assert s["ratio_range"] == [0.42, 0.7] and s["ratio_iqr"] == [0.48, 0.61]
    assert s["goal"] == ">= 0.5" and s["goal_value"] == 0.5 and s["higher_is_better"] is True
    assert s["verdict"] == "unclear"  # Q1 0.48 below, Q3 0.61 above
    assert summarise([1.0, 1.2], 2.0, higher_is_better=False)["goal"] == "<= 2"
    empty = summarise([], 0.5)  # nothing measured: no figures, no verdict
    assert (empty["ratio"], empty["ratio_rounds"], empty["verdict"], empty["goal"]) == (None, [], "unclear", ">= 0.5")


def test_figures_take_median_and_range_of_numbers_every_round_has() -> None:
    rounds = [{"a": 1.0, "b": True, "c": "x", "d": 3}, {"a": 3.0, "b": False, "c": "y", "d": 1},
              {"a": 2.0, "b": True, "c": "z"}]
    assert figures(rounds) == {"a": 2.0, "a_range": [1.0, 3.0]}  # d is missing from one round
    assert figures([]) == {}


def test_combined_verdict_of_rows() -> None:
    assert combined_verdict(["pass", "pass"]) == "pass"
    assert combined_verdict(["pass", "unclear"]) == "unclear"
    assert combined_verdict(["unclear", "fail"]) == "fail"
    assert combined_verdict([]) == "unclear"


def test_cpu_model_and_vector_flags_from_cpuinfo() -> None:
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_2 avx avx2 fma\n"
            "processor\t: 1\nmodel name\t: other\nflags\t\t: avx512f amx_tile\n")
    assert cpu_model_and_flags(text, "x86_64") == ("AMD EPYC 7B13", ["sse4_2", "fma", "avx", "avx2"])
    assert cpu_model_and_flags("", "x86_64") == ("x86_64", [])


def test_run_common_fields() -> None:
    f = Run(quick=True).common_fields()
    assert f["quick"] is True and f["machine"]["cpus"] >= 1 and f["machine"]["cpu"]
    assert len(f["load_at_start"]) == 3 and len(f["load_at_end"]) == 3 and f["wall_s"] >= 0


def test_event_window_opens_and_closes_on_events() -> None:
    # waves of 16 every 4 s from t = 1; start 2, 6 s: opens at the wave at 5 (not counted), closes at the
    # first wave 6 s later or more, at 13: the waves at 9 and 13 in 8 s
    w = EventWindow(start=2.0, seconds=6.0)
    assert [w.add(t, 16.0) for t in (1.0, 5.0, 9.0, 13.0, 17.0)] == [False, False, False, True, True]
    assert w.timed(now=20.0) == Timed(32.0, 8.0)
    # a wave in three commits 0.1 s apart, the window opening mid-burst (at 5.1): counted 5.2, the wave at 9
    # and the commit at 13.0 that closes it (>= 5.1 + 6), 5 commits in 7.9 s
    w = EventWindow(start=5.05, seconds=6.0)
    for t in (5.0, 5.1, 5.2, 9.0, 9.1, 9.2, 13.0, 13.1, 13.2):
        w.add(t, 4.0)
    assert w.timed(now=14.0) == Timed(4.0 * 5, 13.0 - 5.1)
    open_only = EventWindow(start=0.0, seconds=5.0)
    open_only.add(1.0, 3.0)
    open_only.add(2.0, 3.0)
    assert not open_only.done and open_only.timed(now=4.0) == Timed(3.0, 3.0)  # not closed: up to now
    assert EventWindow(start=1.0, seconds=5.0).timed(now=3.0) == Timed(0.0, 2.0)  # no event at all
