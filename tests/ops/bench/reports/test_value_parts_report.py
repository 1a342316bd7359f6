"""ops.bench.reports.value_parts_report: the suite's section of RESULTS.md from hand-made runs, spliced in once (before
the value study's section the first time, in place after) with its plots, and marked partial."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.bench.reports import value_parts_report as report
from ops.bench.suites import value_parts_suite as vp
from tests.ops.bench.bench_fixtures import value_parts_run as _run


def test_the_section_is_spliced_in_once_with_its_tables_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vp, "LEDGER", tmp_path / "kept.jsonl")
    monkeypatch.setattr(vp, "NOTES", tmp_path / "notes.md")
    (tmp_path / "notes.md").write_text("### Reading\n\nhand-written, kept as it is\n")
    runs = tmp_path / "runs"
    _run(runs, "g2_vapo_a1", 0, [0.4, 0.5, 0.6], pretrain_ev=[0.2], rl_ev=[0.3, 0.5])
    _run(runs, "g2_vapo_a1", 1, [0.4, 0.6, 0.8], pretrain_ev=[0.4], rl_ev=[0.5, 0.7])
    _run(runs, "g2_dapo", 0, [0.4, 0.45, 0.5])
    out = tmp_path / "docs" / "RESULTS.md"
    out.parent.mkdir()
    out.write_text("# Results\n\nbefore\n\n<!-- value study: generated -->\nthe value study\n")
    summary = vp.summary(runs)
    vp.report(runs, summary, out)
    text = out.read_text()
    assert text.index(report.BEGIN) < text.index(report.END) < text.index("<!-- value study:")
    assert "**Runs so far: 3 of 78**" in text and "Partial: arms with all 3 seeds: G = 2, 0 of 13; G = 16, 0 of 13." in text
    assert text.index("Partial:") < text.index("### Reading\n\nhand-written, kept as it is\n") < text.index("### Arms")
    # VAPO 0.6 and 0.8 (mean 0.7, sd 0.141), DAPO 0.5 (one seed): 0.2 apart, σ = sqrt(0.02 / 2) = 0.1, 2 σ.
    assert "| g2_vapo_a1 | 0.700 ± 0.141 (2) |" in text and "| g2_dapo | 0.500 (1) |" in text
    assert "| g2 a1: vapo − dapo | as shipped | +0.200 ± 0.100, 2.0 σ (n 2/1) |" in text
    assert "g2 a0.05" not in text  # no run of that regime yet
    # EV after pretraining 0.2 and 0.4 (sd 0.141); on the RL batches means 0.4 and 0.6 (sd 0.141); no oracle.
    assert "| g2_vapo_a1 | 0.300 ± 0.141 (2) | 0.500 ± 0.141 (2) | — |" in text
    assert "| g2_dapo | — |" not in text  # no critic: no row
    png = out.parent / "results" / "value_parts_g2_a1.png"
    assert png.stat().st_size > 1000 and "](results/value_parts_g2_a1.png)" in text
    assert not (out.parent / "results" / "value_parts_g16_a1.png").exists()
    vp.report(runs, summary, out)
    assert out.read_text() == text  # re-made in place, nothing added


def test_a_wall_time_difference_across_cpu_types_is_marked(tmp_path: Path) -> None:
    """Runs on different CPUs are comparable on every axis but wall time. VAPO ran on CPU A, DAPO and VAPO
    without the NLL on CPU B, every step 10 s: VAPO − DAPO is marked on its wall-time column alone (0.6 − 0.5 at
    the 20 s every run reached), VAPO-without-NLL − DAPO, one CPU type, nowhere."""
    runs = tmp_path / "runs"
    _run(runs, "g2_vapo_a1", 0, [0.4, 0.5, 0.6], cpu="CPU A")
    _run(runs, "g2_dapo", 0, [0.4, 0.45, 0.5], cpu="CPU B")
    _run(runs, "g2_vapo_nonll_a1", 0, [0.4, 0.5, 0.55], cpu="CPU B")
    summary = vp.summary(runs, ledger=tmp_path / "none.jsonl")
    assert summary["machines"] == ["CPU A", "CPU B"]
    assert summary["differences"]["g2 a1: vapo − dapo"]["cpus"] == ["CPU A", "CPU B"]
    assert summary["differences"]["g2 a1: vapo_nonll − dapo"]["cpus"] == ["CPU B"]
    rows = {r.strip("| ").split(" | ")[0]: r.strip("| ").split(" | ")[2:] for r in report.difference_table(summary)}
    assert report.READ[-1] == "at_equal_wall_s"
    assert [c.endswith(report.CPUS_DIFFER) for c in rows["g2 a1: vapo − dapo"]] == [False] * 4 + [True]
    assert rows["g2 a1: vapo − dapo"][-1] == "+0.100 ± 0.000, σ unknown (one seed a side) (n 1/1); CPUs differ"
    assert not any(c.endswith(report.CPUS_DIFFER) for c in rows["g2 a1: vapo_nonll − dapo"])
