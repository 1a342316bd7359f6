"""Full learner checkpoints: both models (policy, critic) with optimizer state, version, RNG state, data cursor.

Not a CLI; ``learner.runner`` calls ``save`` every ``learner.checkpoint_every`` versions and, on start,
``choose`` (rank 0) then ``load`` (every rank) when ``learner.resume`` is ``auto`` or a path.
``learner.export`` reads a checkpoint's policy out, offline (``newest_intact``, ``verify``).

Layout: ``<run dir>/checkpoints/v<N>/`` with ``policy/`` and ``critic/`` (DeepSpeed ``save_checkpoint``,
tag ``state``: module, optimizer, lr scheduler), ``rng_rank<r>.pt`` (torch / numpy / python RNG of each
rank), ``learner.json`` (version, samples seen, data-source cursor) and a ``COMPLETE`` marker. Every rank
writes into ``v<N>.tmp`` (rank 0 also ``learner.json``); after a barrier every rank reads its share of the
files back (the run dir is shared by the ranks, as everywhere else), hashing (sha256, size) and fsyncing
each, and rank 0, with every digest, fsyncs every directory, writes ``COMPLETE`` (JSON: the digests by
relative path) and fsyncs it, renames the directory and fsyncs ``checkpoints/``. Without the fsyncs a
power loss could keep the rename but not the data: a ``v<N>`` whose marker promises files that are
truncated. A crash leaves at most a ``.tmp`` that the next save of that version removes. The newest ``learner.keep_checkpoints`` complete ones are kept.

``verify`` checks a checkpoint against its ``COMPLETE``: every listed file present with its size and
digest, ``learner.json`` readable. A checkpoint from before digests (``COMPLETE`` holds only the version)
is loaded as before, unverified, once its ``learner.json`` reads. ``choose`` takes the newest intact
checkpoint: a damaged newer one is renamed aside to ``v<N>.damaged`` (never deleted: the operator may want
it; no longer a ``v<N>``, so pruning and ``latest_checkpoint`` pass it by) and the log says which file
was wrong and how many versions the run goes back; ``learner.resume_damaged=refuse`` raises instead,
naming the file and the intact alternative.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.dist import broadcast_bytes, rank, rank0_wait, world_size

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
DAMAGED = ".damaged"  # suffix of a damaged checkpoint renamed aside
FORMAT = 2  # COMPLETE with per-file digests; a bare version number is format 1
_CHUNK = 1 << 22
# hashlib releases the GIL on large updates: a few threads read and hash several files at once.
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))


class CheckpointDamaged(RuntimeError):
    """A checkpoint whose files do not match its ``COMPLETE``; ``file`` is relative to the checkpoint."""

    def __init__(self, path: Path, file: str, problem: str, advice: str = "") -> None:
        self.path, self.file, self.problem = path, file, problem
        self.what = f"{path.name} damaged ({file}: {problem})"
        super().__init__(f"{self.what}{'; ' + advice if advice else ''}")


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (a directory's fsync makes its entries, e.g. a rename, durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path, sync: bool = False) -> dict[str, Any]:
    """``{"size", "sha256"}`` of ``path``; with ``sync`` the file is fsynced through the same descriptor."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(fh.fileno())
    return {"size": size, "sha256": h.hexdigest()}


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != COMPLETE)


def digests(d: Path, sync: bool = False) -> dict[str, dict[str, Any]]:
    """Every file under ``d`` but ``COMPLETE``: relative path -> size and sha256 (hashed in threads)."""
    names = _files(d)
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        return dict(zip(names, pool.map(lambda n: file_digest(d / n, sync), names), strict=True))


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(version, path)`` of every ``v<N>`` with a ``COMPLETE`` marker, oldest first (not verified)."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit() and (p / COMPLETE).is_file():
                out.append((int(p.name[1:]), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> Path | None:
    cps = complete_checkpoints(root)
    return cps[-1][1] if cps else None


def _share(sizes: dict[str, int], n: int) -> list[list[str]]:
    """The files split over ``n`` ranks, largest first to the least loaded (every rank computes the same)."""
    parts: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        i = load.index(min(load))
        parts[i].append(name)
        load[i] += sizes[name]
    return parts


def _hash_shared(tmp: Path) -> dict[str, dict[str, Any]] | None:
    """Every rank hashes and fsyncs its share of ``tmp``'s files (rank 0's listing, broadcast: a network
    filesystem may show another host a stale listing); rank 0 gets every digest, the others None. Spread
    over the ranks, a checkpoint of N bytes costs each about N / world size of reading back."""
    n = world_size()
    if n == 1:
        return digests(tmp, sync=True)
    listing = json.dumps({f: (tmp / f).stat().st_size for f in _files(tmp)}).encode() if rank() == 0 else None
    mine = _share(json.loads(broadcast_bytes(listing)), n)[rank()]
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        part = json.dumps(dict(zip(mine, pool.map(lambda f: file_digest(tmp / f, True), mine), strict=True))).encode()
    # Rank 0 collects the parts (their lengths first): raw bytes in uint8 tensors, nothing pickled.
    lengths = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
    torch.distributed.all_gather(lengths, torch.tensor([len(part)], dtype=torch.long))
    width = max(int(t) for t in lengths)
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(part)] = torch.frombuffer(bytearray(part), dtype=torch.uint8)
    bufs = [torch.zeros(width, dtype=torch.uint8) for _ in range(n)]
    torch.distributed.all_gather(bufs, buf)
    if rank() != 0:
        return None
    files: dict[str, dict[str, Any]] = {}
    for b, length in zip(bufs, lengths, strict=True):
        files.update(json.loads(bytes(b[: int(length)].numpy().tobytes())))
    return dict(sorted(files.items()))


def _seal(tmp: Path, final: Path, version: int, files: dict[str, dict[str, Any]]) -> None:
    """Rank 0, once every file is hashed and fsynced: fsync the directories, write and fsync COMPLETE,
    rename, fsync the parent (module docstring)."""
    for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True) + [tmp]:
        fsync_path(d)
    _write_synced(tmp / COMPLETE, json.dumps({"format": FORMAT, "version": version, "files": files}))
    fsync_path(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_path(final.parent)


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
    if rank() == 0:
        src = learner.source.state_dict() if learner.source is not None else {}
        (tmp / "learner.json").write_text(json.dumps({
            "version": learner.version, "samples_seen": learner.samples_seen, "source": src, "saved_at": time.time(),
        }))
    _barrier()
    files = _hash_shared(tmp)
    # The directory work, pruning included, can take a while on a big tree: the others hear from rank 0 meanwhile.
    rank0_wait((lambda: _seal_and_prune(root, tmp, final, learner.version, files or {}, keep)) if rank() == 0 else None,
               f"sealing checkpoint {final.name}")
    return final


def _seal_and_prune(root: Path, tmp: Path, final: Path, version: int, files: dict[str, dict[str, Any]], keep: int) -> None:
    _seal(tmp, final, version, files)
    cps = complete_checkpoints(root)
    for _, p in cps[: max(0, len(cps) - max(keep, 1))]:
        shutil.rmtree(p, ignore_errors=True)


def _read_complete(path: Path) -> dict[str, Any] | None:
    """The digests of ``path``'s ``COMPLETE``, or None for a format-1 marker (the version alone)."""
    try:
        text = (path / COMPLETE).read_text()
    except OSError as e:
        raise CheckpointDamaged(path, COMPLETE, f"unreadable ({e.strerror or e})") from e
    if text.strip().isdigit():
        return None
    try:
        marker = json.loads(text)
        files = marker["files"]
        if not isinstance(files, dict) or not files or not all(isinstance(v, dict) for v in files.values()):
            raise ValueError("no files listed")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointDamaged(path, COMPLETE, f"not a checkpoint marker ({e})") from e
    return files


def _read_learner_json(path: Path) -> dict[str, Any]:
    try:
        info = json.loads((path / "learner.json").read_text())
        int(info["version"])
    except FileNotFoundError as e:
        raise CheckpointDamaged(path, "learner.json", "missing") from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointDamaged(path, "learner.json", f"unreadable ({type(e).__name__}: {e})") from e
    return info


def _digest_or_error(path: Path) -> dict[str, Any] | OSError:
    try:
        return file_digest(path)
    except OSError as e:
        return e


def verify(path: Path) -> bool:
    """Raise ``CheckpointDamaged`` unless ``path`` matches its ``COMPLETE``; False for an unverifiable
    format-1 checkpoint (only its ``learner.json`` checked), True when every digest matched."""
    files = _read_complete(path)
    if files is None:
        _read_learner_json(path)
        return False
    for name, want in sorted(files.items()):  # sizes first: a truncated file is found without reading anything
        p = path / name
        if not p.is_file():
            raise CheckpointDamaged(path, name, "missing")
        size = p.stat().st_size
        if size != want.get("size"):
            raise CheckpointDamaged(path, name, f"size {size} != {want.get('size')}")
    names = sorted(files)
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        got = dict(zip(names, pool.map(lambda n: _digest_or_error(path / n), names), strict=True))
    for name in names:
        digest, want = got[name], str(files[name].get("sha256"))
        if isinstance(digest, OSError):  # a bad block after a power loss reads as EIO
            raise CheckpointDamaged(path, name, f"unreadable ({digest.strerror or digest})")
        if digest["sha256"] != want:
            raise CheckpointDamaged(path, name, f"sha256 {digest['sha256'][:12]}… != {want[:12]}…")
    _read_learner_json(path)
    return True


def _check(path: Path) -> CheckpointDamaged | None:
    """The damage found in ``path``, or None (a format-1 checkpoint passes with a warning)."""
    try:
        if not verify(path):
            log.warning("%s has no digests (written before checkpoints carried them): loading it unverified", path)
    except CheckpointDamaged as e:
        return e
    return None


def check_explicit(path: Path) -> Path:
    """Rank 0: ``learner.resume=<path>`` verified; the operator chose it, so damage raises, whatever
    ``learner.resume_damaged`` says."""
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    err = _check(path)
    if err is not None:
        raise CheckpointDamaged(path, err.file, err.problem, "it was named by learner.resume; name another checkpoint")
    return path


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``v<N>.damaged`` (``.damaged.2``… if taken), durably; returns the new path."""
    dest, n = path.with_name(path.name + DAMAGED), 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}{DAMAGED}.{n}")
    path.rename(dest)
    fsync_path(path.parent)
    return dest


def newest_intact(root: Path) -> tuple[tuple[int, Path] | None, list[CheckpointDamaged]]:
    """``(version, path)`` of the newest intact checkpoint under ``root`` (None: none) and the damage of every
    newer complete one, newest first; verifies, renames nothing."""
    bad: list[CheckpointDamaged] = []
    for v, p in reversed(complete_checkpoints(root)):
        err = _check(p)
        if err is None:
            return (v, p), bad
        bad.append(err)
    return None, bad


def choose(root: Path, damaged: str = "fallback") -> Path | None:
    """Rank 0: the newest intact checkpoint under ``root`` (None when there is no complete one).

    Newer damaged ones are, with ``damaged="fallback"``, renamed aside and reported (file, problem, versions
    gone back); with ``"refuse"`` a ``CheckpointDamaged`` names the file and the intact alternative. No
    intact checkpoint at all raises in both modes: starting over from the base model is no fallback."""
    cps = complete_checkpoints(root)
    if not cps:
        return None
    chosen, bad = newest_intact(root)
    if not bad:
        return chosen[1] if chosen else None
    what = "; ".join(e.what for e in bad)
    if chosen is None:
        raise CheckpointDamaged(bad[0].path, bad[0].file, bad[0].problem,
                                f"no intact checkpoint under {root} ({what}); learner.resume=never starts over")
    back = cps[-1][0] - chosen[0]
    if damaged == "refuse":
        raise CheckpointDamaged(bad[0].path, bad[0].file, bad[0].problem,
                                f"the newest intact checkpoint is {chosen[1]} ({back} versions back); resume from it "
                                f"with learner.resume_damaged=fallback (renames {', '.join(e.path.name for e in bad)} "
                                f"to <name>{DAMAGED}) or learner.resume={chosen[1]}")
    aside = [set_aside(e.path).name for e in bad]
    log.warning("%s; resuming from %s, %d version%s back (set aside as %s)", what, chosen[1].name, back,
                "" if back == 1 else "s", ", ".join(aside))
    return chosen[1]


def load(path: Path, learner: Any) -> int:
    """Restore ``learner`` from checkpoint ``path`` (every rank; rank 0 verified it); returns the version."""
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    for name, model in (("policy", learner.policy), ("critic", learner.critic)):
        if model is None:
            continue
        try:
            loaded, _ = model.load_checkpoint(str(path / name), tag="state", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        except (OSError, RuntimeError, EOFError, ValueError) as e:
            # torch.load's errors (Errno 22 on a truncated zip, say) do not name the file.
            raise RuntimeError(f"cannot load the {name} checkpoint from {path / name}: {type(e).__name__}: {e}") from e
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the {name} checkpoint from {path / name}")
    info = _read_learner_json(path)
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


__all__ = ["complete_checkpoints", "newest_intact"]
