"""The rows of a user's prompt file for ``dataset:<path>``: a JSON-lines file, a parquet file or a directory
written by HF ``datasets``' ``save_to_disk``, each as a list of plain Python dicts (nested columns as dicts,
list columns as lists), in file order.

    rows = read_rows(Path("data/dapo.parquet"))   # [{"prompt": [{"role": "user", ...}], ...}, ...]

A ``save_to_disk`` directory is read with pyarrow, not ``datasets.load_from_disk``: its ``state.json`` lists
the arrow shards (IPC streams) in order, ``save_to_disk`` has already applied any ``select``/``shuffle``
indices, so pyarrow reads exactly the saved rows without importing ``datasets`` (seconds of imports and
its cache machinery in every actor and the learner) and through the same arrow-to-Python conversion as a
parquet file, so the same rows give the same values in every format. A ``DatasetDict`` directory
(``dataset_dict.json``) is read through its ``train`` split.

Not a CLI; used by ``common.tasks.dataset_task`` and ``common.tasks.eval_sets``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

Row = dict[str, Any]


def _jsonl_rows(path: Path) -> list[Row]:
    rows: list[Row] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue  # blank lines are not rows
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{lineno}: a line must be a JSON object, got {type(obj).__name__}")
        rows.append(obj)
    return rows


def _arrow_dir_table(path: Path) -> pa.Table:
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split (splits: {splits}); "
                             "name the split's directory instead")
        path = path / "train"
    state = path / "state.json"
    if not state.is_file():
        raise ValueError(f"{path}: not a datasets.save_to_disk directory (no state.json)")
    files = [path / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    if not files:
        raise ValueError(f"{path}: state.json lists no data files")
    tables = []
    for f in files:
        with pa.memory_map(str(f)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def read_rows(path: Path) -> list[Row]:
    """Every row of ``path`` (.jsonl, .parquet, or a save_to_disk directory); ValueError naming what is wrong."""
    if path.is_dir():
        return _arrow_dir_table(path).to_pylist()
    if not path.is_file():
        raise ValueError(f"no file or directory {path}")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        return _jsonl_rows(path)
    raise ValueError(f"{path}: unknown format {path.suffix!r}; use .jsonl, .parquet or a "
                     "datasets.save_to_disk directory")


def columns(rows: list[Row]) -> list[str]:
    """The column names of ``rows`` in first-seen order (JSON lines may differ in their keys)."""
    seen: dict[str, None] = {}
    for r in rows:
        seen.update(dict.fromkeys(r))
    return list(seen)


def field(row: Row, key: str) -> Any:
    """``row``'s value at the dotted ``key`` (``reward_model.ground_truth``); None where a part is missing."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


__all__ = ["Row", "columns", "field", "read_rows"]
