"""ops/launch.sh on the smoke config with ``task.name=dataset:<parquet>``: a user's prompt set in verl's layout
(chat prompts, written by ``ops.make_example_data``) trains the shipped base end to end. Real buffer, engine,
actor and learner processes; about two minutes on two cores, so marked slow (``pytest -m slow``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ops.make_example_data import example_rows, write_parquet
from tests.ops.process_fixtures import processes_mentioning
from tests.ports import port_overrides

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_parquet_prompt_set_in_verls_layout_trains_end_to_end(tmp_path: Path) -> None:
    rows = example_rows(48, max_digits=2, seed=3)
    rows[5]["reward_model"] = {"ground_truth": "", "style": "rule"}  # a bad row: skipped and reported at start
    data = write_parquet(tmp_path / "addition.parquet", rows)
    overrides = [f"run.root={tmp_path / 'runs'}", "run.name=dataset-e2e", f"task.name=dataset:{data}",
                 f"model.path={ROOT / 'ops/bases/addition-tiny'}", *port_overrides()]
    proc = subprocess.run([str(ROOT / "ops" / "launch.sh"), "ops/configs/smoke.yaml", *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "1 bad row of 48: 1 without an answer (row 5); these rows are skipped" in out
    run_dir = tmp_path / "runs" / "dataset-e2e"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "learner_step"]
    assert len(steps) >= 3, out[-3000:]
    rewards = [r["reward_mean"] for r in steps]
    assert all(0.0 <= r <= 1.0 for r in rewards) and max(rewards) > 0.0, rewards  # the base answers some right
    evals = [r["eval"] for r in records if isinstance(r.get("eval"), dict)]
    assert evals and evals[-1]["task"] == f"dataset:{data}"
    assert processes_mentioning(str(run_dir)) == []
