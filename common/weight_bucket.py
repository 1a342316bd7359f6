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
- **Own communicator** (``new_group``). A learner rank binds its default group to its GPU
  (``learner.dist``); torch 2.13's ``_new_process_group_helper`` then builds every later NCCL group as a
  ``ncclCommSplit`` of the default communicator, a collective over *all* learner ranks, of which only
  rank 0 is in this group: rank 0 would wait in the split while the others are in a ZeRO-3 gather, until
  the process-group timeout kills them. The group is created with the default group's bound device
  cleared (the helper splits only from a bound default group; ``ProcessGroup.bound_device_id`` is a plain
  field in 2.13, restored at once), and a backend that still names a parent to split from is refused.
- **Failure stays in the group.** On NCCL, torch's watchdog thread of a group that sees a timeout or a
  peer's error tears the process down (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 3, the default), and with any
  setting it raises the process-wide dump flag on which the default group's monitor thread ends the
  process (``ProcessGroupNCCL::shouldDump_``, static). The weight group's ``ProcessGroupNCCL`` is therefore
  constructed with ``TORCH_NCCL_BLOCKING_WAIT=1`` (read per group, in its constructor): no watchdog thread
  at all, ``wait`` blocks the calling thread for at most ``timeout_s`` and raises there; the group's
  communicators are then aborted (``ncclCommAbort``, local) and the caller goes on. The learner's own
  groups keep the launcher's settings: exporting either variable for the process would weaken their
  error handling (a hung ZeRO-3 collective must still end the run).
- **Store** (``master_store``): rank 0's TCP store listens on ``master_address`` only (a socket bound to
  that address and handed to torch's store; its own server would listen on every interface), at
  ``master_port`` (0: a free one). It has no authentication: a non-loopback address needs the plan's
  ``placement.store_protection`` statement and a fixed port (``common.push_addresses``).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d  # privates via the module: tests patch them

from common.push_addresses import WILDCARDS

log = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"  # read by each ProcessGroupNCCL's constructor
_CREATE = threading.Lock()  # one group creation at a time: it changes the default group and the environment


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

    def __init__(self, pg: Any, store: Any, rank: int, world_size: int, name: str, timeout_s: float,
                 backend: str = "gloo") -> None:
        self.pg, self.store, self.rank, self.world_size = pg, store, rank, world_size
        self.name, self.timeout_s, self.backend = name, timeout_s, backend
        self._lock = threading.Lock()  # the push's tail thread and the caller may both end the group

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
        """Until ``work`` is done, at most ``timeout_s``; on a timeout or a member's failure an NCCL group's
        communicators are aborted before the error is raised (its collectives could never complete, and
        nothing else would free its GPU resources), so the caller can go on without it."""
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception:
            if self.backend == "nccl":
                self.abort()
            raise

    def abort(self) -> None:
        """End the group now without its peers: ``ncclCommAbort`` on its communicators (local, bounded by
        the group's timeout; torch's orderly shutdown first waits for pending collectives, which a dead
        member never completes). Idempotent; the default group and the learner's others are untouched."""
        with self._lock:
            pg, self.pg, self.store = self.pg, None, None
        if pg is None:
            return

        try:
            if pg in c10d._world.pg_map:
                c10d._abort_process_group(pg)  # aborts, then unregisters its name
            else:
                pg.abort()
        except Exception as e:  # already aborted by a failed wait; nothing more to free
            log.debug("weight group %s: abort: %s", self.name, e)
        _forget(pg)

    def close(self) -> None:
        """End the group: NCCL aborts (see ``abort``); gloo shuts down in order, closing its connections."""
        if self.backend == "nccl":
            self.abort()
            return
        with self._lock:
            pg, self.pg, self.store = self.pg, None, None
        if pg is not None:
            try:
                torch.distributed.destroy_process_group(pg)  # closes its connections, frees its name
            except Exception:  # a group whose peer died may refuse an orderly shutdown
                pass
            _forget(pg)  # whatever happened, torch's registry must not keep the store (a fixed port) alive


def _forget(pg: Any) -> None:
    """Drop ``pg`` from torch's registry of groups (what destroy/abort do on success): the registry holds
    the group's store, whose listening port the next group takes again."""
    world = c10d._world
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag,
                  world.pg_coalesce_state):
        table.pop(pg, None)
    for groups in world.tags_to_pg.values():
        while pg in groups:
            groups.remove(pg)


def seed_nccl_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Give ``TORCH_NCCL_BLOCKING_WAIT`` its value (the process's own, else torch's default 0) before any
    NCCL thread runs. ``new_group`` changes it for a moment; a variable that already exists is replaced in
    place, while adding one reallocates the environment under threads that may be reading it."""
    environ.setdefault(BLOCKING_WAIT, environ.get("NCCL_BLOCKING_WAIT", "0"))


@contextmanager
def _env(values: Mapping[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _own_communicator(backend: str) -> Iterator[None]:
    """While torch creates the weight group: the default group unbound (no ``ncclCommSplit`` of the
    learner's communicator) and, on NCCL, no watchdog thread for the new group (module docstring)."""
    default = c10d._get_default_group() if torch.distributed.is_initialized() else None
    if backend != "nccl" and (default is None or default.bound_device_id is None):
        yield  # nothing to change (an engine's gloo group): no lock held through gloo's rendezvous
        return
    with _CREATE:
        bound = default.bound_device_id if default is not None else None
        if default is not None and bound is not None:
            default.bound_device_id = None
        try:
            with _env({BLOCKING_WAIT: "1"} if backend == "nccl" else {}):
                yield
        finally:
            if default is not None and bound is not None:
                default.bound_device_id = bound


def split_parent(pg: Any) -> Any:
    """The communicator an NCCL group's backend is to be split from (None: it builds its own)."""
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except (RuntimeError, AttributeError):  # no CUDA backend in this group
        return None
    return getattr(getattr(backend, "options", None), "split_from", None)


def _listen(address: str, port: int) -> socket.socket:
    """A TCP socket listening on ``address`` alone (not every interface) at ``port`` (0: a free one)."""
    if address.strip() in WILDCARDS:
        raise ValueError(f"the weight group's store needs the one address the engines reach, not {address!r}")
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        # A rebuilt group listens at the same fixed port again: connections of the old store in TIME_WAIT
        # must not block it (two live listeners cannot share it all the same).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"the weight group's store cannot listen on {address}:{port}: {e.strerror}") from e
    return sock


def check_listen(address: str, port: int) -> None:
    """Raise (OSError, ValueError) as ``master_store`` would for ``address:port``; listens for a moment only."""
    _listen(address, port).close()


def master_store(master_address: str, master_port: int, world_size: int, timeout_s: float) -> Any:
    """Rank 0's TCP store, listening on ``master_address`` only, before any member is told where it is
    (port 0: a free one; its ``.port`` says which). torch's store takes the listening socket (and closes
    it when it goes)."""
    sock = _listen(master_address, master_port)
    try:
        store = torch.distributed.TCPStore(master_address, sock.getsockname()[1], world_size, True,
                                           datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                                           master_listen_fd=sock.fileno(), use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


def new_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
              group_name: str = DEFAULT_GROUP, timeout_s: float = 60.0, store: Any = None) -> Group:
    """Join the group (blocks until all ``world_size`` members have joined, or raises after ``timeout_s``).

    Built as SGLang's ``init_custom_process_group`` builds it (a ``PrefixStore(group_name)`` over the TCP
    store, torch's ``_new_process_group_helper``, the group's ranks registered), so that its store keys and
    connections match a real SGLang engine's; never split from the default group, and on NCCL without a
    watchdog (module docstring). Rank 0 passes the store from ``master_store`` (one is made if not); the
    others connect to ``master_address:master_port``. A name is registered once per process: a rebuilt
    group takes a new name, and ``Group.close`` unregisters the old one."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: gloo | nccl")
    td = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = (master_store(master_address, master_port, world_size, timeout_s) if rank == 0 else
                 torch.distributed.TCPStore(master_address, master_port, world_size, False, td, wait_for_workers=False))
    with _own_communicator(backend):
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                               c10d.PrefixStore(group_name, store), group_name=c10d.GroupName(group_name),
                                               backend_options=None, timeout=td)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    group = Group(pg, store, rank, world_size, group_name, timeout_s, backend)
    if split_parent(pg) is not None:  # a torch whose helper splits some other way: refused, never hung
        group.abort()
        raise RuntimeError(f"weight group {group_name}: torch would build its communicator as a split of the "
                           "learner's default group (collective over every learner rank); refused")
    return group


__all__ = ["BLOCKING_WAIT", "DEFAULT_GROUP", "FLATTENED_BUCKET", "BucketMeta", "Group", "all_finite", "check_listen",
           "dtype_name", "empty_bucket", "flatten", "master_store", "new_group", "nbytes", "parse_dtype", "plan_buckets",
           "seed_nccl_env", "split_parent", "unflatten"]
