"""A (ZeRO-3 or plain) model's tensors to and from host memory, a bounded group of parameters at a time.

Not a CLI. ``iter_host_tensors`` streams a model's state dict to rank 0's host memory (the weight export of
``learner.weights``, the critic's save and ``full_state_dict`` of ``learner.models``); ``load_host_tensors``
is its inverse (value pretraining's best critic back into the model). Under ZeRO-3 both are collectives:
every rank gathers each group of at most ``GATHER_BYTES`` with the others, and only rank 0 keeps host copies,
so no rank ever holds the whole model. ``tied_aliases`` names the tied weights a file stores once;
``gathered`` is DeepSpeed's gather of a group (``learner.weight_push`` and ``learner.partitioned`` use both).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from learner.dist import rank

try:
    from transformers.modeling_utils import _get_tied_weight_keys
except ImportError:  # other transformers layouts: keep the first name of each tied group
    # The ignore: None marks the helper absent (checked before each use), not a callable.
    _get_tied_weight_keys = None  # type: ignore[assignment]

GATHER_BYTES = 256 << 20  # bound on one ZeRO-3 gather group (a larger single parameter is its own group)


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


def tied_aliases(module: nn.Module, entries: list[tuple[str, Tensor]]) -> dict[str, str]:
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
    alias = tied_aliases(module, entries)
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


def gathered(params: list[Tensor], modifier_rank: int | None) -> Any:
    """DeepSpeed's gather of ZeRO-3 ``params`` (a no-op context when there are none)."""
    if not params:
        return nullcontext()
    import deepspeed  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def _gather_group(group: list[tuple[str, Tensor]], to_host: bool, copy: bool) -> list[tuple[str, Tensor | None]]:
    """Host copies of one group (on the rank with ``to_host``; ``None`` elsewhere); collective under ZeRO-3.

    The gathered full tensors are released on leaving, before the caller sees the group."""
    with gathered([t for _, t in group if hasattr(t, "ds_id")], modifier_rank=None):
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
    alias = tied_aliases(module, entries)
    entries = [(n, t) for n, t in entries if n not in alias]
    # Checked on rank 0 but raised only after the gathers: raising first would leave the others in one.
    missing = sorted(n for n, _ in entries if n not in (state or {})) if me == 0 else []
    for group in _groups(entries, GATHER_BYTES):
        with gathered([t for _, t in group if hasattr(t, "ds_id")], modifier_rank=0):
            for name, t in group:
                if me == 0 and state is not None and name in state:
                    t.data.copy_(state[name].to(t.device))
                if not hasattr(t, "ds_id"):  # replicated buffers: every rank takes rank 0's
                    torch.distributed.broadcast(t.data, src=0)
    if missing:
        raise KeyError(f"load_host_tensors: {len(missing)} state-dict names missing from the state, e.g. "
                       f"{missing[:3]}; the model now holds a mix of old and new weights")
