"""The durable disk copy of a pushed weight version, written off the critical path from the pushed bytes.

Not a CLI. ``learner.push_coordinator`` hands each version's host buckets (what ``learner.weight_push``
broadcast) to ``DurableWriter``: a background thread writes them as one safetensors file per bucket
(``model-0000i-of-0000n.safetensors`` + the index), hashing each file as it is written
(``common.checksum.weights_sha256``'s digest, without reading anything back), then the ``STABLE`` marker (with
each file's size and ``finite: true``: actors then verify sizes instead of re-reading the version,
``actors.weight_watcher.verify_update``) and the rename, as ``learner.weights.write_version``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from common import protocol
from common.weight_bucket import BucketMeta
from learner.weights import STABLE, version_dir

log = logging.getLogger(__name__)

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


class DurableWriter:
    """Writes pushed versions to disk in a background thread (one at a time, in order), hashing as it
    writes; ``on_done`` gets each version's ``WeightUpdate`` (or is not called when writing failed), and
    ``recycle`` each version's buckets once they are no longer read (``WeightPusher.recycle``)."""

    def __init__(self, root: Path, on_done: Callable[[protocol.WeightUpdate], None],
                 extra_files: Callable[[Path], None] | None = None, max_pending: int = 2,
                 recycle: Callable[[list[tuple[BucketMeta, Tensor]]], None] | None = None) -> None:
        self.root, self.on_done, self.extra_files, self.recycle = root, on_done, extra_files, recycle
        # Each pending version is a whole host copy of the model: a learner that publishes faster than the
        # disk writes waits here (back-pressure) instead of filling host memory.
        self._slots = threading.Semaphore(max_pending)
        self._q: queue.Queue[tuple[int, list[tuple[BucketMeta, Tensor]]] | threading.Event] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="weight-writer", daemon=True)
        self._thread.start()
        self.last_error: BaseException | None = None
        self.seconds: dict[int, float] = {}

    def submit(self, version: int, buckets: list[tuple[BucketMeta, Tensor]]) -> None:
        self._slots.acquire()
        self._q.put((version, buckets))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until every submitted version is written (True) or ``timeout_s`` passed (False)."""
        done = threading.Event()
        self._q.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 600.0) -> None:
        self.wait(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            version, buckets = item
            t0 = time.perf_counter()
            try:
                update = write_buckets(self.root, version, buckets, self.extra_files)
            except BaseException as e:  # reported; the next version is written anyway
                self.last_error = e
                log.error("writing weights v%d failed: %s", version, e)
                continue
            finally:
                if self.recycle is not None:  # written (or failed): the buffers can take the next push
                    self.recycle(buckets)
                buckets.clear()
                self._slots.release()
            self.seconds[version] = time.perf_counter() - t0
            self.on_done(update)


def _write_safetensors(path: Path, meta: BucketMeta, buf: Tensor, h: Any) -> int:
    """One bucket as a safetensors file (the bucket's bytes are the data section as they are); feeds the
    file's name, size and bytes to ``h`` as ``weights_sha256`` does; returns the file size."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, dt, shape in zip(meta.names, meta.dtypes, meta.shapes, strict=True):
        n = torch.Size(shape).numel() * getattr(torch, dt).itemsize
        header[name] = {"dtype": _ST_DTYPES[getattr(torch, dt)], "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    head = struct.pack("<Q", len(raw)) + raw
    data = buf.numpy().data
    size = len(head) + len(data)
    h.update(path.name.encode())
    h.update(b"\0")
    h.update(size.to_bytes(8, "little"))
    with path.open("wb") as f:
        for chunk in (head, data):
            f.write(chunk)
            h.update(chunk)
    return size


def write_buckets(root: Path, version: int, buckets: list[tuple[BucketMeta, Tensor]],
                  extra_files: Callable[[Path], None] | None = None) -> protocol.WeightUpdate:
    """Version ``version`` from its host buckets: ``v<N>.tmp`` → files + index + STABLE → ``v<N>``."""
    final, tmp = version_dir(root, version), root / f"v{version}.tmp"
    if final.exists():
        raise FileExistsError(f"weights {final} already exist; a version is never published twice")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    n = len(buckets)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    h = hashlib.sha256()  # the files are hashed in name order, which is bucket order here
    weight_map: dict[str, str] = {}
    total = 0
    sizes: dict[str, int] = {}
    for fname, (meta, buf) in zip(names, buckets, strict=True):
        sizes[fname] = _write_safetensors(tmp / fname, meta, buf, h)
        weight_map.update({k: fname for k in meta.names})
        total += meta.nbytes
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    if extra_files is not None:
        extra_files(tmp)  # config, generation config, tokenizer
    digest, created = h.hexdigest(), time.time()
    # sizes + finite: what the learner checked (hashed while writing, NaN/Inf refused on the device), so that
    # an actor can verify the version from its file sizes instead of reading it all again.
    (tmp / STABLE).write_text(json.dumps({"version": version, "sha256": digest, "files": names, "created_at": created,
                                          "sizes": sizes, "finite": True}))
    tmp.rename(final)
    return protocol.WeightUpdate(version=version, path=str(final.resolve()), sha256=digest, created_at=created)
