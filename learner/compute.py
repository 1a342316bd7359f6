"""What one learner step cost in token passes, for comparisons at equal total compute (not a CLI).

A token pass is one token through one model, forward or backward; a backward costs about twice a forward,
so ``ops.bench.reports.compute_axes`` weighs them 1 and 2. Counted over the rows each model's passes ran (every rank's
together; rows no loss reads are skipped, ``learner.schedule.read_rows``), prompt and response tokens alike, padding
not: what the step's phases ran, read from the phases that were timed. Activation-checkpointing recomputation (one more forward per backward) is not counted,
the same for every method of a comparison.

- critic: the value pass (``values``), the critic update (``critic_update``: forward and backward per
  epoch), the post-update value pass (``fresh_values``);
- policy: the proximal pass (``proximal``), the actor update (``actor_update``: forward and backward per
  epoch; replayed positives included, they feed the NLL).

Value pretraining's critic passes are counted by ``learner.value_pretrain`` in its own records.

Model FLOPs (``step_model_flops``, for MFU; ``learner.step_stats.Throughput`` reports them): per row of n = prompt
+ response tokens a forward costs 2·N_body·n (N_body: every parameter but the embedding lookup and the LM head)
plus causal attention 2·layers·q_dim·n² (4·layers·q_dim per query per attended token, n²/2 pairs); the policy's
LM head, 2·vocab·hidden a token, runs on response tokens only (vapo takes log-probs there alone); the critic's
value head is in N_body, and its surprise features (``learner.value_head_surprise``) add a forward of the LM
head on response tokens, computed without grad (no backward). A backward costs 2 forwards. Padding, and
activation-checkpointing recomputation (the layers' and the chunked LM head's), are not model FLOPs (the MFU
convention): MFU says how much of the device the model's own arithmetic uses, not how busy the device is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from common.gpu_memory import count_parameters
from learner.batch import Batch

# Each phase that runs a model: (which model, whether it trains: forward and backward per epoch).
PHASE_PASSES = {"values": ("critic", False), "critic_update": ("critic", True), "fresh_values": ("critic", False),
                "proximal": ("policy", False), "actor_update": ("policy", True)}


def batch_tokens(batch: Batch, rows: Tensor | None = None) -> int:
    """Prompt + response tokens of ``rows`` (default: every row): what one forward over them processes."""
    seq = batch.prompt_lengths + batch.lengths
    return int((seq if rows is None else seq[rows]).sum())


def step_token_passes(batch: Batch, phases: dict[str, float], epochs: int, value_pass: bool,
                      rows: Mapping[str, Tensor] | None = None) -> dict[str, Any]:
    """``{policy,critic}_{forward,backward}_tokens`` of one step whose timed phases are ``phases`` (``values``
    is timed even when it computes no value: ``value_pass`` says whether it did), and the response tokens
    of its real (not replayed) rows: the generation the step trained on. ``rows``: per model ("policy",
    "critic") the rows its passes ran (``learner.schedule.read_rows``; default every row)."""
    rows = rows or {}
    fwd_only = {"critic": int(value_pass) + int("fresh_values" in phases),
                "policy": int("proximal" in phases)}
    trained = {"critic": epochs if "critic_update" in phases else 0,
               "policy": epochs if "actor_update" in phases else 0}
    out: dict[str, Any] = {"response_tokens": int(batch.lengths[~batch.is_replay].sum())}
    for model in ("policy", "critic"):
        n = batch_tokens(batch, rows.get(model))
        out[f"{model}_forward_tokens"] = n * (fwd_only[model] + trained[model])
        out[f"{model}_backward_tokens"] = n * trained[model]
    return out


@dataclass(frozen=True)
class ModelShape:
    """What a token's forward costs in one model (``model_shape`` reads it from the HF config.json)."""

    body_params: int  # every parameter but the embedding lookup and the LM head (the critic's value head in)
    layers: int
    q_dim: int  # attention heads x head_dim: the width of the score and value products
    head_params: int  # vocab x hidden: the LM head (policy) or the surprise features' (critic)


def model_shape(hf_config: dict[str, Any], critic: bool = False) -> ModelShape:
    """The policy's (or, ``critic``, the critic's) shape from a Llama/Qwen2-style ``config.json``."""
    n = count_parameters(hf_config)
    c = hf_config.get("text_config", hf_config)
    heads = int(c.get("num_attention_heads", 1))
    head_dim = int(c.get("head_dim") or n["hidden"] // heads)
    embed = n["vocab"] * n["hidden"]
    body = n["critic"] - embed if critic else n["policy"] - embed * (1 if n["tied"] else 2)
    return ModelShape(body_params=body, layers=int(c["num_hidden_layers"]), q_dim=heads * head_dim, head_params=embed)


def forward_flops(shape: ModelShape, tokens: Tensor, head_tokens: Tensor) -> float:
    """Model FLOPs of one forward over rows of ``tokens`` (prompt + response) each, ``head_tokens`` of each
    through the LM head: Σ 2·N_body·n + 2·layers·q_dim·n² + 2·vocab·hidden·h."""
    n, h = tokens.double(), head_tokens.double()
    return float((2 * shape.body_params * n + 2 * shape.layers * shape.q_dim * n * n + 2 * shape.head_params * h).sum())


def pass_flops(shape: ModelShape, batch: Batch, rows: Tensor | None, *, lm_head: bool,
               surprise: bool = False) -> tuple[float, float]:
    """(forward, backward) model FLOPs of one pass over ``rows`` of ``batch`` (indices or a bool mask; None:
    every row). ``lm_head``: the policy's head on the response tokens, in forward and backward; ``surprise``:
    the critic's no-grad LM head on them, in forward only."""
    sel = slice(None) if rows is None else rows
    tokens, response = (batch.prompt_lengths + batch.lengths)[sel], batch.lengths[sel]
    body = forward_flops(shape, tokens, torch.zeros_like(response))
    head = 2.0 * shape.head_params * float(response.double().sum())
    return body + (head if lm_head or surprise else 0.0), 2 * (body + (head if lm_head else 0.0))


def step_model_flops(batch: Batch, phases: Mapping[str, float], epochs: int, value_pass: bool, policy: ModelShape,
                     critic: ModelShape | None, surprise: bool = False,
                     rows: Mapping[str, Tensor] | None = None) -> dict[str, tuple[float, int]]:
    """``{phase: (model FLOPs, tokens)}`` of each phase of a step that ran a model (``PHASE_PASSES``; ``values``
    only with ``value_pass``), over the whole batch (every rank's rows): a trained phase counts ``epochs``
    forwards and backwards, and its tokens once per epoch. ``rows``: the rows a phase runs (default every
    row: rows no loss reads are run today)."""
    shapes = {"policy": policy, "critic": critic}
    out: dict[str, tuple[float, int]] = {}
    for phase, (model, trains) in PHASE_PASSES.items():
        shape = shapes[model]
        if phase not in phases or shape is None or (phase == "values" and not value_pass):
            continue
        sel = None if rows is None else rows.get(phase)
        fwd, bwd = pass_flops(shape, batch, sel, lm_head=model == "policy", surprise=model == "critic" and surprise)
        tokens = int((batch.prompt_lengths + batch.lengths)[slice(None) if sel is None else sel].sum())
        times = epochs if trains else 1
        out[phase] = (times * (fwd + (bwd if trains else 0.0)), times * tokens)
    return out
