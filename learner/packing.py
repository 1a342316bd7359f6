"""Packed micro-batches: a micro-batch's rows concatenated into one token stream, no padding (not a CLI).

    packed = pack(batch, rows)                                   # [1, N] ids, positions restarting per row
    out = model(input_ids=packed.input_ids, **packed.model_kwargs())
    per_row = unpack(x, packed)                                  # [1, N, ...] -> [rows, T, ...] at response slots

Row i (prompt p_i tokens, response n_i) occupies ``[offset_i, offset_i + p_i + n_i)`` of the stream; its position ids
restart at 0, so rotary embeddings see each row as it was generated. Attention is block-diagonal causal: a token
attends to the earlier tokens of its own row only. HF models take it through the ``vapo_packed`` attention
implementation registered here, which runs causal SDPA over the rows (``cu_seq_lens_q`` marks them): exact (checked
on the CPU against each row alone), and on CUDA a causal call without a mask is what SDPA's flash kernel takes (no
``[N, N]`` mask is ever built; not yet run on a GPU). Rows of
similar length share one call (``attention_buckets``: one call per row would cost more in call overhead than short rows
cost in attention). Called without ``cu_seq_lens_q`` (generation, the padded layout) it is SDPA itself, so a model can
keep the implementation for good.

As in ``learner.batch``, the logits (or values) that score response token t of row i sit at its sequence index
``p_i + t − 1``, here shifted by the row's offset in the stream (``Packed.positions``, ``[rows, T]``).

Deviation from verl/slime: they pass ``position_ids`` to flash-attn's varlen kernel (``flash_attention_2``); vapo ships
no flash-attn build, so SDPA over length buckets stands in for it (a few calls per layer, some padding inside each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from learner.batch import Batch

ATTENTION = "vapo_packed"  # the attention implementation name models are switched to (``use_packed_attention``)


@dataclass(frozen=True)
class Packed:
    """One packed micro-batch."""

    rows: Tensor  # [n] batch rows, in stream order
    input_ids: Tensor  # [1, N] long
    position_ids: Tensor  # [1, N] long: 0.. within each row
    cu_seqlens: Tensor  # [n + 1] int32: row i is stream[cu_seqlens[i]:cu_seqlens[i + 1]]
    max_len: int  # longest row (tokens)
    positions: Tensor  # [n, T] long: stream index whose logits/hidden state score response token t (masked slots: the
    #                    row's last prompt token, as in learner.batch)
    response_start: Tensor  # [1, N] bool: the token is a response token (the critic's surprise features read these)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def model_kwargs(self) -> dict[str, Any]:
        """What an HF decoder needs besides ``input_ids``: position ids, the rows, and no mask (a mask dict with
        no entries makes transformers skip building an ``[N, N]`` one: ``vapo_packed`` needs none)."""
        return {"position_ids": self.position_ids, "attention_mask": {"full_attention": None, "sliding_attention": None},
                "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_len, "max_length_k": self.max_len}

    def to(self, device: torch.device | str) -> Packed:
        return Packed(self.rows, self.input_ids.to(device), self.position_ids.to(device), self.cu_seqlens.to(device),
                      self.max_len, self.positions.to(device), self.response_start.to(device))


def pack(batch: Batch, rows: Tensor) -> Packed:
    """Rows ``rows`` of ``batch`` as one stream (each row's prompt + response, no padding)."""
    rows = torch.as_tensor(rows, dtype=torch.long)
    plen, rlen = batch.prompt_lengths[rows], batch.lengths[rows]
    seq = plen + rlen
    cu = torch.zeros(len(rows) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(seq, 0)
    n_tok = int(cu[-1])
    row_of = torch.repeat_interleave(torch.arange(len(rows)), seq)  # [N] the stream token's row (0..n-1)
    pos = torch.arange(n_tok) - cu[:-1][row_of]  # [N] index within its row
    ids = batch.input_ids[rows[row_of], pos]
    T = max(1, int(rlen.max())) if len(rows) else 1
    positions = batch.positions[rows, :T] + cu[:-1, None]
    start = pos >= plen[row_of]
    return Packed(rows=rows, input_ids=ids[None], position_ids=pos[None], cu_seqlens=cu.to(torch.int32),
                  max_len=int(seq.max()) if len(rows) else 0, positions=positions, response_start=start[None])


def unpack(x: Tensor, packed: Packed) -> Tensor:
    """``x[0, packed.positions]``: ``[1, N]`` or ``[1, N, D]`` stream values → ``[rows, T]`` / ``[rows, T, D]``."""
    return x[0][packed.positions.to(x.device)]


def segment_cummin(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Running minimum of ``x`` ``[N]`` that restarts at every row boundary of ``cu_seqlens``."""
    cu = cu_seqlens.to(torch.long).cpu()
    seq = cu[1:] - cu[:-1]
    if len(seq) == 0:
        return x
    row_of = torch.repeat_interleave(torch.arange(len(seq)), seq).to(x.device)
    pos = torch.arange(x.shape[0], device=x.device) - cu[:-1].to(x.device)[row_of]
    grid = x.new_full((len(seq), int(seq.max())), float("inf"))
    grid[row_of, pos] = x
    return torch.cummin(grid, dim=1).values[row_of, pos]


SHORT_ROW = 256  # rows up to this long share one attention call: per-call overhead outweighs their padding
BUCKET_RATIO = 0.8  # a longer row's call takes rows of at least this fraction of its length (≤ 1/0.8² the work)


def attention_buckets(lengths: list[int]) -> list[list[int]]:
    """Rows (indices into ``lengths``) grouped for batched attention calls: longest first, a call takes the rows
    of at least ``BUCKET_RATIO`` × its longest, and every row up to ``SHORT_ROW`` tokens shares one call."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        if out and (lengths[i] >= BUCKET_RATIO * lengths[out[-1][0]] or lengths[out[-1][0]] <= SHORT_ROW):
            out[-1].append(i)
        else:
            out.append([i])
    return out


_plan: dict[str, Any] = {}  # the last stream's buckets and gather indices: every layer of a forward reuses them


@dataclass(frozen=True)
class _Bucket:
    """One attention call: a single row is a slice of the stream (``index`` None); several rows are gathered into
    ``[n, L]`` slots (``index``: the stream index of each slot, slots past a row's end reading its first token) and
    only the real slots (``real``, positions in the ``n·L`` slots) are written back to ``dst`` in the stream."""

    start: int
    L: int
    index: Tensor | None = None  # [n·L] long
    real: Tensor | None = None  # [r] long
    dst: Tensor | None = None  # [r] long


def _gather_plan(cu: Tensor) -> list[_Bucket]:
    if _plan.get("cu") is cu:
        return _plan["buckets"]
    bounds = cu.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    plan = []
    for rows in attention_buckets(lengths):
        L = lengths[rows[0]]
        if len(rows) == 1:
            plan.append(_Bucket(bounds[rows[0]], L))
            continue
        start = torch.tensor([bounds[i] for i in rows], device=cu.device)[:, None]
        slot = torch.arange(L, device=cu.device)[None, :]
        real = slot < torch.tensor([lengths[i] for i in rows], device=cu.device)[:, None]
        index = torch.where(real, start + slot, start).flatten()
        kept = real.flatten().nonzero().squeeze(1)
        plan.append(_Bucket(0, L, index, kept, index[kept]))
    _plan.update(cu=cu, buckets=plan)
    return plan


def _packed_attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """Block-diagonal causal attention over the rows that ``cu_seq_lens_q`` marks (query ``[1, heads, N, d]``,
    key/value ``[1, kv_heads, N, d]``) → ``[1, N, heads, d]``; plain SDPA when the call is not packed.

    Rows of similar length are gathered into one right-padded batch and run as one causal SDPA call
    (``attention_buckets``): a real query attends only to earlier slots of its own row, all real, so the padding
    changes nothing; only the real slots are written back. A row alone in its call is a slice of the stream: no
    gather, and its backward no scatter."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    gqa, p = query.shape[1] != key.shape[1], dropout if module.training else 0.0
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, d]
    out = q.new_empty(q.shape)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for b in _gather_plan(cu):
        index, real, dst = b.index, b.real, b.dst
        if index is None or real is None or dst is None:  # one row: all three are None
            qs, ks, vs = (x[b.start:b.start + b.L].transpose(0, 1)[None] for x in (q, k, v))
            o = sdpa(qs, ks, vs, is_causal=True, scale=scaling, dropout_p=p, enable_gqa=gqa)  # [1, heads, L, d]
            out[b.start:b.start + b.L] = o[0].transpose(0, 1)
            continue
        n = index.numel() // b.L
        qg, kg, vg = (x.index_select(0, index).view(n, b.L, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        o = sdpa(qg, kg, vg, is_causal=True, scale=scaling, dropout_p=p, enable_gqa=gqa)  # [n, heads, L, d]
        out.index_copy_(0, dst, o.transpose(1, 2).flatten(0, 1).index_select(0, real))
    return out[None], None


AttentionInterface.register(ATTENTION, _packed_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # unpacked calls get SDPA's masks


def use_packed_attention(model: torch.nn.Module) -> None:
    """Switch an HF model (and its sub-configs) to ``vapo_packed``: exact for packed calls, SDPA otherwise."""
    config: Any = model.config  # nn.Module's __getattr__ types an HF model's config as Tensor | Module
    config._attn_implementation = ATTENTION
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) not in (None, ATTENTION):
            cfg._attn_implementation = ATTENTION
