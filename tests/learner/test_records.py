"""learner.records: metrics.jsonl appends (one whole JSON object per line, from several threads, numbers
JSON lacks written as floats), the header record of each start, and all-or-nothing JSON files."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import load_config
from learner.records import RunRecords, append_jsonl, header_record, write_json_atomic


def test_append_jsonl_makes_the_directory_and_writes_numpy_and_tensor_numbers_as_floats(tmp_path: Path) -> None:
    path = tmp_path / "run" / "sub" / "metrics.jsonl"
    append_jsonl(path, {"kind": "learner_step", "step": 1, "loss": np.float32(0.5), "kl": torch.tensor(0.25)})
    append_jsonl(path, {"kind": "eval", "step": 1, "acc": np.float64(0.75)})
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"kind": "learner_step", "step": 1, "loss": 0.5, "kl": 0.25}, {"kind": "eval", "step": 1, "acc": 0.75}]


def test_appends_from_several_threads_stay_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    pad = "x" * 5000  # lines longer than one small write

    def writer(t: int) -> None:
        for i in range(100):
            append_jsonl(path, {"kind": "learner_step", "thread": t, "i": i, "pad": pad})

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 600
    for t in range(6):
        assert [r["i"] for r in records if r["thread"] == t] == list(range(100))  # each thread's in its order


def test_the_header_says_whether_the_run_is_resumed(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}"])
    first = RunRecords(cfg).append_header()
    assert first["kind"] == "header" and first["run"] == "r" and first["resumed"] is False
    assert {"cpu", "versions", "base"} <= set(first)  # common.provenance's fields
    append_jsonl(cfg.run_dir / "metrics.jsonl", {"kind": "learner_step", "step": 1})
    again = RunRecords(cfg).append_header()
    assert again["resumed"] is True and again["time"] >= first["time"]
    kinds = [json.loads(line)["kind"] for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["header", "learner_step", "header"]
    assert header_record(cfg)["resumed"] is True  # header_record alone appends nothing
    assert len((cfg.run_dir / "metrics.jsonl").read_text().splitlines()) == 3


def test_write_json_atomic_replaces_the_file_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "state" / "latest.json"
    write_json_atomic(path, {"version": 1, "loss": np.float32(2.0)})
    assert json.loads(path.read_text()) == {"version": 1, "loss": 2.0}
    write_json_atomic(path, {"version": 2})
    assert json.loads(path.read_text()) == {"version": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest.json"]


def test_a_record_that_cannot_be_written_leaves_the_old_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "latest.json"
    write_json_atomic(path, {"version": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"version": 2, "bad": object()})  # float(object()) fails before any write
    assert json.loads(path.read_text()) == {"version": 1}
