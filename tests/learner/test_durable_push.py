"""learner.durable_push: a pushed version's host buckets written as safetensors files whose tensors, digest and
STABLE marker are what a reader of the directory finds, in order, in the background, never twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.checksum import weights_sha256
from common.protocol import WeightUpdate
from common.weight_bucket import BucketMeta
from learner.durable_push import DurableWriter, write_buckets


def _bucket(tensors: dict[str, torch.Tensor]) -> tuple[BucketMeta, torch.Tensor]:
    """The bucket a push broadcasts: the tensors' bytes back to back (float32: every offset aligned)."""
    meta = BucketMeta()
    for name, t in tensors.items():
        meta.add(name, t.dtype, t.shape)
    return meta, torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()])


def _tensors(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"a.weight": torch.randn(2, 3, generator=g), "a.bias": torch.randn(3, generator=g)},
            {"b.weight": torch.randn(4, 1, generator=g)}]


def test_buckets_become_one_file_each_with_the_same_tensors_digest_and_sizes(tmp_path: Path) -> None:
    parts = _tensors(0)
    update = write_buckets(tmp_path, 3, [_bucket(p) for p in parts])
    final = tmp_path / "v3"
    assert update.version == 3 and Path(update.path) == final.resolve() and not (tmp_path / "v3.tmp").exists()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name, part in zip(names, parts, strict=True):
        got = load_file(str(final / name))
        assert got.keys() == part.keys() and all(torch.equal(got[k], part[k]) for k in part)
    index = json.loads((final / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a.weight": names[0], "a.bias": names[0], "b.weight": names[1]}
    assert index["metadata"]["total_size"] == (6 + 3 + 4) * 4
    stable = json.loads((final / "STABLE").read_text())
    # The digest hashed while writing is the one a reader computes from the files.
    assert stable["sha256"] == update.sha256 == weights_sha256(final)
    assert stable["files"] == names and stable["finite"] is True
    assert stable["sizes"] == {n: (final / n).stat().st_size for n in names}
    with pytest.raises(FileExistsError):
        write_buckets(tmp_path, 3, [_bucket(p) for p in parts])  # a version is never published twice


def test_the_writer_writes_in_order_in_the_background_recycles_and_survives_a_failure(tmp_path: Path) -> None:
    done: list[WeightUpdate] = []
    recycled: list[int] = []
    (tmp_path / "v2").mkdir()  # v2 exists already: its write fails, v3 is written anyway
    writer = DurableWriter(tmp_path, done.append, extra_files=lambda d: (d / "config.json").write_text("{}"),
                           recycle=lambda buckets: recycled.append(len(buckets)))
    for v in (1, 2, 3):
        writer.submit(v, [_bucket(p) for p in _tensors(v)])
    assert writer.wait(60)
    writer.close()
    assert [u.version for u in done] == [1, 3] and isinstance(writer.last_error, FileExistsError)
    assert recycled == [2, 2, 2]  # every version's buckets go back, written or not
    assert (tmp_path / "v3" / "config.json").read_text() == "{}" and set(writer.seconds) == {1, 3}
