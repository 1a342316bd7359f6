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
