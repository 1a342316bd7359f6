"""The ``sgl_kernel`` that SGLang 0.5.23 imports on a CPU without AMX, in plain torch (no compiled code).

Installed by ``ops/setup.sh --sglang`` as the distribution ``vapo-sgl-kernel-cpu``. The package index has no
CPU build of sgl-kernel (``sglang-kernel`` is a CUDA build), and SGLang's upstream CPU build targets AMX
Xeons. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports nine names from here when its modules load:

- ``copy_all_layer_kv_cache_cpu`` and ``assign_req_to_token_pool_cpu``: implemented below (index copies;
  ``tests/ops/test_sgl_kernel_cpu.py`` checks them against a plain loop);
- seven speculative-decoding names: imported, never called by normal serving; each raises
  ``NotImplementedError`` naming itself, so speculative decoding fails loudly instead of computing garbage.

Nothing is registered under ``torch.ops.sgl_kernel``: SGLang calls these Python names, and it takes the
absence of ``torch.ops.sgl_kernel.convert_weight_packed`` to mean "no AMX kernels", which selects its
``forward_native`` torch layers (run it with ``--attention-backend torch_native``).
"""

from __future__ import annotations

import ctypes
from typing import Any, NoReturn

import torch

__version__ = "0.5.23+vapo.cpu"


def _rows(address: int, row_bytes: int, n_rows: int) -> torch.Tensor:
    """``n_rows`` rows of ``row_bytes`` bytes at ``address`` as a writable uint8 ``[n_rows, row_bytes]`` view."""
    raw = (ctypes.c_uint8 * (row_bytes * n_rows)).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(n_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """In each of the ``B`` buffers at ``data_ptrs`` (uint64 ``[B]``, row size in bytes ``strides`` ``[B]``),
    copy row ``src_loc[i]`` to row ``tgt_loc[i]`` (``[N]`` each); every source is read before any row is
    written, as the compiled kernel does."""
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc has {tgt_loc.numel()} entries, src_loc {src_loc.numel()}")
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.to(torch.long), src_loc.to(torch.long)
    n_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _rows(int(ptr) & (2**64 - 1), int(stride), n_rows)  # a uint64 read as int64 may be negative
        rows[tgt] = rows[src]  # the right side is gathered into a new tensor first: reads before writes


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` = the next
    ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (consumed in request order);
    ``req_to_token`` ``[R, pool_len]`` is written in place."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    at = 0
    for row, a, b in zip(req_pool_indices.tolist(), starts, ends, strict=True):
        n = int(b) - int(a)
        if n <= 0:
            continue
        if int(b) > pool_len:
            raise IndexError(f"end offset {b} past the pool length {pool_len}")
        req_to_token[int(row), int(a):int(b)] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


def _speculative(name: str) -> Any:
    def unavailable(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name}: speculative decoding needs SGLang's compiled CPU kernels; vapo's CPU "
            "install (ops/setup.sh --sglang) provides only what normal serving uses")

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable


SPECULATIVE_NAMES = (
    "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu", "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
    "rotate_input_ids_cpu",
)
build_tree_kernel_efficient_cpu = _speculative("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _speculative("verify_tree_greedy_cpu")
fill_accept_out_cache_loc_cpu = _speculative("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _speculative("fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = _speculative("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _speculative("assign_extend_cache_locs_cpu")
rotate_input_ids_cpu = _speculative("rotate_input_ids_cpu")

__all__ = ["SPECULATIVE_NAMES", "assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", *SPECULATIVE_NAMES]
