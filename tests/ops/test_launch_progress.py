"""ops/launch_progress.py: the launcher's step line, read from a metrics.jsonl, shows the step's MFU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.launch_progress import Progress


def test_the_step_line_shows_mfu_as_a_percentage_and_a_dash_without_one(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "learner_step", "weight_version": 1, "time": 100.0, "samples": 8, "reward_mean": 0.5,
                "mfu": 0.1234},
               {"kind": "learner_step", "weight_version": 2, "time": 102.0, "samples": 8, "reward_mean": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    Progress(path, total_steps=2).poll()
    first, second = capsys.readouterr().out.splitlines()
    assert "step 1/2" in first and "  MFU 12.3%  ETA " in first
    assert "step 2/2" in second and "  MFU -  ETA " in second and "samples/s 4.0" in second


def test_the_eval_line_has_one_part_per_evaluation_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "metrics.jsonl"
    sets = {"heldout": {"avg_at_k": 0.5, "pass_at_k": 0.75, "k": 2}, "aime": {"avg_at_k": 0.3125, "pass_at_k": 0.625, "k": 4}}
    records = [{"kind": "eval", "weight_version": 0, "avg_at_k": 0.5, "sets": sets},
               {"kind": "eval", "weight_version": 1, "avg_at_k": 0.25, "greedy_accuracy": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    Progress(path, total_steps=2).poll()
    with_sets, without = capsys.readouterr().out.splitlines()
    assert with_sets.endswith("eval  v0: eval heldout avg@2 0.500 pass@2 0.750 | eval aime avg@4 0.312 pass@4 0.625")
    assert "eval  v1: held-out avg@k 0.250  greedy 0.500" in without  # no sets: the line as before


def test_the_eta_follows_the_last_steps_pace_and_a_resumed_launcher_reads_it_from_the_records(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """10 s a step for steps 1-5 of 20, then a launcher started again (after a stop) reads them back at once:
    the ETA is the records' pace (15 steps x 10 s), not the few seconds since it started; a stop of 100 s
    before step 6 slows the pace the ETA reads (its steps 1-6 took 150 s: 30 s a step, 14 left)."""
    path = tmp_path / "metrics.jsonl"
    steps = [{"kind": "learner_step", "weight_version": v, "time": 1000.0 + 10 * v, "samples": 8} for v in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in steps))
    progress = Progress(path, total_steps=20)
    progress.poll()
    lines = capsys.readouterr().out.splitlines()
    assert "ETA -" in lines[0] and "step 5/20" in lines[-1] and "ETA 2m30s" in lines[-1]
    with open(path, "a") as f:
        f.write(json.dumps({"kind": "learner_step", "weight_version": 6, "time": 1160.0, "samples": 8}) + "\n")
    progress.poll()
    out = capsys.readouterr().out
    assert "step 6/20" in out and "ETA 7m00s" in out
