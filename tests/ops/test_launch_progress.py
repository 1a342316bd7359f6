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
