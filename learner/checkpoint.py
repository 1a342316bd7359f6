"""Full learner checkpoints: both models (policy, critic) with optimizer state, version, RNG state, data cursor.

Not a CLI; ``learner.runner`` calls ``save`` every ``learner.checkpoint_every`` versions and ``load`` on
start when ``learner.resume`` is ``auto`` (newest complete checkpoint) or a path.

Layout: ``<run dir>/checkpoints/v<N>/`` with ``policy/`` and ``critic/`` (DeepSpeed ``save_checkpoint``,
tag ``state``: module, optimizer, lr scheduler), ``rng_rank<r>.pt`` (torch / numpy / python RNG of each
rank), ``learner.json`` (version, samples seen, data-source cursor) and a ``COMPLETE`` marker. Every rank
writes into ``v<N>.tmp``; after a barrier rank 0 adds ``COMPLETE`` and renames the directory, so a
directory named ``v<N>`` is always whole; a crash leaves at most a ``.tmp`` that the next save removes.
The newest ``learner.keep_checkpoints`` are kept.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.dist import rank

COMPLETE = "COMPLETE"


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit() and (p / COMPLETE).is_file():
                out.append((int(p.name[1:]), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> Path | None:
    cps = complete_checkpoints(root)
    return cps[-1][1] if cps else None


def save(root: Path, learner: Any, keep: int) -> Path:
    """Checkpoint ``learner`` (collective: every rank calls it) as ``root/v<version>``."""
    final = root / f"v{learner.version}"
    tmp = root / f"v{learner.version}.tmp"
    if rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    learner.policy.save_checkpoint(str(tmp / "policy"), tag="state", save_latest=False)
    if learner.critic is not None:
        learner.critic.save_checkpoint(str(tmp / "critic"), tag="state", save_latest=False)
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               tmp / f"rng_rank{rank()}.pt")
    _barrier()
    if rank() == 0:
        src = learner.source.state_dict() if learner.source is not None else {}
        (tmp / "learner.json").write_text(json.dumps({
            "version": learner.version, "samples_seen": learner.samples_seen, "source": src, "saved_at": time.time(),
        }))
        (tmp / COMPLETE).write_text(str(learner.version))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        cps = complete_checkpoints(root)
        for _, p in cps[: max(0, len(cps) - max(keep, 1))]:
            shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return final


def load(path: Path, learner: Any) -> int:
    """Restore ``learner`` from checkpoint ``path``; returns the restored version."""
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    for name, model in (("policy", learner.policy), ("critic", learner.critic)):
        if model is None:
            continue
        loaded, _ = model.load_checkpoint(str(path / name), tag="state", load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the {name} checkpoint from {path / name}")
    info = json.loads((path / "learner.json").read_text())
    learner.version = int(info["version"])
    learner.samples_seen = int(info.get("samples_seen", 0))
    if learner.source is not None:
        learner.source.load_state_dict(info.get("source", {}))
    rng_file = path / f"rng_rank{rank()}.pt"
    if rng_file.is_file():
        # Our own file on local disk (not a socket); numpy/python RNG states need the full unpickler.
        st = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(st["torch"])
        np.random.set_state(st["numpy"])
        random.setstate(st["python"])
    return learner.version
