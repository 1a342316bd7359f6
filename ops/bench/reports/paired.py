"""Seed-blocked (paired) differences between two arms of a study whose arms share their seeds: the mean of the
per-seed differences, its standard error, degrees of freedom and the two-sided p of a paired t test. Every arm
of a seed starts from the same base evaluation, so the seed effect cancels in a paired difference; an unpaired
(Welch) σ counts it twice. Used by ``ops.bench.reports.value_parts_report`` (no scipy here: Student's t CDF
for whole degrees of freedom has a closed form, ``t_two_sided_p``).
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

SEED = re.compile(r"-s(\d+)$")  # a suite run's name ends in its seed: vp_g2_vapo_a1-s0


def seed_of(run_name: str) -> int:
    """The seed a suite run's name ends with."""
    m = SEED.search(run_name)
    if m is None:
        raise ValueError(f"no seed in run name {run_name!r}")
    return int(m.group(1))


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| ≥ |t|) for Student's t with ``df`` (≥ 1, whole) degrees of freedom: 1 − A(t|df), with A the
    finite cosine series of Abramowitz & Stegun 26.7.3 (odd df) and 26.7.4 (even df), θ = atan(|t|/√df)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be ≥ 1, got {df}")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd
        series, term = 0.0, math.cos(theta)
        for k in range(1, (df - 1) // 2 + 1):  # cos θ, (2/3)cos³θ, (2·4)/(3·5)cos⁵θ, ...
            series += term
            term *= c2 * (2 * k) / (2 * k + 1)
        a = 2 / math.pi * (theta + math.sin(theta) * series)
    else:
        series, term = 0.0, 1.0
        for k in range(1, df // 2 + 1):  # 1, (1/2)cos²θ, (1·3)/(2·4)cos⁴θ, ...
            series += term
            term *= c2 * (2 * k - 1) / (2 * k)
        a = math.sin(theta) * series
    return min(1.0, max(0.0, 1.0 - a))


def paired(a: dict[int, float], b: dict[int, float]) -> dict[str, Any] | None:
    """mean over the seeds both arms have of a − b, its standard error (sd of the per-seed differences / √n),
    df = n − 1 and the paired t test's two-sided p (None with one seed, or with every difference equal and
    nonzero: p 0.0). None when no seed is shared."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    d = [a[s] - b[s] for s in seeds]
    mean = statistics.fmean(d)
    out: dict[str, Any] = {"diff": mean, "se": None, "df": len(d) - 1, "p": None, "seeds": seeds}
    if len(d) > 1:
        se = statistics.stdev(d) / math.sqrt(len(d))
        out["se"] = se
        out["p"] = t_two_sided_p(mean / se, len(d) - 1) if se > 0 else (1.0 if mean == 0 else 0.0)
    return out


def fmt(d: dict[str, Any] | None, scale: float = 1.0, digits: int = 3) -> str:
    """``+d ± se (df k, p x)``, the numbers times ``scale`` (100: points); "—" for none."""
    if d is None:
        return "—"
    head = f"{d['diff'] * scale:+.{digits}f}"
    if d["se"] is None:
        return f"{head} (one seed)"
    return f"{head} ± {d['se'] * scale:.{digits}f} (df {d['df']}, p {p_text(d['p'])})"


def p_text(p: float) -> str:
    """p to two significant figures, small ones as < 0.001."""
    return "< 0.001" if p < 0.001 else f"{p:.2g}"
