"""buffer.inspect, in process: the JSON summary of a fresh buffer directory, the learner-version repair (and its
refusal while a server holds the directory), and exit status 2 for what is not a buffer directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from buffer.directory import lock_server, unlock_server
from buffer.inspect import main
from buffer.store import BufferStore


@pytest.fixture
def fresh(tmp_path: Path) -> Path:
    path = tmp_path / "buffer"
    BufferStore(path, map_size=1 << 22).close()  # 4 MiB: what an empty store records as its map
    return path


def test_a_fresh_directory_is_empty_at_version_zero(fresh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(fresh), "--indent", "1"]) == 0
    out = capsys.readouterr().out
    info = json.loads(out)
    assert out.startswith('{\n "path": ')  # --indent 1 pretty-prints
    assert {k: info[k] for k in ("path", "groups", "samples", "group_bytes", "positives", "min_weight_version",
                                 "max_weight_version", "learner_version", "map_size")} == {
        "path": str(fresh), "groups": 0, "samples": 0, "group_bytes": 0, "positives": 0,
        "min_weight_version": None, "max_weight_version": None, "learner_version": 0, "map_size": 1 << 22}
    assert info["file_size"] > 0 and info["counters"]["learner_version"] == 0


def test_the_repair_sets_the_learner_version_and_says_from_what(fresh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(fresh), "--set-learner-version", "5"]) == 0
    first, summary = capsys.readouterr().out.split("\n", 1)
    assert first == f"buffer.inspect: learner_version 0 -> 5 in {fresh}"
    assert json.loads(summary)["learner_version"] == 5
    assert main([str(fresh)]) == 0 and json.loads(capsys.readouterr().out)["learner_version"] == 5  # durable


def test_the_repair_is_refused_while_the_directory_is_served(fresh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fd = lock_server(fresh)  # what a running server holds
    try:
        assert main([str(fresh), "--set-learner-version", "5"]) == 2
    finally:
        unlock_server(fd)
    err = capsys.readouterr().err
    assert err.startswith("buffer.inspect: refusing to repair: ") and err.rstrip().endswith("stop the buffer server first")
    assert main([str(fresh)]) == 0 and json.loads(capsys.readouterr().out)["learner_version"] == 0


def test_what_is_not_a_buffer_directory_exits_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    assert "is not an LMDB buffer directory (no data.mdb)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--set-learner-version", "-1"])
    assert e.value.code == 2
