"""Weight push: the policy as HF safetensors in ``<run dir>/weights/v<N>/``, announced on ZeroMQ.

Not a CLI; ``learner.runner`` calls ``publish_policy`` after every ``learner.weights_every`` updates. ``write_hf``, the
HF writer behind every export, also writes a checkpoint's policy out (``learner.export``).

- Atomic versions: the HF files are written into ``v<N>.tmp``, then a ``STABLE`` marker
  (JSON: version, sha256, files, created_at) is written inside it, then the directory is renamed to
  ``v<N>``. A directory named ``v<N>`` is therefore always complete; readers must still check ``STABLE``.
- Checksum: ``common.checksum.weights_sha256`` (names, sizes and bytes of the ``*.safetensors`` files),
  the same function the actors verify with.
- ``WeightUpdate`` goes out on a PUB socket (``learner.publish_addr``); a REP socket
  (``learner.query_addr``) answers ``WeightQuery`` with the latest ``WeightUpdate`` (or ``ErrorReply``
  ``no_weights``), so a late or reconnecting subscriber never depends on a PUB message it missed.
- The newest ``learner.keep_weights`` versions are kept; older ones are deleted after each publish.
- Both sockets bind to 127.0.0.1 by default; any other bind needs CurveZMQ keys
  (``buffer.curve.*``, ``common.security``).
- Streaming export (every whole-model export goes through ``learner.host_tensors.iter_host_tensors``): under
  ZeRO-3 the ranks gather the parameters together, a group of at most ``GATHER_BYTES`` at a time, and only
  rank 0 copies a group to host memory and writes it into safetensors shards of at most ``SHARD_BYTES``. A non-zero rank
  never holds more than its partition plus one gathered group, and rank 0 holds one shard plus one group;
  gathering the whole model on every rank would need the full model's size in host memory per rank
  (~64 GB for a 32B policy in bf16). Without ZeRO-3 rank 0 alone reads its own full copy. The files are
  what ``save_pretrained`` writes (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` +
  ``model.safetensors.index.json``; config, generation config, tokenizer), byte for byte when one shard.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import PreTrainedModel

from common import protocol
from common.checksum import weights_sha256
from learner.dist import rank
from learner.host_tensors import is_partitioned, iter_host_tensors, unwrap

try:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange
except ImportError:  # transformers before its weight conversions: nothing to convert
    # The ignore: None marks the mapping absent (checked before use), not a callable.
    get_model_conversion_mapping = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
STABLE = "STABLE"


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version}"


def read_stable(path: Path) -> protocol.WeightUpdate | None:
    marker = path / STABLE
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
        return protocol.WeightUpdate(version=int(info["version"]), path=str(path.resolve()), sha256=info["sha256"],
                                     created_at=float(info["created_at"]))
    except (ValueError, KeyError, OSError):
        return None


def complete_versions(root: Path) -> list[int]:
    """Versions with a complete (STABLE) directory under ``root``, ascending."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit() and (p / STABLE).is_file():
                out.append(int(p.name[1:]))
    return sorted(out)


def latest_update(root: Path) -> protocol.WeightUpdate | None:
    vs = complete_versions(root)
    return read_stable(version_dir(root, vs[-1])) if vs else None


SHARD_BYTES = 4 << 30  # bound on one safetensors shard (a larger single tensor is its own shard)
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class ShardWriter:
    """Writes tensors as they arrive into safetensors shards of at most ``SHARD_BYTES`` (rank 0 only).

    Shards are first written under hidden part names; ``close`` gives them save_pretrained's names
    (``model.safetensors`` alone, or ``model-0000i-of-0000n.safetensors`` + the index) once their number is
    known. Holds at most one shard in memory."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.parts: list[tuple[Path, list[str]]] = []
        self.cur: dict[str, Tensor] = {}
        self.cur_bytes = 0
        self.total_bytes = 0

    def add(self, name: str, t: Tensor) -> None:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            # SGLang loads NaN/Inf weights without a word and then samples garbage: refuse at the source,
            # where the tensor is already in host memory (the actors' own check re-reads every file).
            raise ValueError(f"weight {name} has NaN or Inf values; this version is not published (training diverged?)")
        n = t.numel() * t.element_size()
        if self.cur and self.cur_bytes + n > SHARD_BYTES:
            self._flush()
        self.cur[name] = t.contiguous()
        self.cur_bytes += n
        self.total_bytes += n

    def _flush(self) -> None:
        part = self.out / f".part-{len(self.parts) + 1:05d}"
        save_file(self.cur, str(part), metadata={"format": "pt"})
        self.parts.append((part, list(self.cur)))
        self.cur, self.cur_bytes = {}, 0

    def close(self, total_parameters: int | None = None) -> list[str]:
        """Final names of the shard files written (the index too when there are several)."""
        if self.cur or not self.parts:
            self._flush()
        n = len(self.parts)
        if n == 1:
            self.parts[0][0].rename(self.out / WEIGHTS_NAME)
            return [WEIGHTS_NAME]
        weight_map: dict[str, str] = {}
        names = []
        for i, (part, keys) in enumerate(self.parts, start=1):
            name = f"model-{i:05d}-of-{n:05d}.safetensors"
            part.rename(self.out / name)
            names.append(name)
            weight_map.update({k: name for k in keys})
        meta: dict[str, int] = {"total_size": self.total_bytes}
        if total_parameters is not None:
            meta["total_parameters"] = total_parameters
        (self.out / INDEX_NAME).write_text(
            json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
        return names


def _needs_conversion(module: nn.Module) -> bool:
    """Whether transformers would rename or merge tensors on save (some MoE layouts); such a model cannot
    be written one group at a time because a converted tensor may need several state-dict entries."""
    if not hasattr(module, "can_generate"):
        return False
    conversions = getattr(module, "_weight_conversions", None)
    if conversions is None:
        if get_model_conversion_mapping is None:
            return False
        conversions = [c for c in get_model_conversion_mapping(cast(PreTrainedModel, module), add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    return bool(conversions)


def _num_parameters(module: nn.Module) -> int:
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


def export_hf(model: Any, out: Path, tokenizer: Any = None) -> list[str]:
    """Write ``model`` (HF ``PreTrainedModel`` or its DeepSpeed wrapper) into the existing directory ``out`` as
    ``save_pretrained`` would; returns the weight file names on rank 0, ``[]`` elsewhere.

    Collective under ZeRO-3 (every rank calls it; only rank 0 touches ``out``). An error on rank 0 is raised
    only after the gathers are done, so that the other ranks are never left waiting in a collective."""
    module = unwrap(model)
    if rank() != 0:
        _join_gathers(module)
        return []
    return write_hf(module, iter_host_tensors(module), out, tokenizer)


def write_hf(module: nn.Module, tensors: Iterable[tuple[str, Tensor | None]], out: Path, tokenizer: Any = None) -> list[str]:
    """The HF directory of ``module`` in ``out`` (existing): its state dict from ``tensors`` (name, host tensor;
    state-dict order, tied aliases left out) as safetensors shards, its config (dtype and architecture from
    ``module``), generation config and ``tokenizer``; returns the weight file names.

    ``module`` supplies everything but the values: ``export_hf`` passes the live model, ``learner.export`` a
    skeleton on the meta device. ``tensors`` is drained to its end even after an error (the gathers behind it
    may be collectives), and the error raised then."""
    error: BaseException | None = None
    writer = ShardWriter(out)
    convert = _needs_conversion(module)
    full: dict[str, Tensor] = {}
    for name, t in tensors:
        if error is not None or t is None:
            continue
        try:
            if convert:
                full[name] = t
            else:
                writer.add(name, t)
        except BaseException as e:  # re-raised below, after the collective
            error = e
    if error is not None:
        raise error
    if convert:
        # The converted layout needs the whole dict at once: rank 0 holds it, the other ranks still do not.
        cast(PreTrainedModel, module).save_pretrained(out, state_dict=full, safe_serialization=True)
        files = sorted(p.name for p in out.glob("*.safetensors"))
    else:
        files = writer.close(_num_parameters(module))
        config = getattr(module, "config", None)
        if config is not None:
            dtype = getattr(module, "dtype", None)
            if isinstance(dtype, torch.dtype):
                config.dtype = str(dtype).split(".")[1]
            config.architectures = [type(module).__name__]
            config.save_pretrained(out)
            generation: Any = getattr(module, "generation_config", None)
            if getattr(module, "can_generate", lambda: False)() and generation:
                generation.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return files


def _join_gathers(model: Any) -> None:
    """Take part in every gather of an export without keeping anything (non-writing ranks, failed rank 0)."""
    for _ in iter_host_tensors(model):
        pass


def write_version(root: Path, version: int, model: Any, tokenizer: Any) -> protocol.WeightUpdate | None:
    """Write ``model`` (HF ``PreTrainedModel`` or its DeepSpeed wrapper) as version ``version``.

    Collective under ZeRO-3; rank 0 writes and returns the WeightUpdate, every other rank returns None."""
    partitioned = is_partitioned(unwrap(model))
    if rank() != 0:
        if partitioned:
            _join_gathers(model)
        return None
    final = version_dir(root, version)
    tmp = root / f"v{version}.tmp"
    error: BaseException | None = None
    try:
        if final.exists():
            raise FileExistsError(f"weights {final} already exist; a version is never published twice")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except BaseException as e:  # the other ranks are about to gather with us
        error = e
    if error is not None:
        if partitioned:
            _join_gathers(model)
        raise error
    files = export_hf(model, tmp, tokenizer)
    digest = weights_sha256(tmp)
    created = time.time()
    (tmp / STABLE).write_text(json.dumps({"version": version, "sha256": digest, "files": sorted(files),
                                          "created_at": created}))
    tmp.rename(final)
    return protocol.WeightUpdate(version=version, path=str(final.resolve()), sha256=digest, created_at=created)


def prune(root: Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete versions and any leftover ``*.tmp`` directories."""
    removed = []
    vs = complete_versions(root)
    for v in vs[: max(0, len(vs) - max(keep, 1))]:
        shutil.rmtree(version_dir(root, v), ignore_errors=True)
        removed.append(v)
    for p in root.glob("v*.tmp") if root.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def publish_policy(policy: Any, tokenizer: Any, root: Path, version: int, keep: int,
                   publisher: Any | None) -> protocol.WeightUpdate | None:
    """Every rank calls this (ZeRO-3 gathers collectively, one group at a time); rank 0 alone copies to
    host, writes, publishes (``publisher``: a ``learner.publisher.WeightPublisher``) and prunes."""
    update = write_version(root, version, policy, tokenizer)
    if update is None:
        return None
    if publisher is not None:
        publisher.publish(update)
    prune(root, keep)
    return update


__all__ = ["complete_versions", "version_dir", "write_version"]
