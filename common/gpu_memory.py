"""GPU memory of a placement: what each learner rank's model states and each engine GPU's weights need.

Not a CLI. ``common.placement.build_plan`` calls ``check_memory`` (its figures are the plan's ``memory``
line of ``ops/launch.sh CONFIG --dry-run``); ``common.balance`` sizes the engines with ``count_parameters``.
From the model's ``config.json`` it estimates each learner rank's model states (weights, gradients, Adam;
divided by ZeRO stage) for policy and critic, a training micro-batch's activations at its token budget (by how many
layers recompute: ``learner.activation_checkpointing``, ``learner.activation_checkpointing_every``), and each engine
GPU's weights, and refuses a placement that cannot hold them (``placement.gpu_memory_gib``,
``placement.learner_memory_fraction``, ``engine.sglang_mem_fraction_static``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.config import Config, ConfigError
from common.gpu_spec import engine_tp

GIB = float(1 << 30)


def count_parameters(hf_config: dict[str, Any]) -> dict[str, int]:
    """Parameters of a Llama/Qwen2-style decoder from its HF ``config.json`` (policy, and critic = backbone
    without an untied LM head + value head). Exact for Qwen2 (q/k/v biases), within 0.1% for Llama."""
    c = hf_config.get("text_config", hf_config)
    V, H, L = int(c["vocab_size"]), int(c["hidden_size"]), int(c["num_hidden_layers"])
    inter = int(c.get("intermediate_size", 4 * H))
    heads = int(c.get("num_attention_heads", 1))
    kv = int(c.get("num_key_value_heads", heads))
    hd = int(c.get("head_dim") or H // heads)
    q, kvd = heads * hd, kv * hd
    attn = H * q + q + 2 * (H * kvd + kvd) + q * H
    layer = attn + 3 * H * inter + 2 * H
    backbone = V * H + L * layer + H
    tied = bool(c.get("tie_word_embeddings", hf_config.get("tie_word_embeddings", False)))
    policy = backbone + (0 if tied else V * H)
    return {"policy": policy, "critic": backbone + H + 1, "vocab": V, "hidden": H, "tied": int(tied)}


def model_state_bytes(params: int, zero_stage: int, world: int, precision: str) -> float:
    """Per-rank bytes of weights + gradients + AdamW states (16 bytes a parameter in all; mixed precision
    keeps 2-byte weights/grads and a 12-byte fp32 master + moments, fp32 4 + 4 + 8), by ZeRO stage:
    0 replicates all, 1 partitions optimizer states, 2 also gradients, 3 also weights."""
    w = 4 if precision == "fp32" else 2
    g, opt = w, 16 - 2 * w
    n = max(world, 1)
    per_param = {0: w + g + opt, 1: w + g + opt / n, 2: w + (g + opt) / n, 3: (w + g + opt) / n}[zero_stage]
    return params * per_param


def read_model_config(path: str | Path) -> dict[str, Any] | None:
    p = Path(path) / "config.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def model_sizes(cfg: Config, hf: dict[str, Any], notes: list[str]) -> dict[str, int] | None:
    """``count_parameters`` of the policy, with the critic's from ``model.critic_path`` when it has a shape
    of its own, and ``embedding``: the largest embedding or LM head; None (and a note) when unreadable."""
    try:
        n = count_parameters(hf)
        n["embedding"] = n["vocab"] * n["hidden"]
        critic_hf = read_model_config(cfg.model.critic_path) if cfg.model.critic_path else None
        if critic_hf is not None:  # a critic of its own shape (model.critic_path)
            c = count_parameters(critic_hf)
            n["critic"], n["embedding"] = c["critic"], max(n["embedding"], c["vocab"] * c["hidden"])
        elif cfg.model.critic_path:
            notes.append(f"critic sized as the policy: no config.json under model.critic_path={cfg.model.critic_path}")
    except (KeyError, TypeError, ValueError) as e:
        notes.append(f"memory not checked: cannot read the model shape from config.json ({e})")
        return None
    return n


def layer_activation_elements(hf_config: dict[str, Any]) -> tuple[int, int]:
    """(elements a token keeps for a decoder layer's backward, elements it keeps when the layer is checkpointed)
    in a Llama/Qwen2 layer with flash-style attention (no score matrix): the two norms' inputs and outputs (4h), q
    and the attention output (2·q_dim), k and v (2·kv_dim), the MLP's gate, its activation, up and their product
    (4·intermediate); a checkpointed layer keeps its input alone (h)."""
    c = hf_config.get("text_config", hf_config)
    h, inter = int(c["hidden_size"]), int(c.get("intermediate_size", 4 * int(c["hidden_size"])))
    heads = int(c.get("num_attention_heads", 1))
    hd = int(c.get("head_dim") or h // heads)
    kv = int(c.get("num_key_value_heads", heads)) * hd
    return 4 * h + 2 * heads * hd + 2 * kv + 4 * inter, h


def activation_bytes(hf_config: dict[str, Any], tokens: int, checkpointing: bool, every: int, precision: str,
                     logit_elements: int) -> float:
    """Peak bytes one training micro-batch of ``tokens`` tokens keeps for its backward: every layer's activations
    (``layer_activation_elements``; with ``checkpointing`` every ``every``-th layer keeps its input alone, and one
    layer's full activations are rebuilt at a time in the backward) plus the LM head's chunk of fp32 logits and its
    softmax (``learner.logits_chunk_elements``)."""
    c = hf_config.get("text_config", hf_config)
    layers = int(c["num_hidden_layers"])
    full, kept = layer_activation_elements(hf_config)
    ckpt = len(range(0, layers, max(1, every))) if checkpointing else 0
    per_token = (layers - ckpt) * full + ckpt * kept + (full if ckpt else 0)
    width = 4 if precision == "fp32" else 2
    return float(tokens * per_token * width + 2 * 4 * logit_elements)


def activation_gib(cfg: Config, hf: dict[str, Any]) -> float:
    """``activation_bytes`` of the run's training micro-batch at its token budget (``learner.micro_batch_tokens``, or
    ``micro_batch_size`` × ``actors.max_new_tokens`` + a prompt when 0), in GiB; 0 when the shape is unreadable."""
    lc = cfg.learner
    tokens = lc.micro_batch_tokens or lc.micro_batch_size * (cfg.actors.max_new_tokens + cfg.placement.est_prompt_tokens)
    try:
        return activation_bytes(hf, tokens, lc.activation_checkpointing, lc.activation_checkpointing_every,
                                lc.precision, lc.logits_chunk_elements) / GIB
    except (KeyError, TypeError, ValueError):
        return 0.0


def estimate(cfg: Config, n: dict[str, int], engine_gpus: list[int], learner_gpus: list[int],
             activations_gib: float = 0.0) -> dict[str, Any]:
    """GiB per GPU of the learner's model states (steady and at the ZeRO-3 build's peak), its budget, and
    each engine GPU's weights, for the sizes ``n`` of ``model_sizes`` (unrounded; ``check_memory`` rounds);
    ``activations_gib`` (``activation_gib``) is passed through."""
    pl, lc = cfg.placement, cfg.learner
    world = len(learner_gpus)
    policy = model_state_bytes(n["policy"], lc.zero_stage, world, lc.precision) / GIB
    critic = model_state_bytes(n["critic"], lc.zero_stage, world, lc.precision) / GIB if cfg.algo.advantage == "gae" else 0.0
    learner_states = policy + critic
    wbytes = 4 if cfg.model.dtype == "float32" else 2
    # ZeRO-3 builds the critic beside the policy's states, one submodule at a time (deepspeed.zero.Init):
    # the largest, the embedding (or an untied LM head), is whole on the GPU for a moment.
    build_peak = learner_states + (n["embedding"] * wbytes / GIB if lc.zero_stage == 3 else 0.0)
    engine_weights = n["policy"] * wbytes / engine_tp(cfg) / GIB if engine_gpus else 0.0
    shared = bool(set(engine_gpus) & set(learner_gpus))
    learner_budget = pl.gpu_memory_gib * (pl.learner_memory_fraction - (_engine_fraction(cfg) if shared else 0.0))
    return {"policy_params_b": n["policy"] / 1e9, "critic_params_b": n["critic"] / 1e9,
            "learner_states_gib_per_gpu": learner_states, "learner_build_peak_gib_per_gpu": build_peak,
            "learner_budget_gib_per_gpu": learner_budget, "engine_weights_gib_per_gpu": engine_weights,
            "learner_activations_gib_per_gpu": activations_gib, "gpu_gib": pl.gpu_memory_gib}


def _engine_fraction(cfg: Config) -> float:
    return cfg.engine.sglang_mem_fraction_static if cfg.engine.kind == "sglang" else 0.0


def check_memory(cfg: Config, notes: list[str], engine_gpus: list[int], learner_gpus: list[int],
                 hf_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Estimated GiB per GPU (``estimate``); ConfigError when the learner's model states or an engine's
    weights cannot fit. ``{}`` (and a line in ``notes``) when the model's shape cannot be read here."""
    hf = hf_config if hf_config is not None else read_model_config(cfg.model.path)
    if hf is None:
        notes.append(f"memory not checked: no config.json under model.path={cfg.model.path} on this host")
        return {}
    n = model_sizes(cfg, hf, notes)
    if n is None:
        return {}
    mem = estimate(cfg, n, engine_gpus, learner_gpus, activation_gib(cfg, hf))
    pl, lc, gpu = cfg.placement, cfg.learner, cfg.placement.gpu_memory_gib
    shared = bool(set(engine_gpus) & set(learner_gpus))
    if mem["learner_build_peak_gib_per_gpu"] > mem["learner_budget_gib_per_gpu"]:
        raise ConfigError(
            f"placement.learner_gpus: policy + critic model states need ~{mem['learner_build_peak_gib_per_gpu']:.1f} GiB "
            f"per learner GPU ({n['policy'] / 1e9:.2f}B + {n['critic'] / 1e9:.2f}B parameters, ZeRO-{lc.zero_stage} over "
            f"{len(learner_gpus)} rank(s)) but {mem['learner_budget_gib_per_gpu']:.1f} GiB is allowed "
            f"(placement.gpu_memory_gib={gpu:g} x placement.learner_memory_fraction={pl.learner_memory_fraction:g}"
            f"{' minus the engine share' if shared else ''}): add learner GPUs or raise learner.zero_stage")
    # States + one micro-batch's activations must fit the GPU at all (the CUDA context and allocator fragmentation
    # are not counted: a budget near this limit needs measuring).
    room = gpu * (1.0 - (_engine_fraction(cfg) if shared else 0.0))
    if learner_gpus and mem["learner_states_gib_per_gpu"] + mem["learner_activations_gib_per_gpu"] > room:
        raise ConfigError(
            f"learner.micro_batch_tokens: a training micro-batch's activations need ~{mem['learner_activations_gib_per_gpu']:.1f}"
            f" GiB per learner GPU beside ~{mem['learner_states_gib_per_gpu']:.1f} GiB of model states, over the "
            f"{room:.1f} GiB a {gpu:g} GiB GPU has room for: lower learner.micro_batch_tokens, set "
            "learner.activation_checkpointing=true, or lower learner.activation_checkpointing_every")
    if cfg.engine.kind == "sglang" and mem["engine_weights_gib_per_gpu"] > gpu * _engine_fraction(cfg) * 0.9:
        raise ConfigError(
            f"engine.sglang_tp_size: the policy's weights need ~{mem['engine_weights_gib_per_gpu']:.1f} GiB per engine "
            f"GPU but engine.sglang_mem_fraction_static={_engine_fraction(cfg):g} of {gpu:g} GiB leaves too little for "
            "them and a KV cache: raise the tensor-parallel size or the memory fraction")
    return {k: v if k == "gpu_gib" else round(v, 3 if k.endswith("_b") else 2) for k, v in mem.items()}
