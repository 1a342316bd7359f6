"""Experiment trackers: metrics.jsonl's records read back from TensorBoard's event files and W&B's offline run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.config import Config, load_config, to_dict
from learner.data import ListSource
from learner.records import RunRecords
from learner.runner import Runner
from learner.synthetic import synth_groups
from learner.trackers import scalars
from tests.learner.wandb_log import config_values, history_rows

REPO = Path(__file__).resolve().parents[2]


def _config(root: Path, *more: str) -> Config:
    return load_config(None, [f"run.root={root}", "run.name=r", *more])


def _tensorboard(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _points(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _text(acc: EventAccumulator, tag: str) -> str:
    return "".join(e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag))


def _wandb_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def test_record_names_are_the_jsonl_keys_flattened_numbers_only() -> None:
    step = {"kind": "learner_step", "step": 3, "time": 1.0, "reward_mean": np.float32(0.5), "kl": torch.tensor(0.25),
            "samples": 8, "phase_seconds": {"fetch": 0.1}, "eval": {"avg_at_k": 0.75, "by_bucket": {"1d": {"n": 2}}},
            "engine_urls": ["http://h:1"], "task": "addition", "mask": torch.ones(2)}
    assert scalars(step) == {"reward_mean": 0.5, "kl": 0.25, "samples": 8.0, "phase_seconds/fetch": pytest.approx(0.1),
                             "eval/avg_at_k": 0.75, "eval/by_bucket/1d/n": 2.0}
    # Other kinds under their own name: value pretraining's value_mean is not the RL critic's.
    assert scalars({"kind": "value_pretrain", "step": 1, "value_mean": 0.2, "loss": 1.5}) == {
        "value_pretrain/value_mean": 0.2, "value_pretrain/loss": 1.5}
    assert scalars({"kind": "eval", "step": 0, "weight_version": 0, "avg_at_k": 0.5}) == {
        "eval/weight_version": 0.0, "eval/avg_at_k": 0.5}


def test_both_trackers_hold_every_record_at_its_step(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "metrics.trackers=[tensorboard,wandb]", "metrics.wandb_project=proj")
    records = [
        {"kind": "header", "run": "r", "resumed": False, "commit": {"sha": "abc123"}},
        {"kind": "value_pretrain", "step": 1, "loss": 2.0, "value_mean": 0.1, "time": 100.0},
        {"kind": "value_pretrain", "step": 2, "loss": 1.0, "value_mean": 0.2, "time": 101.0},
        {"kind": "learner_step", "step": 1, "weight_version": 1, "time": 102.0, "reward_mean": 0.25,
         "phase_seconds": {"fetch": 0.5, "actor_update": 1.5}},
        {"kind": "learner_step", "step": 2, "weight_version": 2, "time": 103.0, "reward_mean": 0.75,
         "phase_seconds": {"fetch": 0.25, "actor_update": 1.25}},
        # An engine evaluation of version 1 that finished after step 2 was logged: its step goes backwards.
        {"kind": "eval", "step": 1, "weight_version": 1, "time": 104.0, "avg_at_k": 0.5, "task": "addition",
         "by_bucket": {"1d": {"avg_at_k": 1.0}}},
    ]
    with RunRecords.open(cfg) as sink:
        for rec in records:
            sink.append(rec)
    run_dir = cfg.run_dir
    assert [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == records

    expected = {"value_pretrain/loss": [(1, 2.0), (2, 1.0)], "value_pretrain/value_mean": [(1, 0.1), (2, 0.2)],
                "weight_version": [(1, 1.0), (2, 2.0)], "reward_mean": [(1, 0.25), (2, 0.75)],
                "phase_seconds/fetch": [(1, 0.5), (2, 0.25)], "phase_seconds/actor_update": [(1, 1.5), (2, 1.25)],
                "eval/weight_version": [(1, 1.0)], "eval/avg_at_k": [(1, 0.5)], "eval/by_bucket/1d/avg_at_k": [(1, 1.0)]}
    acc = _tensorboard(run_dir)
    assert set(acc.Tags()["scalars"]) == set(expected)
    for tag, points in expected.items():
        assert _points(acc, tag) == [(s, pytest.approx(v)) for s, v in points], tag
    assert [e.wall_time for e in acc.Scalars("reward_mean")] == [102.0, 103.0]  # the record's own time
    assert yaml.safe_load(textwrap.dedent(_text(acc, "config/text_summary"))) == to_dict(cfg)  # the resolved config
    assert "abc123" in _text(acc, "header/text_summary")

    (wandb_file,) = _wandb_files(run_dir)
    rows = history_rows(wandb_file)
    logged: dict[str, list[tuple[int, float]]] = {}
    for row in rows:  # each kind on its own x axis (define_metric), so W&B keeps the late evaluation
        axis = next(a for a in ("step", "eval/step", "value_pretrain/step") if a in row)
        for name, value in row.items():
            if not name.startswith("_") and name != axis:
                logged.setdefault(name, []).append((row[axis], value))
    assert logged == {tag: [(s, pytest.approx(v)) for s, v in points] for tag, points in expected.items()}
    run = config_values(wandb_file)
    assert run["project"] == "proj" and run["name"] == "r" and run["exit_code"] == 0
    assert run["run_id"] == (run_dir / "wandb" / "run_id").read_text().strip()
    assert run["config"]["metrics"]["trackers"] == ["tensorboard", "wandb"]  # the resolved config
    assert run["config"]["header"]["commit"] == {"sha": "abc123"}


def test_a_crash_keeps_every_record_and_the_restart_resumes_the_same_wandb_run(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "metrics.trackers=[tensorboard,wandb]")
    with pytest.raises(RuntimeError, match="boom"), RunRecords.open(cfg) as sink:
        sink.append({"kind": "learner_step", "step": 1, "reward_mean": 0.25})
        raise RuntimeError("boom")
    with RunRecords.open(cfg) as sink:  # the restart, from the checkpoint at version 1
        sink.append({"kind": "learner_step", "step": 2, "reward_mean": 0.5})
    run_dir = cfg.run_dir
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per start
    assert _points(_tensorboard(run_dir), "reward_mean") == [(1, 0.25), (2, 0.5)]
    first, second = (config_values(f) for f in _wandb_files(run_dir))
    assert first["run_id"] == second["run_id"] == (run_dir / "wandb" / "run_id").read_text().strip()
    assert (first["exit_code"], second["exit_code"]) == (1, 0)  # the crashed start is marked failed
    assert [[(r["step"], r["reward_mean"]) for r in history_rows(f)] for f in _wandb_files(run_dir)] == [
        [(1, 0.25)], [(2, 0.5)]]


def test_trackers_get_the_records_without_metrics_jsonl_and_nothing_after_close(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "metrics.trackers=[tensorboard]", "metrics.jsonl=false")
    sink = RunRecords.open(cfg)
    sink.append({"kind": "learner_step", "step": 1, "reward_mean": 0.5})
    sink.close()
    sink.append({"kind": "learner_step", "step": 2, "reward_mean": 0.75})  # after close: no tracker takes it
    assert not (cfg.run_dir / "metrics.jsonl").exists()
    assert _points(_tensorboard(cfg.run_dir), "reward_mean") == [(1, 0.5)]


def test_without_trackers_nothing_is_imported_and_nothing_but_the_file_is_written(tmp_path: Path) -> None:
    code = ("import sys; from common.config import load_config; from learner.records import RunRecords\n"
            f"cfg = load_config(None, ['run.root={tmp_path}', 'run.name=r'])\n"
            "with RunRecords.open(cfg) as sink: sink.append({'kind': 'learner_step', 'step': 1, 'x': 1.0})\n"
            "print(sorted(m for m in ('wandb', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["metrics.jsonl"]


def test_a_learner_run_sends_its_step_records_to_tensorboard(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The learner's own records through the sink main() opens: TensorBoard holds the same metric names as
    metrics.jsonl's step records, at their steps, and the base policy's evaluation beside the step's."""
    cfg = _config(tmp_path, f"model.path={tiny_model_dir}", "learner.total_steps=2", "learner.batch_groups=2",
                  "learner.eval_every=2", "learner.eval_k=1", "task.eval_size=4", "task.max_digits=2",
                  "actors.max_new_tokens=12", "metrics.prometheus=false", "learner.checkpoint_every=0",
                  "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0",
                  "metrics.trackers=[tensorboard]")
    t0 = time.time()
    with RunRecords.open(cfg) as sink:
        Runner(cfg, ListSource(synth_groups(4, 3, 60, seed=6)), records=sink).start().run()
    recs = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "learner_step"]
    assert [r["step"] for r in steps] == [1, 2]
    acc = _tensorboard(cfg.run_dir)
    tags = set(acc.Tags()["scalars"])
    step_names = set().union(*(scalars(r) for r in steps))
    assert {"reward_mean", "critic_loss", "policy_loss", "mfu", "phase_seconds/actor_update"} <= step_names
    base_eval = next(r for r in recs if r["kind"] == "eval")  # evaluated before the first step
    assert tags == step_names | set(scalars(base_eval))
    for rec in steps:
        for name, value in scalars(rec).items():
            assert (rec["step"], pytest.approx(value, rel=1e-6)) in _points(acc, name), name
    assert _points(acc, "eval/avg_at_k")[0] == (0, pytest.approx(base_eval["avg_at_k"]))
    assert [p[0] for p in _points(acc, "eval/avg_at_k")] == [0, 2]  # the in-process evaluation at step 2 too
    assert all(t0 <= e.wall_time <= time.time() for e in acc.Scalars("reward_mean"))
