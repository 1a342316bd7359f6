"""Distributed weight push (``learner.weight_transport: distributed``): ZeRO-3 gathers of at most
``learner.bucket_bytes``, each broadcast by rank 0 as one SGLang flattened bucket to every engine of the
weight-update group; the durable disk version is written from the same bytes in the background.

- **Group**: rank 0 of the learner is rank 0 of a process group whose other ranks are the engines (engine
  ``i``'s ranks at ``rank_offset = 1 + i x tp``), built through each engine's ``/init_weights_update_group``
  (``open_group`` listens, the members are told ``init_bodies()``, ``join`` waits for all of them). gloo on
  CPU, NCCL on CUDA (``common.weight_bucket``). Every collective on it waits at most ``timeout_s``: a dead
  or hung engine fails the push, which closes the group (it is rebuilt on the next open) and leaves that
  version to the disk path; the learner goes on.
- **Plan**: ``bucket_plan(model)``: the state-dict tensors (tied aliases dropped, as on disk) in order, split
  into buckets of at most ``bucket_bytes``; the same for every version, so the members post the same
  ``names, dtypes, shapes`` per bucket each time (``BucketMeta.body()``). SGLang accepts names it does
  not know without a word (200, one log line, the version moves), so ``plan_mismatch`` compares the plan
  with the tensors of the base checkpoint the engines serve, and a plan that differs is never pushed.
- **Push**: ``iter_buckets`` is collective under ZeRO-3 (every rank gathers one bucket's parameters at a
  time); rank 0 flattens the bucket on the device (a CPU model: into a reused host buffer, ``HostPool``),
  checks the flattened bytes are finite there (NaN/Inf refuse the version before a byte leaves the
  device), broadcasts it while the next bucket is gathered (at most two in flight) and hands a host copy
  to ``DurableWriter``. The final bucket's broadcast completes in a background thread while the learner
  goes on (``settle``: the next push, group change or close waits for it, at most ``timeout_s``).
- **Disk off the critical path** (``learner.durable_push.DurableWriter``): a background thread writes the host buckets as one
  safetensors file per bucket (``model-0000i-of-0000n.safetensors`` + the index), hashing each file as it
  is written (``common.checksum.weights_sha256``'s digest, without reading anything back), then the
  ``STABLE`` marker (with each file's size and ``finite: true``: actors then verify sizes instead of
  re-reading the version, ``actors.weight_watcher.verify_update``) and the rename, as
  ``learner.weights.write_version``; ``on_done(WeightUpdate)`` announces it. Rank 0 holds each version's
  host copy until it is written, at most two versions (a learner that publishes faster than its disk
  writes then waits for the writer), then its buffers go back to the pusher for the next push.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from common.checksum import checkpoint_shapes
from common.weight_bucket import (
    BucketMeta,
    Group,
    all_finite,
    dtype_name,
    flatten,
    master_store,
    nbytes,
    new_group,
    parse_dtype,
    plan_buckets,
)
from learner.dist import rank
from learner.durable_push import DurableWriter, write_buckets
from learner.host_tensors import gathered, is_partitioned, tied_aliases, unwrap

log = logging.getLogger(__name__)



def _entries(model: Any) -> list[tuple[str, Tensor]]:
    module = unwrap(model)
    entries = list(module.state_dict(keep_vars=True).items())
    alias = tied_aliases(module, entries)
    return [(n, t) for n, t in entries if n not in alias]


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", t.shape))


def bucket_plan(model: Any, bucket_bytes: int) -> list[BucketMeta]:
    """The buckets of a push (every rank computes the same plan from the same model)."""
    return plan_buckets(((n, t.dtype, _shape(t)) for n, t in _entries(model)), bucket_bytes)


def plan_mismatch(plan: list[BucketMeta], model_path: str | Path) -> str | None:
    """Why ``plan`` does not name exactly the tensors of the base checkpoint at ``model_path`` with their
    shapes (None when it does). The engines serve that checkpoint's names, and SGLang accepts an unknown
    name silently: a plan that differs would leave some weights stale while the version moves."""
    try:
        base = checkpoint_shapes(model_path)
    except Exception as e:  # an unreadable header, not safetensors
        return f"cannot read the tensor names of the base checkpoint {model_path}: {e}"
    if not base:
        return f"no safetensors tensors in the base checkpoint {model_path} to check the push's names against"
    planned = {n: tuple(shape) for meta in plan for n, shape in zip(meta.names, meta.shapes, strict=True)}
    only_plan, only_base = sorted(set(planned) - set(base)), sorted(set(base) - set(planned))
    if only_plan or only_base:
        return (f"the learner's tensor names differ from the base checkpoint's ({model_path}): {len(only_plan)} "
                f"only in the learner, first {only_plan[:3]}; {len(only_base)} only in the checkpoint, "
                f"first {only_base[:3]}")
    bad = [n for n in sorted(planned) if planned[n] != base[n]]
    if bad:
        return f"shape of {bad[0]}: learner {planned[bad[0]]}, base checkpoint {base[bad[0]]} ({model_path})"
    return None


def bucket_finite(buf: Tensor, meta: BucketMeta) -> bool:
    """Whether the flattened bucket ``buf`` holds no NaN or Inf: one reduction per run of same-dtype tensors
    (one for a model of one dtype) over the bytes that are sent, instead of one per tensor."""
    runs: list[tuple[torch.dtype, int, int]] = []
    off = 0
    for dt_name, shape in zip(meta.dtypes, meta.shapes, strict=True):
        dt = parse_dtype(dt_name)
        n = nbytes(dt, shape)
        if runs and runs[-1][0] == dt:
            runs[-1] = (dt, runs[-1][1], off + n)
        else:
            runs.append((dt, off, off + n))
        off += n
    return all(all_finite(buf[a:b].view(dt)) for dt, a, b in runs if b > a)


class HostPool:
    """Host buffers for the buckets' host copies, given back once their version is on disk and reused by the
    next push: writing into a fresh buffer pays a page fault per page (flattening 256 MiB: 0.10 s into a
    fresh buffer, 0.04 s into a reused one, 1 CPU thread). At most one idle buffer per bucket is kept, i.e.
    one host copy of the model between pushes."""

    def __init__(self) -> None:
        self._free: dict[int, Tensor] = {}
        self._lock = threading.Lock()  # the writer thread gives, the learner takes

    def take(self, index: int, n_bytes: int, pin: bool = False) -> Tensor:
        with self._lock:
            buf = self._free.pop(index, None)
        if buf is None or buf.numel() != n_bytes or (pin and not buf.is_pinned()):
            # pinned on CUDA: device-to-host copies into page-locked memory run at full bus speed
            buf = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=pin)
        return buf

    def give(self, buckets: list[tuple[BucketMeta, Tensor]]) -> None:
        """A written version's buffers (bucket order) back to the pool."""
        with self._lock:
            for i, (_, buf) in enumerate(buckets):
                if buf.device.type == "cpu":
                    self._free.setdefault(i, buf)


def iter_buckets(model: Any, plan: list[BucketMeta], pool: HostPool | None = None) -> Iterator[Tensor | None]:
    """One flattened bucket per plan entry: on rank 0 a new tensor (a copy: the next step may change the
    parameters), elsewhere None; collective under ZeRO-3 (every rank must run it to the end). A CPU model's
    buckets are flattened into ``pool``'s buffers. ValueError (after the gathers) on a non-finite weight."""
    by_name = dict(_entries(model))
    partitioned = is_partitioned(unwrap(model))
    me = rank()
    bad: str | None = None
    for i, meta in enumerate(plan):
        ts = [by_name[n] for n in meta.names]
        with gathered([t for t in ts if hasattr(t, "ds_id")] if partitioned else [], modifier_rank=None):
            if me != 0:
                yield None
                continue
            data = [t.data for t in ts]
            on_cpu = data[0].device.type == "cpu"
            buf = flatten(data, out=pool.take(i, meta.nbytes) if pool is not None and on_cpu else None)
            if bad is None and not bucket_finite(buf, meta):
                # rare: name the first offending weight for the error
                bad = next((n for n, t in zip(meta.names, data, strict=True) if not all_finite(t)), meta.names[0])
            yield None if bad is not None else buf
    if bad is not None:
        raise ValueError(f"weight {bad} has NaN or Inf values; this version is not published (training diverged?)")


@dataclass
class PushResult:
    """What one push did (rank 0)."""

    version: int
    broadcast: bool  # every member received every bucket
    error: str = ""
    bytes: int = 0
    # the learner's blocked time by phase; the final bucket's broadcast completes after push returns
    seconds: dict[str, float] = field(default_factory=lambda: {"gather": 0.0, "broadcast": 0.0, "host_copy": 0.0})
    tail_s: float = 0.0  # the final bucket's broadcast completion, in the background (off the learner's path)


class WeightPusher:
    """Rank 0's side of the weight-update group, and the push of one version (every rank calls ``push``)."""

    def __init__(self, bucket_bytes: int, backend: str = "gloo", master_address: str = "127.0.0.1",
                 master_port: int = 0, timeout_s: float = 60.0, group_name: str = "weight_update_group") -> None:
        self.bucket_bytes, self.backend, self.timeout_s = bucket_bytes, backend, timeout_s
        self.master_address, self.master_port, self.group_name = master_address, master_port, group_name
        self.group: Group | None = None
        self._store: Any = None
        self.world_size = 0
        self.plan: list[BucketMeta] | None = None
        self.opened = 0
        self.current_name = group_name
        self._incarnation = secrets.token_hex(4)  # this pusher's groups' names are its own
        self.pool = HostPool()  # rank 0's host copies, back from the durable writer (``recycle``)
        self._tail: threading.Thread | None = None  # the final bucket's broadcast completing

    def recycle(self, buckets: list[tuple[BucketMeta, Tensor]]) -> None:
        """A version's host copies, written to disk: their buffers serve the next push (``DurableWriter``'s
        ``recycle``). Called only once nothing else reads them."""
        self.pool.give(buckets)

    def open_group(self, n_engines: int, ranks_per_engine: int = 1) -> list[dict[str, Any]]:
        """Listen for a new group of ``n_engines`` engines of ``ranks_per_engine`` ranks each (SGLang's
        tensor-parallel size: engine ``i``'s ranks are ``rank_offset + tp_rank``); any old group is closed.
        Returns each engine's ``/init_weights_update_group`` body, in engine order."""
        self.close()
        self.opened += 1
        # A fresh name per group: torch registers a group's name once per process, and so does an SGLang
        # engine, which outlives a learner that restarts (a resumed run) and refuses a name it still holds.
        self.current_name = f"{self.group_name}_{self._incarnation}_{self.opened}"
        self.world_size = 1 + n_engines * ranks_per_engine
        self._store = master_store(self.master_address, self.master_port, self.world_size, self.timeout_s)
        return [{"master_address": self.master_address, "master_port": int(self._store.port),
                 "rank_offset": 1 + i * ranks_per_engine, "world_size": self.world_size, "group_name": self.current_name,
                 "backend": self.backend} for i in range(n_engines)]

    def join(self) -> None:
        """Rank 0 joins the group opened by ``open_group``; RuntimeError when a member does not join within
        ``timeout_s``."""
        if self._store is None:
            raise RuntimeError("join before open_group")
        try:
            self.group = new_group(self.backend, self.master_address, int(self._store.port), 0, self.world_size,
                                   self.current_name, self.timeout_s, store=self._store)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        self.settle()  # a group is closed only once nothing is in flight on it (gloo needs that too)
        if self.group is not None:
            self.group.close()
        self.group, self._store = None, None

    def push(self, model: Any, version: int, sink: Callable[[BucketMeta, Tensor], None] | None = None,
             on_settled: Callable[[PushResult], None] | None = None) -> PushResult | None:
        """Gather and broadcast every bucket of ``model`` (collective under ZeRO-3); ``sink`` gets each
        bucket's host copy on rank 0 (the durable writer; give them back with ``recycle`` once written). A
        failed broadcast closes the group and the remaining buckets still reach ``sink``. Rank 0 returns a
        PushResult, the others None.

        The final bucket's broadcast may still be in flight when this returns (its bytes are a copy, so the
        learner may go on training): ``res.broadcast`` and ``res.error`` are final only once ``on_settled(res)``
        was called (at once when nothing was in flight) or ``settle()`` returned; the next push, group change
        or close settles first."""
        self.settle()
        if self.plan is None:
            self.plan = bucket_plan(model, self.bucket_bytes)
        res = PushResult(version=version, broadcast=self.group is not None)
        pending: Any = None  # the previous bucket's broadcast, in flight while the next one is gathered
        t = time.perf_counter()
        for i, (meta, buf) in enumerate(zip(self.plan, iter_buckets(model, self.plan, self.pool), strict=True)):
            now = time.perf_counter()
            res.seconds["gather"] += now - t
            t = now
            if buf is None:
                if rank() == 0 and self.group is not None:  # a non-finite weight: the engines stop at once
                    res.broadcast, res.error = False, "non-finite weights"
                    # gloo closes a group's connections only once nothing refers to it, a pending work
                    # included (and the ValueError below keeps this frame alive)
                    pending = None
                    self.close()
                continue
            res.bytes += buf.numel()
            if res.broadcast:
                pending = self._broadcast(res, pending, buf)
                now = time.perf_counter()
                res.seconds["broadcast"] += now - t
                t = now
            if sink is not None:
                sink(meta, buf if buf.device.type == "cpu" else self.pool.take(i, buf.numel(), pin=True).copy_(buf))
                now = time.perf_counter()
                res.seconds["host_copy"] += now - t
                t = now
        if rank() != 0:
            return None
        if res.broadcast and pending is not None:
            # Only the final bucket's completion goes to the background: every earlier one was awaited before
            # its successor was started, so at most two buckets are ever in flight.
            self._tail = threading.Thread(target=self._finish, args=(res, pending, on_settled),
                                          name="weight-push-tail", daemon=True)
            self._tail.start()
        elif on_settled is not None:
            on_settled(res)
        return res

    def _finish(self, res: PushResult, pending: Any, on_settled: Callable[[PushResult], None] | None) -> None:
        t = time.perf_counter()
        self._broadcast(res, pending, None)  # at most timeout_s; a failure closes the group
        res.tail_s = time.perf_counter() - t
        if on_settled is not None:
            on_settled(res)

    def settle(self) -> None:
        """Until the last push's final broadcast is complete or failed (at most ``timeout_s``)."""
        tail = self._tail
        if tail is not None and tail is not threading.current_thread():
            tail.join()
            self._tail = None

    def _broadcast(self, res: PushResult, pending: Any, buf: Tensor | None) -> Any:
        """Wait for the broadcast in flight, start ``buf``'s; on failure close the group (this version goes
        by disk) and return None."""
        try:
            if pending is not None and self.group is not None:
                self.group.wait(pending)
            if buf is None or self.group is None:
                return None
            return self.group.start_broadcast(buf)
        except Exception as e:  # a member died or hung
            res.broadcast, res.error = False, str(e)[:500]
            log.warning("weight push v%d: broadcast failed (%s); the group is closed", res.version, res.error)
            self.close()
            return None


# The push as one import for its callers (ops/bench/weight_sync.py, the push tests): the disk copy and the
# checkpoint reader live in learner.durable_push and common.checksum.
__all__ = ["DurableWriter", "PushResult", "WeightPusher", "bucket_plan", "dtype_name",
           "iter_buckets", "plan_mismatch", "write_buckets"]
