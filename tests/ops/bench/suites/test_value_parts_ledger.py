"""ops.bench.suites.value_parts_ledger: a run's line replaces its earlier one, lines stay sorted by run, and an
absent ledger reads as no runs (the readings a line carries are tested through the suite's ``record``)."""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench.suites import value_parts_ledger as ledger


def test_a_runs_line_replaces_its_earlier_one_and_lines_stay_sorted(tmp_path: Path) -> None:
    path = tmp_path / "results" / "runs.jsonl"
    assert ledger.read(path) == {}
    ledger.write_row(path, {"run": "vp_g2_vapo_a1-s1", "seconds": 700.0})
    ledger.write_row(path, {"run": "vp_g2_dapo-s0", "seconds": 500.0})
    ledger.write_row(path, {"run": "vp_g2_vapo_a1-s1", "seconds": 650.0})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["run"] for r in lines] == ["vp_g2_dapo-s0", "vp_g2_vapo_a1-s1"]
    assert ledger.read(path)["vp_g2_vapo_a1-s1"]["seconds"] == 650.0
    assert not path.with_suffix(".tmp").exists()  # written whole, then moved into place


def test_an_unfinished_run_has_no_line(tmp_path: Path) -> None:
    (tmp_path / "vp_g2_dapo-s0").mkdir()
    assert ledger.run_row(tmp_path / "vp_g2_dapo-s0", "vp_g2_dapo-s0", 10.0) is None
