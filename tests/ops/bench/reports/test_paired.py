"""ops.bench.reports.paired: Student's t two-sided p against the printed table's critical values, and a
seed-blocked difference worked by hand."""

from __future__ import annotations

import math

import pytest

from ops.bench.reports import paired


@pytest.mark.parametrize(("t", "df"), [(12.706, 1), (4.303, 2), (3.182, 3), (2.776, 4), (2.571, 5), (2.228, 10),
                                       (2.086, 20)])
def test_the_t_tables_two_sided_five_percent_points_give_p_five_percent(t: float, df: int) -> None:
    assert paired.t_two_sided_p(t, df) == pytest.approx(0.05, abs=2e-4)
    assert paired.t_two_sided_p(-t, df) == paired.t_two_sided_p(t, df)


def test_t_p_at_its_closed_forms_and_edges() -> None:
    # df 1 is Cauchy: p = 1 − (2/π)·atan|t|; df 2: p = 1 − |t|/√(2 + t²).
    assert paired.t_two_sided_p(1.0, 1) == pytest.approx(0.5)
    assert paired.t_two_sided_p(3.0, 2) == pytest.approx(1 - 3 / math.sqrt(11))
    assert paired.t_two_sided_p(9.925, 2) == pytest.approx(0.01, abs=1e-4)
    assert paired.t_two_sided_p(0.0, 3) == 1.0 and paired.t_two_sided_p(math.inf, 2) == 0.0
    with pytest.raises(ValueError):
        paired.t_two_sided_p(1.0, 0)


def test_a_seed_blocked_difference_cancels_the_seed_effect() -> None:
    """Seeds start at 0.40, 0.50, 0.60 (a seed effect of 0.2); a leads b by 0.10, 0.12, 0.14 on them. Unpaired,
    each arm's sd is ~0.1 and the 0.12 difference is lost in it; paired, the differences' sd is 0.02, se
    0.02/√3, t = 0.12/(0.02/√3) ≈ 10.4 with df 2: p ≈ 0.009. A seed only one arm has is left out."""
    b = {0: 0.40, 1: 0.50, 2: 0.60}
    a = {0: 0.50, 1: 0.62, 2: 0.74, 3: 0.99}
    d = paired.paired(a, b)
    assert d is not None and d["seeds"] == [0, 1, 2] and d["df"] == 2
    assert d["diff"] == pytest.approx(0.12) and d["se"] == pytest.approx(0.02 / math.sqrt(3))
    assert d["p"] == pytest.approx(paired.t_two_sided_p(0.12 / (0.02 / math.sqrt(3)), 2)) and 0.008 < d["p"] < 0.01
    assert paired.fmt(d, scale=100, digits=1) == "+12.0 ± 1.2 (df 2, p 0.0091)"
    one = paired.paired({0: 0.6}, {0: 0.5, 1: 0.4})
    assert one is not None and one["se"] is None and paired.fmt(one) == "+0.100 (one seed)"
    assert paired.paired({0: 0.5}, {1: 0.5}) is None and paired.fmt(None) == "—"
    assert paired.p_text(0.0004) == "< 0.001"


def test_a_run_names_seed() -> None:
    assert paired.seed_of("vp_g2_vapo_a0.05-s2") == 2
    with pytest.raises(ValueError):
        paired.seed_of("vp_g2_vapo_a0.05")
