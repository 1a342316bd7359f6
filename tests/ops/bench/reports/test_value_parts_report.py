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
    (tmp_path / "notes.md").write_text("### Reading\n\nhand-written, kept as it is: {{acc|g2_vapo_a1|final}}\n")
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
    # the reading's claim is filled from the summary: VAPO's mean final accuracy
    assert text.index("Partial:") < text.index("### Reading\n\nhand-written, kept as it is: 0.700\n") < text.index("### Arms")
    # VAPO 0.6 and 0.8 (mean 0.7, sd 0.141), DAPO 0.5 (seed 0 only): seed-blocked, seed 0 alone, 0.6 − 0.5.
    assert "| g2_vapo_a1 | 0.700 ± 0.141 (2) |" in text and "| g2_dapo | 0.500 (1) |" in text
    assert "| g2 a1: vapo − dapo | as shipped | +0.100 (one seed) |" in text
    assert " σ" not in text.split("### Arms")[1]  # no "N σ" anywhere in the tables
    # across G at the generated tokens every run reached (G = 16 has none yet)
    assert "| vapo_a1 | 0.700 ± 0.141 (2) | — | — |" in text and "| dapo | 0.500 (1) | — | — |" in text
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
    assert rows["g2 a1: vapo − dapo"][-1] == "+0.100 (one seed); CPUs differ"
    assert not any(c.endswith(report.CPUS_DIFFER) for c in rows["g2 a1: vapo_nonll − dapo"])


def test_a_pair_is_also_read_at_its_own_budget_and_seed_blocked(tmp_path: Path) -> None:
    """Three arms at G = 2 on seeds 0 and 1, every step the same samples: DAPO without its filter stops after one
    evaluation step (samples 256), so the regime's equal samples are its 256, where VAPO reads 0.5 and 0.6 and DAPO
    0.45 and 0.5 (seed-blocked: +0.05 and +0.10, mean +0.075, se 0.025, df 1). At the pair's own budget (both
    reach 512) VAPO reads 0.7 and 0.8, DAPO 0.5 and 0.55: +0.20 and +0.25, mean +0.225, se 0.025."""
    runs = tmp_path / "runs"
    _run(runs, "g2_vapo_a1", 0, [0.4, 0.5, 0.7])
    _run(runs, "g2_vapo_a1", 1, [0.4, 0.6, 0.8])
    _run(runs, "g2_dapo", 0, [0.4, 0.45, 0.5])
    _run(runs, "g2_dapo", 1, [0.4, 0.5, 0.55])
    _run(runs, "g2_dapo_nofilter", 0, [0.4, 0.42])
    summary = vp.summary(runs, ledger=tmp_path / "none.jsonl")
    d = summary["differences"]["g2 a1: vapo − dapo"]
    assert summary["budgets"][2]["samples"] == d["own_budgets"]["samples"] / 2
    assert d["paired"]["at_equal_samples"]["diff"] == pytest.approx(0.075)
    assert d["paired"]["at_equal_samples"]["se"] == pytest.approx(0.025) and d["paired"]["at_equal_samples"]["df"] == 1
    assert d["own"]["at_equal_samples"]["diff"] == pytest.approx(0.225)
    assert d["own"]["final"] == d["paired"]["final"]
    # the tables' generated-tokens column reads the same (2560 tokens a step); t = 9 at df 1: p = 1 − (2/π)·atan 9
    rows = {r.split(" | ")[0]: r.split(" | ")[2:] for r in report.difference_table(summary, "own")}
    assert report.READ[1] == "at_equal_gen_tokens"
    assert rows["| g2 a1: vapo − dapo"][1] == "+0.225 ± 0.025 (df 1, p 0.07)"
    rows = {r.split(" | ")[0]: r.split(" | ")[2:] for r in report.difference_table(summary)}
    assert rows["| g2 a1: vapo − dapo"][1] == "+0.075 ± 0.025 (df 1, p 0.2)"


def test_provenance_lists_each_commit_and_the_runs_started_with_uncommitted_changes() -> None:
    made = [{"run": "vp_a-s0", "commit": "c0ffee1234567", "dirty": False},
            {"run": "vp_a-s1", "commit": "c0ffee1234567", "dirty": True},
            {"run": "vp_b-s0", "commit": "beef", "dirty": None}]
    lines = report.provenance(made)
    assert "| `c0ffee1234` | 2 | 1: vp_a-s1 |" in lines and "| `beef` | 1 | 0 |" in lines
    assert lines[-1] == "1 ledger lines do not say whether their tree was clean."


def test_opt_in_runs_are_counted_apart_and_get_their_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One study run and one opt-in run: the study counts 1 of its 78, the opt-in arms 1 of their 30, with
    their own row, difference against VAPO (0.75 − 0.6 on seed 0) and plot line."""
    monkeypatch.setattr(vp, "LEDGER", tmp_path / "kept.jsonl")
    monkeypatch.setattr(vp, "NOTES", tmp_path / "no-notes.md")
    runs = tmp_path / "runs"
    _run(runs, "g2_vapo_a1", 0, [0.4, 0.5, 0.6])
    _run(runs, "g2_paper_frozen_a1", 0, [0.4, 0.55, 0.75])
    out = tmp_path / "RESULTS.md"
    vp.report(runs, vp.summary(runs), out)
    text = out.read_text()
    assert "**Runs so far: 1 of 78**" in text and "**Opt-in arms so far: 1 of 42 runs**" in text
    assert "| g2_paper_frozen_a1 | 0.750 (1) |" in text
    assert "| g2 a1: paper_frozen − vapo | the paper's critic training, surprise from a frozen base LM head | +0.150 (one seed) |" in text
    assert "| paper_frozen_a1 | 0.750 (1) | — | — |" in text  # across G: no G = 16 run yet
    assert "| paper_frozen a1 | +0.150 (one seed) | — | no |" in text  # one seed at one G: not the default
