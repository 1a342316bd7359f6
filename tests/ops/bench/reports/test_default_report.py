"""ops/bench/reports/default_report.py: the default suite's tables and plots, and a re-made report that keeps the
other suites' sections (from hand-made run directories)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from ops.bench.reports import value_parts_report, value_study_report
from ops.bench.suites import long_suite
from tests.ops.bench.bench_fixtures import load_experiments, make_run


@pytest.fixture(scope="module")
def exp() -> ModuleType:
    return load_experiments()


def test_report_tables_and_plots(exp: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for s, top in enumerate((0.8, 0.7, 0.75)):
        make_run(root / f"vapo-s{s}", {0: 0.45, 20: 0.6, 40: 0.7, 60: top})
    make_run(root / "grpo-s0", {0: 0.45, 20: 0.55, 40: 0.6, 60: 0.65})
    make_run(root / "stale0-s0", {0: 0.45, 20: 0.6, 40: 0.7}, step_s=20.0)
    make_run(root / "grpo_sync-s0", {0: 0.45, 20: 0.55, 40: 0.6}, step_s=20.0)
    make_run(root / "no_nll-s0", {0: 0.45, 20: 0.5, 40: 0.55})
    notes = tmp_path / "notes.md"
    notes.write_text("## Reading\nhand-written")
    out = tmp_path / "docs" / "RESULTS.md"
    text = exp.write_report(root, out, notes)
    assert out.read_text() == text and "## Reading\nhand-written" in text
    assert "| VAPO (near-frozen critic) | 3 | 0.750 ± 0.050 (0.700–0.800) |" in text
    assert "| GRPO | 1 | 0.650 ± 0.000 (0.650–0.650) |" in text and "not reached" in text
    assert "| DAPO | 0 | not run yet |" in text
    assert "**0.700 ± 0.000**" in text  # VAPO at step 40 over 3 seeds
    assert "| VAPO − positive-example NLL<br>`nll.coef=0` | 0 (1 seed) | 0.550 | -0.150 |" in text
    # vapo steps take 10 s, the synchronous run 20 s: async is 2x the sync throughput.
    assert "| 1 (default) | 3 | 3.2 | 2.00× | 0.50 | 9.50 |" in text and "| 0 (sync) | 1 | 1.6 | 1.00× |" in text
    assert "| max_staleness=1 | 1 | 3.2 | 2.00× | 0.600 |" in text
    for png in ("baselines_samples", "baselines_trained", "baselines_time", "ablations", "staleness_time"):
        assert (out.parent / "results" / f"{png}.png").stat().st_size > 5000


def test_remade_default_report_keeps_the_other_suites_sections(exp: ModuleType, tmp_path: Path) -> None:
    """The long suite, the value parts and the value study write their own sections of RESULTS.md; re-making the
    default tables replaces only those tables and keeps the three sections, in their order."""
    blocks = [f"{begin}\n{name} reading\n{end}\n" for name, begin, end in (
        ("long", long_suite.BEGIN, long_suite.END), ("parts", value_parts_report.BEGIN, value_parts_report.END),
        ("study", value_study_report.BEGIN, value_study_report.END))]
    out = tmp_path / "RESULTS.md"
    out.write_text("# Results\n\nold default tables\n\n" + "\n".join(blocks))
    make_run(tmp_path / "runs" / "vapo-s0", {0: 0.45, 60: 0.8})
    exp.write_report(tmp_path / "runs", out, tmp_path / "no-notes.md")
    text = out.read_text()
    where = [text.find(b) for b in blocks]
    assert "old default tables" not in text and -1 not in where and where == sorted(where)
