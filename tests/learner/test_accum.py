"""learner.accum: token-weighted means, totals and maxima over micro-batches (one process: the reduction over
ranks is the identity), with hand-computed values."""

from __future__ import annotations

import pytest

from learner.accum import Accum


def test_means_are_weighted_totals_summed_and_peaks_the_largest() -> None:
    a = Accum()
    a.add("loss", 2.0, weight=3)  # 3 tokens at 2.0
    a.add("loss", 6.0, weight=1)  # 1 token at 6.0: (6 + 6) / 4 = 3.0
    a.add("kl", 0.5)  # weight 1 by default
    a.total("tokens", 3)
    a.total("tokens", 1)
    a.peak("grad_norm", 1.5)
    a.peak("grad_norm", 0.25)
    out = a.reduce()
    assert out == pytest.approx({"loss": 3.0, "kl": 0.5, "tokens": 4.0, "grad_norm": 1.5})


def test_a_mean_without_weight_is_zero_and_an_empty_accum_reduces_to_nothing() -> None:
    a = Accum()
    a.add("entropy", 7.0, weight=0.0)  # a micro-batch without real tokens
    assert a.reduce() == {"entropy": 0.0}
    assert Accum().reduce() == {}
