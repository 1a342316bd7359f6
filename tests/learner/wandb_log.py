"""Reading an offline W&B run's ``run-<id>.wandb`` file back, for tests (wandb 0.31 ships no Python reader).

The file is W&B's 7-byte header (``:W&B``, magic 0xBEE1, version 0) followed by a LevelDB-style log: 32 KiB
blocks of chunks, each a 7-byte header (CRC32C, little-endian length, type: 1 full, 2 first, 3 middle,
4 last) and its bytes; a block's tail shorter than a header is zero padding. Each whole record is one
``wandb_internal_pb2.Record`` (wandb's own protobuf).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7


def read_records(path: Path) -> list[Any]:
    """Every record of the ``.wandb`` file at ``path``, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
            pending = b""
    return records


def history_rows(path: Path) -> list[dict[str, Any]]:
    """The run's logged rows (``run.log``), each as {name: value} (W&B's own ``_step`` etc. included)."""
    rows = []
    for rec in read_records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def config_values(path: Path) -> dict[str, Any]:
    """The run's config as the file holds it (``wandb.init``'s ``config=``, then every update, the later
    winning), and the run's own record: {"config": {...}, "run_id": ..., "project": ..., "exit_code": ...}."""
    config: dict[str, Any] = {}
    out: dict[str, Any] = {"config": config}
    for rec in read_records(path):
        kind = rec.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = rec.run.config.update if kind == "run" else rec.config.update
            for item in updates:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        if kind == "run":
            out.update(run_id=rec.run.run_id, project=rec.run.project, name=rec.run.display_name)
        if kind == "exit":
            out["exit_code"] = rec.exit.exit_code
    return out
