"""Checksum of a published weight directory, computed identically by the learner and the actors.

``weights_sha256(path)`` = sha256 over the directory's ``*.safetensors`` files in sorted file-name
order; for each file it hashes the file name (UTF-8), a NUL byte, the file size as 8 little-endian
bytes, then the file's bytes. Hashing names and sizes means a renamed, split or truncated shard changes
the digest even when the concatenated bytes would not. The learner puts the digest in
``WeightUpdate.sha256``; an actor refuses weights whose digest differs, so a half-written or corrupted
version never reaches an engine. ``checkpoint_shapes(path)``: what the files hold (name -> shape, read from
the headers), which the learner's push plan and an actor's check of an update both hold against the base.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from safetensors import safe_open

_CHUNK = 1 << 20


def weight_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a weight directory, sorted by name (FileNotFoundError if none)."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"weight directory {d} does not exist")
    files = sorted((p for p in d.glob("*.safetensors") if p.is_file()), key=lambda p: p.name)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {d}")
    return files


def weights_sha256(path: str | Path) -> str:
    """Lowercase hex sha256 of the directory's safetensors files (names, sizes and bytes)."""
    h = hashlib.sha256()
    for p in weight_files(path):
        h.update(p.name.encode())
        h.update(b"\0")
        h.update(p.stat().st_size.to_bytes(8, "little"))
        with p.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


__all__ = ["checkpoint_shapes", "weight_files", "weights_sha256"]


def checkpoint_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the safetensors files of an HF directory, from their headers only."""
    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # safe_open is not a dict
                out[name] = tuple(st.get_slice(name).get_shape())
    return out
