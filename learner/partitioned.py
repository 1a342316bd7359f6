"""Building a ZeRO-3 model without any rank holding the whole of it (used by ``learner.models``; not a CLI).

    model = build_empty(AutoModelForCausalLM, hf_config, dtype, ds_config)   # partitioned as built, no init
    load_checkpoint(model, src)                       # HF safetensors files → the partitions

``load_checkpoint`` needs no collective: every rank reads, with plain file reads (no mmap, so no file pages
stay resident), only its own ZeRO-3 slice of each flattened tensor straight into its partition. Without
this every rank loaded the full model (``from_pretrained``) and ZeRO-3 partitioned it only in
``deepspeed.initialize``: a transient of the whole model per rank (32B in bf16: 64 GB of host memory per
rank, ~0.5 TB per 8-GPU host, and the whole model on each GPU).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from learner.host_tensors import is_partitioned, tied_aliases

try:
    from transformers.initialization import no_init_weights
except ImportError:  # older transformers: the random init runs (on each submodule, before it is partitioned)
    # The ignore: None marks it absent (checked before use), not a context manager.
    no_init_weights = None  # type: ignore[assignment]


@contextmanager
def _no_init() -> Iterator[None]:
    if no_init_weights is None:
        yield
        return
    with no_init_weights():
        yield


def build_empty(auto_cls: Any, hf_config: Any, dtype: torch.dtype, ds_config: dict[str, Any]) -> nn.Module:
    """``auto_cls.from_config`` ZeRO-3-partitioned submodule by submodule as it is built (``deepspeed.zero.Init``,
    in the dtype ``ds_config`` trains in), without the random init (every weight is loaded next; HF's init
    would also index partitions that are empty). The process group must exist (``setup_distributed``)."""
    import deepspeed  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR

    class InitUnsynced(deepspeed.zero.Init):
        """zero.Init without its broadcast of each new parameter from rank 0: every value is loaded from
        the files next, and receiving the broadcast would make each other rank write (make resident) every
        submodule's whole parameters on the way."""

        def _zero_init_param(self, param: Any) -> None:
            self._convert_to_deepspeed_param(param)
            param.partition()

    with InitUnsynced(config_dict_or_path=ds_config), _no_init():
        model = auto_cls.from_config(hf_config, dtype=dtype)
    model.tie_weights()  # init_weights, skipped above, is what ties the LM head to the embeddings
    return model


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclass(frozen=True)
class _Entry:
    """Where one tensor's bytes lie in a safetensors file."""

    path: Path
    dtype: torch.dtype
    numel: int
    offset: int  # of its first byte in the file


def _read_header(path: Path) -> dict[str, _Entry]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        numel = 1
        for d in h["shape"]:
            numel *= int(d)
        out[name] = _Entry(path, _DTYPES[h["dtype"]], numel, base + int(h["data_offsets"][0]))
    return out


def checkpoint_index(src: Path) -> dict[str, _Entry]:
    """``{tensor name: where it lies}`` for the safetensors checkpoint in ``src`` (one file or sharded)."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{src}: no model.safetensors or model.safetensors.index.json")
    out: dict[str, _Entry] = {}
    for name in files:
        out.update(_read_header(src / name))
    return out


def _file_name(name: str, index: dict[str, _Entry]) -> str | None:
    """The checkpoint's name for the module's ``name``: a causal LM's files prefix its backbone with
    ``model.``, a saved critic backbone's do not."""
    for cand in (name, f"model.{name}", name.removeprefix("model.")):
        if cand in index:
            return cand
    return None


def _read_range(e: _Entry, start: int, count: int, dst: torch.Tensor) -> None:
    """Elements ``[start, start + count)`` of the file's flat tensor into ``dst[:count]`` (any device/dtype)."""
    direct = dst.device.type == "cpu" and dst.dtype == e.dtype and dst.is_contiguous()
    buf = dst[:count] if direct else torch.empty(count, dtype=e.dtype)
    if count:
        with e.path.open("rb") as f:
            f.seek(e.offset + start * buf.element_size())
            view = buf.view(torch.uint8).numpy().data.cast("B")
            if f.readinto(view) != count * buf.element_size():
                raise OSError(f"{e.path}: truncated tensor data")
    if not direct:
        with torch.no_grad():
            dst[:count].copy_(buf)


def _load_one(t: torch.Tensor, e: _Entry) -> None:
    """``t``'s values from the file: this rank's ZeRO-3 slice of the flattened tensor, or all of it."""
    if not hasattr(t, "ds_id"):
        _read_range(e, 0, e.numel, t.data.view(-1))
        return
    zero: Any = t  # ZeRO-3 adds ds_tensor and ds_process_group to the parameters it partitions
    part = zero.ds_tensor
    size = int(part.ds_numel)
    me = torch.distributed.get_rank(group=zero.ds_process_group)
    start = min(me * size, e.numel)
    count = max(0, min(size, e.numel - start))
    _read_range(e, start, count, part.data)
    if count < size:
        part.data[count:].zero_()  # padding of the last partition


def load_checkpoint(module: nn.Module, src: str | Path) -> None:
    """Copy the HF checkpoint in ``src`` into ``module`` (ZeRO-3-partitioned or not); no collective.

    Each rank reads only its own slice of each partitioned tensor (every rank needs ``src`` at the same
    path, as for ``from_pretrained``; on several hosts that is the shared filesystem docs/MULTIHOST.md requires),
    straight into its partition; replicated tensors (buffers, parameters ZeRO-3 does not partition) in full.
    So no rank ever holds more than its partitions plus one tensor's slice of a dtype conversion."""
    src = Path(src)
    index = checkpoint_index(src)
    entries = list(module.state_dict(keep_vars=True).items())
    alias = tied_aliases(module, entries)
    missing = []
    for name, t in entries:
        if name in alias:
            continue
        key = _file_name(name, index)
        if key is None:
            missing.append(name)
            continue
        e = index[key]
        full = int(getattr(t, "ds_numel", t.numel()))
        if e.numel != full:
            raise ValueError(f"load_checkpoint: {key} in {e.path} has {e.numel} elements, the model's {name} {full}")
        _load_one(t, e)
    if missing:
        raise KeyError(f"load_checkpoint: {len(missing)} tensors of the model are missing from {src}, e.g. {missing[:3]}")


def to_device(module: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """``module.to(device)``, except that ZeRO-3 partitions stay where ``zero.Init`` put them: only the
    parameters and buffers it has not partitioned (a value head built outside it) move, and those
    parameters take ``dtype`` (the one the partitions train in), as ``deepspeed.initialize`` converts a
    module it partitions itself but not one that is already partitioned."""
    if not is_partitioned(module):
        return module.to(device)
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and not hasattr(p, "ds_id"):
                p.data = p.data.to(device, dtype=dtype if dtype is not None and p.is_floating_point() else None)
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = b.to(device)
    return module


__all__ = ["checkpoint_index"]
