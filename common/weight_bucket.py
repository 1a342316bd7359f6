"""Flattened weight buckets and the weight-update process group, as SGLang 0.5.23 lays them out.

Shared by the learner (the sender, rank 0 of the group) and ``actors.rollout_server`` (a receiver), so
both sides agree byte for byte on what one ``/update_weights_from_distributed`` call with
``load_format="flattened_bucket"`` carries:

- **Layout** (SGLang's ``srt/weight_sync/tensor_bucket.py``, ``FlattenedTensorBucket``): the bucket is one
  ``uint8`` tensor, the concatenation of each tensor's bytes (``t.flatten().view(torch.uint8)``) in the
  order of ``names``; tensor ``i`` starts where tensor ``i-1`` ends. The receiver allocates
  ``sum(numel(shape_i) * itemsize(dtype_i))`` bytes, takes part in one ``broadcast(src=0)`` and views the
  pieces back as ``(dtype_i, shape_i)``. SGLang refuses a tensor whose byte offset is not a multiple of its
  dtype's size, so ``plan_buckets`` starts a new bucket rather than misalign one.
- **Dtype names** are ``torch`` attribute names (``"bfloat16"``, ``"float32"``): SGLang resolves them with
  ``getattr(torch, dtype)``.
- **Group** (``new_group``): SGLang's ``init_custom_process_group`` over ``tcp://master_address:master_port``,
  built the same way (store prefixes, registration); rank 0 (the learner) hosts the TCP store, engine
  ``i``'s ranks are ``rank_offset + tp_rank``; gloo (CPU) or NCCL (CUDA). It is not ``torch.distributed``'s
  default group (the learner's DeepSpeed group, or none in an engine) and needs none. Every
  collective on it waits at most ``timeout_s``: a dead or hung member costs the others a bounded wait.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

FLATTENED_BUCKET = "flattened_bucket"
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype in ``dtypes`` (``getattr(torch, name)`` gives it back)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The floating-point ``torch.dtype`` named ``name``; ValueError for anything else (a weight that is
    not floating point is no weight)."""
    dt = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"dtype {name!r} is not a floating-point torch dtype")
    return dt


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


@dataclass
class BucketMeta:
    """What one ``/update_weights_from_distributed`` call names: SGLang's ``names, dtypes, shapes``."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    nbytes: int = 0

    def add(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> None:
        self.names.append(name)
        self.dtypes.append(dtype_name(dtype))
        self.shapes.append([int(d) for d in shape])
        self.nbytes += nbytes(dtype, shape)

    def body(self) -> dict[str, Any]:
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes}


def plan_buckets(entries: Iterable[tuple[str, torch.dtype, Sequence[int]]], bucket_bytes: int) -> list[BucketMeta]:
    """Split ``(name, dtype, shape)`` entries, in order, into buckets of at most ``bucket_bytes`` (a larger
    single tensor is a bucket of its own), every tensor at an offset aligned to its dtype's size."""
    out: list[BucketMeta] = []
    cur = BucketMeta()
    for name, dtype, shape in entries:
        n = nbytes(dtype, shape)
        if cur.names and (cur.nbytes + n > bucket_bytes or cur.nbytes % dtype.itemsize):
            out.append(cur)
            cur = BucketMeta()
        cur.add(name, dtype, shape)
    if cur.names:
        out.append(cur)
    return out


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket of ``tensors``: their bytes, concatenated in order, as one uint8 tensor (one copy, into a
    buffer allocated once; ``torch.cat`` of byte views costs half as much again). ``out``: a uint8 buffer of
    exactly that size on the tensors' device to write into (a reused one skips the page faults of a new one)."""
    views = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    n = sum(v.numel() for v in views)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=views[0].device if views else "cpu")
    elif out.dtype != torch.uint8 or out.numel() != n:
        raise ValueError(f"flatten: out holds {out.numel()} {out.dtype} elements, the bucket {n} bytes")
    off = 0
    for v in views:
        out[off:off + v.numel()].copy_(v)
        off += v.numel()
    return out


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds no NaN or Inf. One reduction (NaN and Inf propagate through a
    sum, accumulated in fp32 at least) instead of ``isfinite(t).all()``, which writes a mask as large as
    the tensor: ~20x faster on CPU. A sum that overflows with finite values is checked exactly."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


def empty_bucket(meta_dtypes: Sequence[str], shapes: Sequence[Sequence[int]], device: Any = "cpu") -> torch.Tensor:
    """A receive buffer for a bucket (SGLang's ``FlattenedTensorBucket.empty``); ValueError on a negative
    dimension or a misaligned tensor, as SGLang refuses them."""
    offset = 0
    for dt_name, shape in zip(meta_dtypes, shapes, strict=True):
        dt = parse_dtype(dt_name)
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"negative dimension in {list(shape)}")
        if offset % dt.itemsize:
            raise ValueError(f"unaligned tensor: byte offset {offset}, dtype {dt_name}")
        offset += nbytes(dt, shape)
    if offset == 0:
        raise ValueError("cannot create an empty tensor bucket")
    return torch.empty(offset, dtype=torch.uint8, device=device)


def unflatten(buf: torch.Tensor, names: Sequence[str], dtypes: Sequence[str],
              shapes: Sequence[Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a received bucket (views into ``buf``)."""
    out = []
    offset = 0
    for name, dt_name, shape in zip(names, dtypes, shapes, strict=True):
        dt = parse_dtype(dt_name)
        n = nbytes(dt, shape)
        out.append((name, buf[offset:offset + n].view(dt).reshape([int(d) for d in shape])))
        offset += n
    if offset != buf.numel():
        raise ValueError(f"bucket holds {buf.numel()} bytes, its tensors {offset}")
    return out


class Group:
    """One member's handle on a weight-update process group (the store is kept alive with it)."""

    def __init__(self, pg: Any, store: Any, rank: int, world_size: int, name: str, timeout_s: float) -> None:
        self.pg, self.store, self.rank, self.world_size = pg, store, rank, world_size
        self.name, self.timeout_s = name, timeout_s

    def broadcast(self, t: torch.Tensor) -> None:
        """``broadcast(t, src=0)`` on this group, waiting at most the group's timeout (RuntimeError past it,
        or at once when a member's connection is gone)."""
        self.wait(self.start_broadcast(t))

    def start_broadcast(self, t: torch.Tensor) -> Any:
        """``broadcast`` begun, not awaited: the caller prepares the next bucket meanwhile, then ``wait``s."""
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self.pg.broadcast([t], opts)

    def wait(self, work: Any) -> None:
        work.wait(datetime.timedelta(seconds=self.timeout_s))

    def close(self) -> None:
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None:
            try:
                torch.distributed.destroy_process_group(pg)  # closes its connections, frees its name
            except Exception:  # a group whose peer died may refuse an orderly shutdown
                pass


def master_store(master_address: str, master_port: int, world_size: int, timeout_s: float) -> Any:
    """Rank 0's TCP store, listening before any member is told where it is (port 0: a free one; its
    ``.port`` says which)."""
    return torch.distributed.TCPStore(master_address, master_port, world_size, True,
                                      datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def new_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
              group_name: str = DEFAULT_GROUP, timeout_s: float = 60.0, store: Any = None) -> Group:
    """Join the group (blocks until all ``world_size`` members have joined, or raises after ``timeout_s``).

    Built as SGLang's ``init_custom_process_group`` builds it (a ``PrefixStore(group_name)`` over the TCP
    store, torch's ``_new_process_group_helper``, the group's ranks registered), so that its store keys and
    connections match a real SGLang engine's. Rank 0 passes the store from ``master_store``; the others
    connect to ``master_address:master_port``. A name is registered once per process: a rebuilt group takes
    a new name, and ``Group.close`` unregisters the old one."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: gloo | nccl")
    td = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(master_address, master_port, world_size, rank == 0, td,
                                           wait_for_workers=False)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=td)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return Group(pg, store, rank, world_size, group_name, timeout_s)


__all__ = ["DEFAULT_GROUP", "FLATTENED_BUCKET", "BucketMeta", "Group", "all_finite", "dtype_name", "empty_bucket", "flatten",
           "master_store", "new_group", "nbytes", "parse_dtype", "plan_buckets", "unflatten"]
