"""ops/report.py with the metrics.jsonl header: the summary says what produced the run; readers skip it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import load_config
from learner.records import RunRecords, append_jsonl
from ops import report  # ops/report.py

ROOT = Path(__file__).resolve().parents[2]


def _steps(path: Path, first: int, last: int) -> None:
    for s in range(first, last + 1):
        append_jsonl(path, {"kind": "learner_step", "step": s, "weight_version": s, "samples": 8, "time": 100.0 + s,
                            "reward_mean": 0.5})


def test_header_comes_first_and_the_summary_carries_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}", "learner.threads=1"])
    path = cfg.run_dir / "metrics.jsonl"
    first = RunRecords(cfg).append_header()
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
    again = RunRecords(cfg).append_header()  # a resumed start: another header, marked as such
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


def test_the_summary_has_a_row_per_evaluation_set_and_data_source(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "r"

    def sets(heldout: float, aime: float) -> dict:
        return {"heldout": {"avg_at_k": heldout, "pass_at_k": 0.9, "k": 2, "n_prompts": 8},
                "aime": {"avg_at_k": aime, "pass_at_k": 0.5, "k": 4, "n_prompts": 3,
                         "by_data_source": {"aime24": {"n_prompts": 2, "avg_at_k": 0.125, "pass_at_k": 0.5},
                                            "aime25": {"n_prompts": 1, "avg_at_k": 0.75, "pass_at_k": 1.0}}}}

    append_jsonl(run / "metrics.jsonl", {"kind": "eval", "step": 0, "weight_version": 0, "avg_at_k": 0.25,
                                         "sets": sets(0.25, 0.0)})
    _steps(run / "metrics.jsonl", 1, 2)
    append_jsonl(run / "metrics.jsonl", {"kind": "learner_step", "step": 3, "weight_version": 3, "samples": 8,
                                         "time": 104.0, "eval": {"avg_at_k": 0.5, "sets": sets(0.5, 0.3333)}})
    s = report.summarize(run)
    assert s["base_accuracy"] == 0.25 and s["final_accuracy"] == 0.5  # the held-out slice, as before
    assert s["eval_sets"]["aime"] == {"base_avg_at_k": 0.0, "k": 4, "n_prompts": 3, "final_step": 3,
                                      "final_avg_at_k": 0.3333, "final_pass_at_k": 0.5,
                                      "final_by_data_source": sets(0, 0)["aime"]["by_data_source"]}
    assert s["eval_sets"]["heldout"]["base_avg_at_k"] == 0.25 and s["eval_sets"]["heldout"]["final_avg_at_k"] == 0.5
    report.print_table(s)
    out = capsys.readouterr().out
    assert "evaluation sets" in out
    rows = [ln for ln in out.splitlines() if "aime" in ln]
    assert len(rows) == 3 and "0.333" in rows[0] and "aime25" in rows[2] and "0.750" in rows[2]
    assert "eval_sets.png" in [p.name for p in report.plot(run)]


def test_a_run_without_evaluation_sets_has_no_sets_in_its_summary(tmp_path: Path) -> None:
    append_jsonl(tmp_path / "r" / "metrics.jsonl", {"kind": "eval", "step": 0, "avg_at_k": 0.25})
    assert "eval_sets" not in report.summarize(tmp_path / "r")
