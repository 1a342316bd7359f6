"""common.checksum: one digest for a weight directory, sensitive to names, sizes and bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from common.checksum import weights_sha256


def _write(d: Path, files: dict[str, bytes]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


def test_digest_definition_and_sensitivity(tmp_path: Path) -> None:
    a = _write(tmp_path / "a", {"model-00002.safetensors": b"world", "model-00001.safetensors": b"hello",
                                "config.json": b"{}"})
    h = hashlib.sha256()
    for name, data in (("model-00001.safetensors", b"hello"), ("model-00002.safetensors", b"world")):
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    assert weights_sha256(a) == h.hexdigest()
    # non-weight files do not count; same bytes split differently or renamed do
    b = _write(tmp_path / "b", {"model-00001.safetensors": b"hello", "model-00002.safetensors": b"world",
                                "tokenizer.json": b"x"})
    assert weights_sha256(b) == weights_sha256(a)
    c = _write(tmp_path / "c", {"model-00001.safetensors": b"hellow", "model-00002.safetensors": b"orld"})
    d = _write(tmp_path / "d", {"model-00001.safetensors": b"hello", "model-00003.safetensors": b"world"})
    e = _write(tmp_path / "e", {"model-00001.safetensors": b"hello", "model-00002.safetensors": b"worle"})
    assert len({weights_sha256(x) for x in (a, c, d, e)}) == 4


def test_missing_directory_or_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        weights_sha256(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        weights_sha256(_write(tmp_path / "empty", {"config.json": b"{}"}))
