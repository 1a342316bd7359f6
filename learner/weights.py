"""Weight push: the policy as HF safetensors in ``<run dir>/weights/v<N>/``, announced on ZeroMQ.

Not a CLI; ``learner.runner`` calls ``publish_policy`` after every ``learner.weights_every`` updates.

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
- Streaming export (every whole-model export goes through ``iter_host_tensors``): under ZeRO-3 the ranks
  gather the parameters together, a group of at most ``GATHER_BYTES`` at a time, and only rank 0 copies a
  group to host memory and writes it into safetensors shards of at most ``SHARD_BYTES``. A non-zero rank
  never holds more than its partition plus one gathered group, and rank 0 holds one shard plus one group;
  gathering the whole model on every rank would need the full model's size in host memory per rank
  (~64 GB for a 32B policy in bf16). Without ZeRO-3 rank 0 alone reads its own full copy. The files are
  what ``save_pretrained`` writes (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` +
  ``model.safetensors.index.json``; config, generation config, tokenizer), byte for byte when one shard.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from common import protocol
from common.checksum import weights_sha256
from learner.dist import rank

try:
    from transformers.modeling_utils import _get_tied_weight_keys
except ImportError:  # other transformers layouts: keep the first name of each tied group
    _get_tied_weight_keys = None
try:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange
except ImportError:  # transformers before its weight conversions: nothing to convert
    get_model_conversion_mapping = None

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


GATHER_BYTES = 256 << 20  # bound on one ZeRO-3 gather group (a larger single parameter is its own group)
SHARD_BYTES = 4 << 30  # bound on one safetensors shard (a larger single tensor is its own shard)
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def unwrap(model: Any) -> nn.Module:
    """The ``nn.Module`` of a DeepSpeed-wrapped model (or the module itself)."""
    return model.module if hasattr(model, "zero_optimization_stage") else model


def is_partitioned(module: nn.Module) -> bool:
    """Whether ZeRO-3 has partitioned the module's parameters (each rank holds a slice)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _nbytes(t: Tensor) -> int:
    return int(getattr(t, "ds_numel", t.numel())) * t.element_size()


def _tied_patterns(module: nn.Module) -> list[str]:
    if _get_tied_weight_keys is None:
        return []
    try:
        return list(_get_tied_weight_keys(module))
    except (AttributeError, TypeError):  # not a PreTrainedModel
        return []


def _aliases(module: nn.Module, entries: list[tuple[str, Tensor]]) -> dict[str, str]:
    """``{alias: kept name}`` for state-dict names that are the same tensor (tied weights).

    safetensors cannot store one tensor twice; like ``save_pretrained``, the names the model declares as
    tied (``lm_head.weight``) are dropped and the one it expects on reload is kept."""
    by_id: dict[int, list[str]] = {}
    for name, t in entries:
        by_id.setdefault(id(t), []).append(name)
    patterns = _tied_patterns(module)
    out: dict[str, str] = {}
    for names in by_id.values():
        if len(names) < 2:
            continue
        names = sorted(names)
        declared = [n for n in names if any(re.search(pat, n) for pat in patterns)]
        keep = next((n for n in names if n not in declared), names[0])
        out.update({n: keep for n in names if n != keep})
    return out


def iter_host_tensors(model: Any, copy: bool = False, aliases: bool = False) -> Iterator[tuple[str, Tensor | None]]:
    """Every state-dict entry of ``model`` (DeepSpeed-wrapped or plain module) as ``(name, host tensor)``, in state-dict order.

    Under ZeRO-3 this is a collective: every rank must run it to the end. Parameters are gathered a group
    of at most ``GATHER_BYTES`` at a time; rank 0 gets a host copy of each, the other ranks get
    ``(name, None)`` and hold nothing after the group is released. Without ZeRO-3 only rank 0 yields
    (other ranks get an empty iterator), and it yields its own tensors, copied only when ``copy`` or when
    they live on an accelerator. Tied names are skipped unless ``aliases`` (then they share one host tensor)."""
    module = unwrap(model)
    partitioned = is_partitioned(module)
    me = rank()
    if not partitioned and me != 0:
        return
    entries = list(module.state_dict(keep_vars=True).items())
    alias = _aliases(module, entries)
    kept_for_alias = set(alias.values())
    shared: dict[str, Tensor] = {}  # rank 0: host tensors that aliases will point at
    for group in _groups([(n, t) for n, t in entries if n not in alias], GATHER_BYTES):
        for key, host in _gather_group(group, me == 0, copy):
            if host is not None and key in kept_for_alias:
                shared[key] = host
            yield key, host
    if aliases:
        for name, keep in alias.items():
            yield name, shared.get(keep)


def _groups(entries: list[tuple[str, Tensor]], bound: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive runs of ``entries`` of at most ``bound`` bytes (full sizes; a larger tensor is alone)."""
    group: list[tuple[str, Tensor]] = []
    size = 0
    for name, t in entries:
        if group and size + _nbytes(t) > bound:
            yield group
            group, size = [], 0
        group.append((name, t))
        size += _nbytes(t)
    if group:
        yield group


def _gathered(params: list[Tensor], modifier_rank: int | None) -> Any:
    """DeepSpeed's gather of ZeRO-3 ``params`` (a no-op context when there are none)."""
    if not params:
        return nullcontext()
    import deepspeed  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def _gather_group(group: list[tuple[str, Tensor]], to_host: bool, copy: bool) -> list[tuple[str, Tensor | None]]:
    """Host copies of one group (on the rank with ``to_host``; ``None`` elsewhere); collective under ZeRO-3.

    The gathered full tensors are released on leaving, before the caller sees the group."""
    with _gathered([t for _, t in group if hasattr(t, "ds_id")], modifier_rank=None):
        if not to_host:
            return [(name, None) for name, _ in group]
        return [(name, t.detach().to("cpu", copy=copy or hasattr(t, "ds_id") or t.device.type != "cpu"))
                for name, t in group]


def load_host_tensors(model: Any, state: dict[str, Tensor] | None) -> None:
    """Copy ``state`` (full host tensors held by rank 0; ignored elsewhere) into ``model``: the inverse of
    ``iter_host_tensors``.

    Under ZeRO-3 every rank calls it: each group of at most ``GATHER_BYTES`` is gathered, rank 0 writes
    into it, and DeepSpeed hands every rank its slice of rank 0's values when the group is released.
    Without ZeRO-3 rank 0 alone loads (the other ranks return at once)."""
    module = unwrap(model)
    me = rank()
    if not is_partitioned(module):
        if me == 0:
            module.load_state_dict(state or {})
        return
    entries = list(module.state_dict(keep_vars=True).items())
    alias = _aliases(module, entries)
    entries = [(n, t) for n, t in entries if n not in alias]
    # Checked on rank 0 but raised only after the gathers: raising first would leave the others in one.
    missing = sorted(n for n, _ in entries if n not in (state or {})) if me == 0 else []
    for group in _groups(entries, GATHER_BYTES):
        with _gathered([t for _, t in group if hasattr(t, "ds_id")], modifier_rank=0):
            for name, t in group:
                if me == 0 and state is not None and name in state:
                    t.data.copy_(state[name].to(t.device))
                if not hasattr(t, "ds_id"):  # replicated buffers: every rank takes rank 0's
                    torch.distributed.broadcast(t.data, src=0)
    if missing:
        raise KeyError(f"load_host_tensors: {len(missing)} state-dict names missing from the state, e.g. "
                       f"{missing[:3]}; the model now holds a mix of old and new weights")


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
        conversions = [c for c in get_model_conversion_mapping(module, add_legacy=False)
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
    error: BaseException | None = None
    writer = ShardWriter(out)
    convert = _needs_conversion(module)
    full: dict[str, Tensor] = {}
    for name, t in iter_host_tensors(module):
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
        module.save_pretrained(out, state_dict=full, safe_serialization=True)
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
            if getattr(module, "can_generate", lambda: False)() and getattr(module, "generation_config", None):
                module.generation_config.save_pretrained(out)
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
