"""The learner's data-parallel plumbing: the process group, rank helpers and its own host-side collectives.

Not a CLI. ``setup_distributed(cfg)`` runs once per process before the first model is built (it is
idempotent; ``learner.models`` calls it). Everything else works with one process too, where every
collective is a no-op:

    world_size(), rank()                       # 1 and 0 without a process group or launcher
    all_reduce_sum(tensor)                     # float64 host sum over ranks
    broadcast_bytes(data), broadcast_frames(frames), broadcast_ints(values)   # rank 0's bytes / ints
    rank0_wait(work, what)                     # rank 0 runs work(); the others hear from it every heartbeat_s()
    global_whiten(adv, mask)                   # learner.losses.masked_whiten over every rank's rows
    global_explained_variance(v, r, mask)      # learner.losses.explained_variance over every rank's rows

The learner's own collectives move host tensors (token counts, statistics, the batch's frames), which is
why a CUDA learner's process group has gloo for host tensors beside NCCL (``process_group_backend``).
Nothing here pickles: bytes travel as uint8 tensors.

The process group's timeout is ``learner.dist_timeout_s``: a rank that hears nothing for that long (a
lost host, a hung peer) fails. Rank 0 alone may wait far longer (a batch, up to ``learner.batch_timeout_s``),
so whatever it waits for runs through ``rank0_wait``: the work runs in a thread while rank 0 sends the
other ranks a "still waiting" control value every ``heartbeat_s()``, then "done" or "failed".

CPU: DeepSpeed 0.19 JIT-compiles a shared-memory all-reduce op on the first ``initialize`` (~80 s). A
single process has nothing to all-reduce, so we mark that op incompatible in
``deepspeed.ops.__compatible_ops__`` (key ``deepspeed_shm_comm``) and nothing is compiled; multi-rank CPU
runs build it once into ``TORCH_EXTENSIONS_DIR`` (ops/test.sh and ops/launch.sh export a persistent one)
unless ``VAPO_DS_SHM=0`` forces plain gloo.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, MutableMapping
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
from torch import Tensor

from common.config import Config
from common.placement import STORE_FILE_ENV  # the launcher sets it for a one-host multi-rank learner
from common.weight_bucket import seed_nccl_env
from learner.losses import explained_variance, masked_whiten

log = logging.getLogger(__name__)

SHM_OP_KEY = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME in deepspeed/ops/op_builder/cpu/comm.py
MAX_HEARTBEAT_S = 30.0  # rank0_wait's longest silence: small against any sane timeout, one tiny broadcast
_timeout_s = 1800.0  # the process group's timeout (learner.dist_timeout_s), set by setup_distributed

T = TypeVar("T")


def world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    adopt_slurm_env()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    adopt_slurm_env()
    return int(os.environ.get("RANK", "0"))


def _tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Entry ``node`` of Slurm's compressed task counts, e.g. ``"2(x3),1"`` = 2, 2, 2, 1."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        n, _, times = part.partition("(x")
        counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
    return counts[node] if 0 <= node < len(counts) else counts[0]


def adopt_slurm_env(env: MutableMapping[str, str] = os.environ) -> None:
    """Rank variables for a task that srun started (one ``srun ... python -m learner`` step), which has only
    Slurm's own: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE from SLURM_PROCID, the step's task count, SLURM_LOCALID
    and its tasks on this node. A launcher's RANK wins; MASTER_ADDR/MASTER_PORT come from whoever started the
    step. Without this every task of a Slurm learner would be rank 0 of a world of 1."""
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or "1"
    per_node = (env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
                or env.get("SLURM_TASKS_PER_NODE") or ntasks)
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = ntasks
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_SIZE"] = str(_tasks_on_node(per_node, int(env.get("SLURM_NODEID", "0"))))


def loss_scale_for_dp() -> float:
    """DeepSpeed averages gradients over ranks; losses normalised by global counts need the sum."""
    return float(world_size())


def process_group_backend(device: str) -> str:
    """The torch.distributed backend of a learner on ``device``.

    CUDA needs two: NCCL for what DeepSpeed reduces (device tensors) and gloo for the learner's own
    collectives, which move host tensors (token counts, the broadcast batch bytes). An NCCL-only group
    rejects a host tensor at the first such call ("No backend type associated with device type cpu")."""
    return "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"


def setup_distributed(cfg: Config) -> None:
    """Initialise torch.distributed, then DeepSpeed's communication layer on top of it; idempotent.

    Under a launcher (deepspeed, torchrun) the rendezvous comes from its environment (``env://``), or from
    the file ``$VAPO_STORE_FILE`` when the ranks share a host; tasks of one srun step derive their rank
    variables from Slurm's (``adopt_slurm_env``). Without a launcher the process is rank 0 of 1
    and uses an in-process store. Only a learner spanning hosts listens on a port (placement.master_port)."""
    want = "cpu" if cfg.run.device == "cpu" else "cuda"
    if os.environ.get("DS_ACCELERATOR", want) != want:
        # DeepSpeed picks its accelerator once, from this variable: a CUDA learner built on the CPU
        # accelerator (or the reverse) fails far from the cause.
        log.warning("DS_ACCELERATOR=%s does not match run.device=%s; using %s",
                    os.environ["DS_ACCELERATOR"], cfg.run.device, want)
    os.environ["DS_ACCELERATOR"] = want
    # Before any NCCL thread exists: the weight-update group sets this variable for a moment later.
    seed_nccl_env()
    adopt_slurm_env()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_SIZE", os.environ["WORLD_SIZE"])
    import deepspeed  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR
    import deepspeed.ops  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR

    ws = int(os.environ["WORLD_SIZE"])
    if cfg.run.device == "cpu" and (ws == 1 or os.environ.get("VAPO_DS_SHM", "1") == "0"):
        # Accessing the attribute runs DeepSpeed's (cheap) probe once; the dict it caches is what
        # deepspeed/comm/torch.py:build_shm_op consults.
        ops = deepspeed.ops.__compatible_ops__
        if SHM_OP_KEY not in ops:
            raise RuntimeError(f"DeepSpeed op key {SHM_OP_KEY!r} not found; the shm-op bypass needs updating")
        ops[SHM_OP_KEY] = False
    if cfg.run.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        global _timeout_s
        _timeout_s = cfg.learner.dist_timeout_s
        backend = process_group_backend(cfg.run.device)
        timeout = timedelta(seconds=_timeout_s)
        if ws == 1:
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1,
                                                 timeout=timeout)
        else:
            kw: dict[str, Any] = {"timeout": timeout}
            if cfg.run.device == "cuda":
                # Binds the NCCL communicator to this rank's GPU up front: it is formed here (an NCCL fault
                # shows at startup, not at the first ZeRO-3 gather) and the groups DeepSpeed makes later are
                # cheap splits of it. torch would split the weight-update group too, a collective over every
                # rank of which only rank 0 is a member: common.weight_bucket.new_group creates that group
                # unbound, so the binding stays for the learner's own groups.
                kw["device_id"] = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            # Ranks on one host meet in a file the launcher names (no port: torch's TCP store listens on
            # every interface); ranks on several hosts need the TCP rendezvous of their launcher.
            store_file = os.environ.get(STORE_FILE_ENV)
            if store_file:
                kw.update(init_method=f"file://{store_file}", rank=int(os.environ["RANK"]), world_size=ws)
            else:
                missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
                if missing:
                    raise RuntimeError(f"learner rank {os.environ['RANK']} of {ws}: {' and '.join(missing)} not set; "
                                       "the launcher (deepspeed, torchrun, or whoever runs srun) must set them")
                kw.update(init_method="env://")
            torch.distributed.init_process_group(backend, **kw)
    # DeepSpeed adopts the existing process group (it only creates one when none exists).
    deepspeed.init_distributed(dist_backend=process_group_backend(cfg.run.device), auto_mpi_discovery=False)


# ----------------------------------------------------------------------------------------- collectives

_WAITING, _DONE, _FAILED = 0, 1, 2


def heartbeat_s() -> float:
    """How often ``rank0_wait`` tells the other ranks that rank 0 is still waiting: well inside the timeout."""
    return max(0.05, min(MAX_HEARTBEAT_S, _timeout_s / 4))


def rank0_wait(work: Callable[[], T] | None, what: str) -> T | None:
    """``work()`` on rank 0 (pass None elsewhere), however long it takes, without the other ranks' collective
    timing out: rank 0 runs it in a thread and broadcasts a control value every ``heartbeat_s()`` (waiting,
    done, failed). Returns its result on rank 0 and None elsewhere; an exception in ``work`` is re-raised on
    rank 0, and the other ranks raise RuntimeError naming ``what`` (instead of sitting out the timeout)."""
    if world_size() == 1:
        assert work is not None
        return work()
    code = torch.zeros(1, dtype=torch.long)
    if rank() != 0:
        while True:
            torch.distributed.broadcast(code, 0)
            if int(code[0]) == _DONE:
                return None
            if int(code[0]) == _FAILED:
                raise RuntimeError(f"learner rank 0 failed while {what} (its log has the error)")
    assert work is not None, "rank 0 needs the work"
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = work()
        except BaseException as e:  # handed to the main thread, raised there
            box["error"] = e

    t = threading.Thread(target=run, name=f"rank0-{what}", daemon=True)
    t.start()
    while True:
        t.join(heartbeat_s())
        code[0] = _WAITING if t.is_alive() else (_FAILED if "error" in box else _DONE)
        torch.distributed.broadcast(code, 0)
        if int(code[0]) == _FAILED:
            raise box["error"]
        if int(code[0]) == _DONE:
            return box["result"]


def all_reduce_sum(x: Tensor) -> Tensor:
    """Sum over data-parallel ranks (a no-op for one process); returns a new float64 CPU tensor."""
    y = x.detach().to(torch.float64).cpu().clone()
    if world_size() > 1:
        torch.distributed.all_reduce(y)
    return y


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (raw bytes through a uint8 tensor; nothing pickled)."""
    if world_size() == 1:
        assert data is not None
        return data
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.long)
    torch.distributed.broadcast(n, 0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank() == 0 and data else torch.empty(int(n), dtype=torch.uint8)
    if int(n):
        torch.distributed.broadcast(buf, 0)
    return bytes(buf.numpy().tobytes())


def broadcast_ints(values: list[int] | None) -> list[int]:
    """Rank 0's list of integers on every rank (its length first, then one int64 tensor)."""
    if world_size() == 1:
        assert values is not None
        return list(values)
    n = torch.tensor([len(values) if values is not None else 0], dtype=torch.long)
    torch.distributed.broadcast(n, 0)
    buf = torch.tensor(values, dtype=torch.long) if rank() == 0 and values else torch.zeros(int(n), dtype=torch.long)
    if int(n):
        torch.distributed.broadcast(buf, 0)
    return [int(v) for v in buf.tolist()]


def broadcast_frames(frames: list[bytes] | None) -> list[bytes]:
    """Rank 0's list of byte strings on every rank, unchanged: their lengths, then one concatenated buffer."""
    if world_size() == 1:
        assert frames is not None
        return list(frames)
    lengths = broadcast_ints([len(f) for f in frames] if frames is not None else None)
    data = broadcast_bytes(b"".join(frames) if frames is not None else None)
    out, at = [], 0
    for n in lengths:
        out.append(data[at:at + n])
        at += n
    return out


# ---------------------------------------------------------------------------- statistics over all ranks


def global_whiten(adv: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``learner.losses.masked_whiten`` with mean and variance over the real tokens of every rank's rows."""
    return masked_whiten(adv, mask, eps=eps, reduce_sum=all_reduce_sum)


def global_explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> tuple[float, float]:
    """``learner.losses.explained_variance`` (EV, mean value) over the real tokens of every rank's rows."""
    return explained_variance(values, returns, mask, reduce_sum=all_reduce_sum)


def shutdown_distributed() -> None:
    """Destroy the process group; a no-op without one. Only where nothing else holds the group does this
    also stop gloo's worker threads (``exit_process`` is what makes an exit safe)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a learner rank with ``code`` without interpreter finalisation.

    A gloo worker thread releases a finished collective's tensors after the caller's ``wait`` returned; when
    Python no longer holds them, that release needs the GIL, and during interpreter finalisation taking the
    GIL ends the thread inside a C++ destructor: std::terminate, SIGABRT ("terminate called without an
    active exception"; seen in 1 of 6 two-rank exits, 3 of 16 under load, even after
    ``destroy_process_group`` while DeepSpeed's modules still hold the group). So the group is destroyed,
    logs and stdio flushed, and the process leaves with ``os._exit``. Everything durable (checkpoints,
    weights, metrics.jsonl, learner_done.json) is written and closed before this is called."""
    shutdown_distributed()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
    os._exit(code)


__all__ = ["exit_process", "global_explained_variance", "rank", "setup_distributed"]
