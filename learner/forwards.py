"""The learner's forward passes over one micro-batch: the critic's V(s_t) and the policy's log π (not a CLI).

    v = critic_values(critic, batch, micro)                            # [n, T] fp32
    logp, ent, sub = policy_logprobs(policy, batch, micro, limits)     # [n, T] fp32
    values = compute_values(critic, batch, minibatches, limits)        # [B, T], no grad, this rank's rows

A micro-batch runs packed (``learner.packing``: one token stream, ``learner.packing``) or padded (rows right-padded
to the longest, ``Batch.select``); both give the same numbers (tests/learner/test_forwards.py).

The policy's LM head runs on the response positions only (``learner.logits_chunk_elements`` > 0) and as ONE call of
the head module per micro-batch and pass, whatever the chunk count: the model is called with ``logits_to_keep`` = the
response positions, and for that call the head's ``forward`` is the chunked log-prob computation itself
(``learner.losses.chunked_token_logprobs``, each chunk's ``[n, vocab]`` logits recomputed in the backward from the
head's weight). Under ZeRO-3 each module call gathers the module's weight, and a call order that changes between
micro-batches invalidates DeepSpeed's prefetch trace: calling the head once per chunk re-gathered it per chunk (1.56 GB
at Qwen2.5-32B) and, with a per-micro-batch chunk count, kept the trace from ever completing. Here the module order is
the same in every micro-batch, the head is gathered once per forward (and once per backward), and ranks may run
different chunk counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor

from learner.batch import Batch, gather_positions
from learner.losses import chunked_token_logprobs, entropy_from_logits, token_logprobs
from learner.packing import pack, unpack
from learner.schedule import Micro, MicroLimits, as_minibatches, micro_batches


def model_device(model: Any) -> torch.device:
    return next(model.module.parameters()).device


def critic_values(critic: Any, batch: Batch, micro: Micro) -> Tensor:
    """V(s_t) ``[len(rows), T_rows]`` fp32 with grad (T trimmed to those rows)."""
    dev = model_device(critic)
    behaviour = getattr(critic.module, "surprise_source", "") == "behaviour"
    if micro.packed:
        p = pack(batch, micro.rows).to(dev)
        lp = _at_own_positions(batch.select(micro.rows), p.positions, (1, p.tokens)) if behaviour else None
        v = critic(p.input_ids, None, None, packed=p, token_logprobs=lp)
        return unpack(v, p).float()
    sub = batch.select(micro.rows).to(dev)
    lp = _at_own_positions(sub, sub.positions, tuple(sub.input_ids.shape)) if behaviour else None
    v = critic(sub.input_ids, sub.attention_mask, sub.prompt_lengths, token_logprobs=lp)
    return gather_positions(v, sub.positions).float()


def _at_own_positions(sub: Batch, positions: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The rows' behaviour log-probs ``[n, T]`` placed at their tokens' own sequence (or stream) indices: response
    token t is scored at ``positions[:, t]`` and sits one further; ``shape`` ``[n, S]`` or ``[1, N]``, 0 elsewhere."""
    T = positions.shape[1]
    real = sub.mask[:, :T].to(positions.device) > 0
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
    out = torch.zeros(shape, dtype=torch.float32, device=positions.device)
    lp = sub.behaviour_logprobs[:, :T].to(device=positions.device, dtype=torch.float32)
    if shape[0] == 1 and positions.shape[0] != 1:  # packed: one stream
        out[0, positions[real] + 1] = lp[real]
    else:
        out[rows[real], positions[real] + 1] = lp[real]
    return out


@contextmanager
def head_replaced(head: torch.nn.Module, forward: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """For the duration, calling ``head`` runs ``forward`` (with the module's hooks: ZeRO-3's gather runs once)."""
    own = head.__dict__.get("forward")
    head.forward = forward  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _logprob_head(lm_head: torch.nn.Module, rows: Tensor, slots: Tensor, targets: Tensor, limits: MicroLimits,
                  entropy: bool, entropy_grad: bool) -> Callable[[Tensor], Tensor]:
    """The head's forward for one call: hidden states ``[B, M, H]`` at the kept positions → ``[2, R]`` (log π of
    ``targets`` ``[R]``, entropy or zeros) for the R response tokens at ``[rows, slots]``, the logits computed
    ``logit_elements`` at a time from the head's own weight."""
    weight, bias = cast(Tensor, lm_head.weight), getattr(lm_head, "bias", None)
    temp = limits.temperature

    def logits(x: Tensor) -> Tensor:
        out = torch.nn.functional.linear(x, weight, bias)
        return out if temp == 1.0 else out / temp

    def forward(x: Tensor) -> Tensor:
        h = x[rows, slots]
        chunks = max(1, math.ceil(h.shape[0] * weight.shape[0] / max(1, limits.logit_elements)))
        lp, ent = chunked_token_logprobs(h, logits, targets, chunks, entropy=entropy, entropy_grad=entropy_grad)
        return torch.stack([lp, ent])

    return forward


def policy_logprobs(policy: Any, batch: Batch, micro: Micro, limits: MicroLimits, entropy: bool = True,
                    entropy_grad: bool = False) -> tuple[Tensor, Tensor | None, Batch]:
    """log π of each response token ``[n, T_rows]`` fp32 (0 on padding), its entropy (or None) and the rows'
    sub-batch. ``limits.logit_elements`` > 0: the LM head over the response tokens only (one head call, chunked
    inside); 0: full logits. ``entropy_grad``: the entropy enters the loss (otherwise a detached metric). π is
    softmax(logits / ``limits.temperature``), the distribution the engines sampled from."""
    dev = model_device(policy)
    sub = batch.select(micro.rows)
    real = (sub.mask > 0).to(dev)  # [n, T]
    r, t = real.nonzero(as_tuple=True)  # (row, t) order: a row's response positions increase with t
    if micro.packed:
        p = pack(batch, micro.rows).to(dev)
        inputs: dict[str, Any] = {"input_ids": p.input_ids, **p.model_kwargs()}
        keep = p.positions[r, t]  # [R] stream positions; the head sees [1, R, H]
        rows, slots = torch.zeros_like(keep), torch.arange(len(keep), device=dev)
    else:
        sub_dev = sub.to(dev)
        inputs = {"input_ids": sub_dev.input_ids, "attention_mask": sub_dev.attention_mask}
        where = sub_dev.positions[r, t]
        keep = torch.unique(where)  # [M] sorted: every row's forward keeps these positions; the head sees [n, M, H]
        rows, slots = r, torch.searchsorted(keep, where)
    if limits.logit_elements <= 0:
        logits = policy(**inputs).logits
        logits = (unpack(logits, p) if micro.packed else gather_positions(logits, sub_dev.positions)) / limits.temperature
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = entropy_from_logits(logits) if entropy else None
        return token_logprobs(logits, sub.response_ids.to(dev)), ent, sub
    targets = sub.response_ids.to(dev)[r, t]
    lm_head = policy.module.get_output_embeddings()
    # A 1-D logits_to_keep (positions kept in every row) is what every transformers version since 4.45 takes.
    with head_replaced(lm_head, _logprob_head(lm_head, rows, slots, targets, limits, entropy, entropy_grad)):
        out = policy(**inputs, logits_to_keep=keep).logits  # [2, R]
    logp = out.new_zeros(real.shape).index_put((r, t), out[0])
    ent = out.new_zeros(real.shape).index_put((r, t), out[1]) if entropy else None
    return logp, ent, sub


def put_rows(dst: Tensor, rows: Tensor, x: Tensor) -> None:
    """``dst[rows, :T] = x`` (``x`` ``[len(rows), T]``, detached, on the host)."""
    dst[rows, : x.shape[1]] = x.detach().to(dst.dtype).cpu()


@torch.no_grad()
def compute_values(critic: Any, batch: Batch, rows: Tensor | list[Tensor], limits: MicroLimits | int) -> Tensor:
    """Full-size ``[B, T]`` fp32 values, filled on this rank's share of ``rows`` (a tensor, or the mini-batches,
    dealt to the ranks as the updates deal them); 0 elsewhere."""
    out = torch.zeros(batch.mask.shape, dtype=torch.float32)
    critic.eval()
    for mb in micro_batches(as_minibatches(rows), batch, limits, grad=False, model="critic"):
        v = critic_values(critic, batch, mb)
        if mb.weight > 0:
            put_rows(out, mb.rows, v)
    critic.train()
    return out * batch.mask


@torch.no_grad()
def compute_logprobs(policy: Any, batch: Batch, rows: Tensor | list[Tensor], limits: MicroLimits | int) -> Tensor:
    """Full-size ``[B, T]`` current-policy logprobs of the response tokens on this rank's share of ``rows``."""
    out = torch.zeros(batch.mask.shape, dtype=torch.float32)
    lim = MicroLimits.of(limits)
    policy.eval()
    for mb in micro_batches(as_minibatches(rows), batch, lim, grad=False, model="policy"):
        logp, _, _ = policy_logprobs(policy, batch, mb, lim, entropy=False)
        if mb.weight > 0:
            put_rows(out, mb.rows, logp)
    policy.train()
    return out * batch.mask


__all__ = ["compute_logprobs", "compute_values"]
