"""ops/make_example_data.py and ops/configs/example_data.yaml, docs/DATA.md's worked example: the files load as
the page says (the same prompts from the parquet file and the saved dataset, evaluation sets apart from training,
the reward file's scores), and ``ops/launch.sh`` trains the shipped base on them end to end: scored by the
reward file, two evaluation sets reported apart, TensorBoard fed; on the ``save_to_disk`` directory too, with a
bad row reported at start."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import datasets
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.config import TaskConfig, load_config
from common.tasks import get_task
from common.tasks.eval_sets import load_eval_set
from ops.make_example_data import example_rows, write_example
from tests.ops.process_fixtures import processes_mentioning
from tests.ports import port_overrides

ROOT = Path(__file__).resolve().parents[2]


def _launch(tmp_path: Path, data: Path, name: str, *extra: str) -> tuple[str, Path]:
    """ops/launch.sh on the example config with the data in ``data`` and the run under ``tmp_path``."""
    sets = (f"task.eval_sets=[{{name: small, path: {data / 'eval_small.jsonl'}, k: 4}}, "
            f"{{name: large, path: {data / 'eval_large.parquet'}, k: 4}}]")
    overrides = [f"run.root={tmp_path / 'runs'}", f"run.name={name}", f"task.name=dataset:{data / 'train.parquet'}",
                 f"task.reward=file:{data / 'reward.py'}:compute_score", sets, "metrics.prometheus=false",
                 *port_overrides(), *extra]
    proc = subprocess.run([str(ROOT / "ops" / "launch.sh"), "ops/configs/example_data.yaml", *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run_dir = tmp_path / "runs" / name
    assert processes_mentioning(str(run_dir)) == []
    return out, run_dir


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_example_files_load_as_the_page_says(tmp_path: Path) -> None:
    paths = write_example(tmp_path, rows=40, max_digits=3, seed=0)
    assert [p.name for p in paths] == ["train.parquet", "train_saved", "reward.py", "eval_small.jsonl",
                                       "eval_large.parquet"]
    parquet = get_task(TaskConfig(name=f"dataset:{tmp_path / 'train.parquet'}"))
    saved = get_task(TaskConfig(name=f"dataset:{tmp_path / 'train_saved'}"))
    assert [p.messages for p in map(parquet.train_prompt, range(40))] == [p.messages for p in map(saved.train_prompt, range(40))]
    assert parquet.train_prompt(0).data_source == "addition_example"
    cfg = load_config(ROOT / "ops/configs/example_data.yaml", [])
    small = load_eval_set(str(tmp_path / "eval_small.jsonl"), "small", cfg.task)
    large = load_eval_set(str(tmp_path / "eval_large.parquet"), "large", cfg.task)
    assert [p.data_source for p in small] == ["1_digit"] * 4 + ["2_digit"] * 4 and {p.data_source for p in large} == {"three_digit"}
    train = {r["prompt"][0]["content"] for r in datasets.load_from_disk(str(tmp_path / "train_saved"))}
    assert not train & {p.text for p in small + large}  # never a training question
    first = json.loads((tmp_path / "eval_small.jsonl").read_text().splitlines()[0])
    assert small[0].text == first["question"] and first["question"].startswith("Q:")  # as the base was taught: no instruction
    spec = importlib.util.spec_from_file_location("example_reward", tmp_path / "reward.py")
    assert spec is not None and spec.loader is not None
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    assert reward.compute_score("x", "12\n+ 3\nA:15", "15", {}) == {"score": 1.0, "lines": 3.0}
    assert reward.compute_score("x", "A:15\nA:16", "15", None)["score"] == 0.0  # the last line counts


# One launched run (~1 minute on 2 cores): the README-level promise of docs/DATA.md's worked example.
@pytest.mark.slow  # a launched run (~22 s); the dataset, reward and evaluation-set pieces are tested in tests/common/tasks and tests/learner
def test_the_worked_example_trains_on_parquet_scored_by_the_reward_file_with_two_eval_sets(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_example(data, rows=64, max_digits=3, seed=0)
    out, run_dir = _launch(tmp_path, data, "example", "learner.total_steps=3")
    records = _records(run_dir)
    steps = [r for r in records if r.get("kind") == "learner_step"]
    assert len(steps) == 3 and max(r["reward_mean"] for r in steps) > 0.0  # the shipped base answers some right
    evals = [r if r["kind"] == "eval" else r["eval"] for r in records if r["kind"] == "eval" or "eval" in r]
    assert evals and all(list(e["sets"]) == ["heldout", "small", "large"] for e in evals)
    small = evals[-1]["sets"]["small"]
    assert set(small["by_data_source"]) == {"1_digit", "2_digit"} and 0.0 <= small["avg_at_k"] <= small["pass_at_k"] <= 1.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["eval_sets"]) == ["heldout", "small", "large"]
    done = json.loads(next(ln for ln in (run_dir / "logs" / "actor-0.log").read_text().splitlines()
                           if ln.startswith("ACTOR DONE "))[len("ACTOR DONE "):])
    assert done["reward_errors"] == 0 and done["positives"] > 0, done
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    rewards = [e.value for e in events.Scalars("reward_mean")]
    assert rewards == pytest.approx([r["reward_mean"] for r in steps])
    assert "eval small avg@4 " in out


@pytest.mark.slow
def test_a_saved_dataset_with_a_bad_row_trains_scored_by_the_reward_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_example(data, rows=8, max_digits=1, seed=0)  # the reward file and the evaluation sets
    rows = example_rows(48, max_digits=2, seed=3)
    rows[5]["reward_model"] = {"ground_truth": "", "style": "rule"}  # skipped, and named at start
    datasets.Dataset.from_list(rows).save_to_disk(str(data / "saved"))
    out, run_dir = _launch(tmp_path, data, "saved", f"task.name=dataset:{data / 'saved'}", "learner.total_steps=3")
    assert "1 bad row of 48: 1 without an answer (row 5); these rows are skipped" in out
    steps = [r for r in _records(run_dir) if r.get("kind") == "learner_step"]
    assert len(steps) == 3 and max(r["reward_mean"] for r in steps) > 0.0
