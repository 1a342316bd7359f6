"""ops/report.py with the metrics.jsonl header: the summary says what produced the run; readers skip it."""

from __future__ import annotations

import json
from pathlib import Path

from common.config import load_config
from learner.records import append_jsonl, write_header
from ops import report  # ops/report.py

ROOT = Path(__file__).resolve().parents[2]


def _steps(path: Path, first: int, last: int) -> None:
    for s in range(first, last + 1):
        append_jsonl(path, {"kind": "learner_step", "step": s, "weight_version": s, "samples": 8, "time": 100.0 + s,
                            "reward_mean": 0.5})


def test_header_comes_first_and_the_summary_carries_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}", "learner.threads=1"])
    path = cfg.run_dir / "metrics.jsonl"
    first = write_header(cfg)
    append_jsonl(path, {"kind": "eval", "step": 0, "avg_at_k": 0.25, "greedy_accuracy": 0.5})
    _steps(path, 1, 2)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["resumed"] is False
    assert lines[0]["threads"]["learner"] == 1 and lines[0]["base"]["path"] == str(tiny_model_dir)
    s = report.summarize(cfg.run_dir)
    # The header is not a step, an evaluation or a rate: the figures are those of a run without it.
    assert s["steps"] == 2 and s["samples"] == 16 and s["base_accuracy"] == 0.25
    assert s["provenance"]["commit"] == first["commit"] and s["provenance"]["cpu"] == first["cpu"]
    assert "provenance_resumes" not in s
    again = write_header(cfg)  # a resumed start: another header, marked as such
    _steps(path, 3, 3)
    s = report.summarize(cfg.run_dir)
    assert again["resumed"] is True and s["steps"] == 3 and len(s["provenance_resumes"]) == 1
    assert len(report.series(report.load_records(cfg.run_dir), "reward_mean")[0]) == 3


def test_finish_records_this_machine_when_the_run_wrote_no_header(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}", "metrics.plots=false"])
    _steps(cfg.run_dir / "metrics.jsonl", 1, 1)
    assert report.summarize(cfg.run_dir)["provenance"] is None  # an old run re-reported: unknown, not this machine
    out = report.finish(cfg, cfg.run_dir, 1.0)
    saved = json.loads((cfg.run_dir / "summary.json").read_text())
    assert saved["provenance"]["source"] == "launcher at the end of the run"
    assert saved["provenance"]["base"]["sha256"] == out["provenance"]["base"]["sha256"] is not None
