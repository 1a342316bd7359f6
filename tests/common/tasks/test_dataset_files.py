"""common.tasks.dataset_files: the same rows from JSON lines, parquet and a ``save_to_disk`` directory (and a
DatasetDict's train split), in file order; bad files named; columns in first-seen order; dotted fields."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.tasks.dataset_files import columns, field, read_rows

ROWS = [
    {"prompt": "1+1", "reward_model": {"ground_truth": "2"}, "tags": ["a"]},
    {"prompt": "2+3", "reward_model": {"ground_truth": "5"}, "tags": []},
    {"prompt": "4+4", "reward_model": {"ground_truth": "8"}, "tags": ["b", "c"]},
]


def test_every_format_reads_the_same_rows_in_file_order(tmp_path: Path) -> None:
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")  # a trailing blank line is no row
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    split = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                          "test": datasets.Dataset.from_list(ROWS[2:])}).save_to_disk(str(split))
    assert read_rows(jsonl) == read_rows(parquet) == read_rows(saved) == ROWS
    assert read_rows(split) == ROWS[:2]  # a DatasetDict is read through its train split


@pytest.mark.parametrize(
    "name, text, needle",
    [
        ("bad.jsonl", '{"prompt": "x"}\n{not json\n', r"bad\.jsonl:2: invalid JSON"),
        ("list.jsonl", "[1, 2]\n", r"list\.jsonl:1: a line must be a JSON object, got list"),
        ("d.csv", "prompt\nx\n", "unknown format '.csv'"),
    ],
)
def test_a_bad_file_is_named_with_what_is_wrong(tmp_path: Path, name: str, text: str, needle: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=needle):
        read_rows(tmp_path / name)


def test_missing_files_and_directories_that_are_not_saved_datasets_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no file or directory"):
        read_rows(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="no state.json"):
        read_rows(tmp_path)
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
    with pytest.raises(ValueError, match="without a 'train' split"):
        read_rows(tmp_path)


def test_columns_are_in_first_seen_order_and_fields_follow_dots() -> None:
    assert columns([{"b": 1, "a": 2}, {"c": 3, "a": 4}]) == ["b", "a", "c"]
    assert field(ROWS[1], "reward_model.ground_truth") == "5"
    assert field(ROWS[1], "reward_model.missing") is None
    assert field(ROWS[1], "prompt.deeper") is None  # a string has no parts
    assert field(ROWS[0], "tags") == ["a"]
