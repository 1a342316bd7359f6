"""The learner's models as DeepSpeed-wrapped modules: the policy (any HF causal LM) and the critic (HF
backbone + value head).

Used by ``learner.train``, ``learner.value_pretrain`` and ``learner.runner``; not a CLI. ``build_deepspeed``
calls ``learner.dist.setup_distributed`` first (idempotent):

    policy = build_policy(cfg)
    critic = build_critic(cfg)            # backbone from model.critic_path, else the base policy

"Engine" in this project means a rollout inference engine (config section ``engine``); what DeepSpeed
calls its engine is, here, simply the policy or the critic. Both use ``managed_gradient_accumulation =
false``: ``model.backward`` only accumulates, and ``model.step`` reduces across ranks and applies one
optimizer update. The caller therefore owns the micro-batch loop and the loss normaliser (token counts over
micro-batches AND ranks: the token-level mean). DeepSpeed averages gradients over data-parallel ranks;
``learner.dist.loss_scale_for_dp`` returns the factor that turns that average back into the sum a globally
normalised loss needs.

ZeRO-3 builds partitioned (``learner.partitioned``): the modules are constructed under ``deepspeed.zero.Init``
and each rank reads only its own slice of every tensor from the files, so no rank ever holds the whole
policy or critic (``ops/bench/zero_build.py`` measures it against the old whole-model build).

CPU: gloo, and the optimizer is a plain ``torch.optim.AdamW`` instance (a DeepSpeed-config optimizer
JIT-builds a C++ op on CPU); ``learner.dist`` explains the shared-memory op it keeps from compiling. CUDA
uses NCCL and the same code.

The critic may start from a different (e.g. larger) model than the policy, ``model.critic_path``, as verl's
``critic.model.path`` allows; it must read the policy's token ids (``check_critic_base``).

Deviation from the paper: none in the model; the value head is a fp32 ``Linear(hidden, 1)`` initialised
deliberately (weight ~ N(0, std²), bias = prior mean reward; learner.value_head_init_*), with every
dropout probability of the backbone config set to 0 (dropout makes V(s) noisy between the value pass
and the update, and some libraries default a value head's dropout to 0.1).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from common.config import Config, ConfigError
from common.modeling import load_tokenizer, torch_dtype
from learner.critic import Critic
from learner.dist import rank, setup_distributed, world_size
from learner.grow import inserted_layers, lr_groups
from learner.host_tensors import is_partitioned, iter_host_tensors, unwrap
from learner.packing import use_packed_attention
from learner.partitioned import build_empty, load_checkpoint, to_device
from learner.weights import export_hf
from learner.zero_trace import model_shape, trace_per_pass_kind, zero3_settings

# False restores the old ZeRO-3 build (every rank loads the whole model; deepspeed.initialize partitions
# it): ops/bench/zero_build.py measures both in one run.
PARTITIONED_BUILD = True


def partitioned_build(cfg: Config) -> bool:
    """Whether ``build_policy``/``build_critic`` construct ZeRO-3 partitions directly."""
    return PARTITIONED_BUILD and cfg.learner.zero_stage == 3


def device_for(cfg: Config) -> torch.device:
    if cfg.run.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _hf_module(auto_cls: Any, src: str | Path, hf_cfg: PretrainedConfig, dtype: str, partition: Config | None) -> nn.Module:
    """``auto_cls`` with the weights in ``src``: ``from_pretrained``, or under ZeRO-3 (``partition`` given)
    built partitioned, each rank reading only its own slices of the files."""
    if partition is None:
        return auto_cls.from_pretrained(str(src), config=hf_cfg, dtype=torch_dtype(dtype))

    setup_distributed(partition)
    model = build_empty(auto_cls, hf_cfg, torch_dtype(dtype), ds_config(partition, partition.learner.grad_clip))
    load_checkpoint(model, src)
    return model


def ds_config(cfg: Config, grad_clip: float, hf_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """DeepSpeed's config dict for one learner engine (policy or critic, each with its own ``grad_clip``); ZeRO-3's
    sizes from the model's shape, ``hf_config`` or model.path's (``learner.zero_trace.zero3_settings``)."""
    learner_cfg = cfg.learner
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": learner_cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": learner_cfg.zero_stage,
                              **zero3_settings(learner_cfg.zero_stage, hf_config or cfg.model.path)},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if learner_cfg.precision == "bf16":
        conf["bf16"] = {"enabled": True}
        if learner_cfg.zero_stage >= 1:
            # Summed in bf16 (8 mantissa bits), a mini-batch's micro-batch gradients lose their small terms;
            # DeepSpeed's ZeRO optimizers accumulate and reduce them in fp32 when asked. ZeRO-0 has no such
            # path (DeepSpeed refuses the mix), so a one-rank bf16 learner without ZeRO accumulates in bf16.
            conf["data_types"] = {"grad_accum_dtype": "fp32"}
    elif learner_cfg.precision == "fp16":
        conf["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return conf


def _no_dropout(config: Any) -> None:
    for name in list(vars(config)):
        if "dropout" in name and isinstance(getattr(config, name), float):
            setattr(config, name, 0.0)


def enable_activation_checkpointing(model: nn.Module, every: int = 1) -> None:
    """Recompute every ``every``-th transformer layer in the backward (learner.activation_checkpointing,
    learner.activation_checkpointing_every; 1 = all of them), keeping the other layers' activations.

    Non-reentrant checkpointing: the reentrant variant needs an input that requires grad (token ids do
    not) and re-enters autograd in a way ZeRO-3's parameter hooks do not follow. The KV cache is off, as
    it must be for recomputation (and is useless in training)."""
    kwargs = {"use_reentrant": False}
    hf: Any = model  # an HF PreTrainedModel (its checkpointing methods and config; nn.Module's type names neither)
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name is deprecated
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    hf.config.use_cache = False
    # Each decoder layer checks its own flag when called.
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)):
        layer.gradient_checkpointing = i % max(1, every) == 0


def checkpointed_layers(model: nn.Module) -> int:
    """How many of ``model``'s transformer layers recompute in the backward."""
    return sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)


def load_policy_module(path: str | Path, dtype: str = "float32", activation_checkpointing: bool = False,
                       partition: Config | None = None, checkpoint_every: int = 1, packing: bool = False) -> nn.Module:
    """The policy in ``path``; ``partition`` (a ZeRO-3 config) builds it partitioned (``partitioned_build``);
    ``packing``: its attention takes packed micro-batches (``learner.packing``)."""
    hf_cfg = AutoConfig.from_pretrained(str(path))
    _no_dropout(hf_cfg)
    model = _hf_module(AutoModelForCausalLM, path, hf_cfg, dtype, partition)
    config: Any = model.config  # nn.Module's __getattr__ types an HF model's config as Tensor | Module
    config.use_cache = False
    if activation_checkpointing:
        enable_activation_checkpointing(model, checkpoint_every)
    if packing:
        use_packed_attention(model)
    return model


def critic_base(cfg: Config) -> Path:
    """The HF model the critic's backbone starts from: model.critic_path, else the policy's base."""
    return Path(cfg.model.critic_path or cfg.model.path)


def check_critic_base(policy: str | Path, critic: str | Path) -> None:
    """ConfigError unless the critic's base reads the policy's token ids: the same vocabulary (token -> id), an
    embedding row for every id the policy can emit, and at least the policy's context. A critic from another
    tokenizer family would silently embed the wrong tokens: its values would be noise, not an error."""
    pc, cc = (json.loads((Path(d) / "config.json").read_text()) for d in (policy, critic))
    pc, cc = pc.get("text_config", pc), cc.get("text_config", cc)
    try:
        same = load_tokenizer(policy).get_vocab() == load_tokenizer(critic).get_vocab()
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.critic_path={critic}: cannot compare its tokenizer with model.path's ({e})") from e
    problems = [] if same else ["its tokenizer's vocabulary differs from model.path's"]
    if int(cc["vocab_size"]) < int(pc["vocab_size"]):
        problems.append(f"vocab_size {cc['vocab_size']} < the policy's {pc['vocab_size']}")
    cpos, ppos = (int(c.get("max_position_embeddings", 0)) for c in (cc, pc))
    if cpos < ppos:
        problems.append(f"max_position_embeddings {cpos} < the policy's {ppos}")
    if problems:
        raise ConfigError(f"model.critic_path={critic} cannot be the critic of {policy}: " + "; ".join(problems))


def load_critic_module(cfg: Config, path: str | Path | None = None, partitioned: bool = False) -> Critic:
    """The critic initialised from ``critic_base(cfg)`` (or from ``path``); when ``path`` holds a saved
    critic (``save_critic``), its value head is loaded too. ``partitioned``: the backbone is built
    ZeRO-3-partitioned (the small heads are not; ``deepspeed.initialize`` partitions them)."""
    src = Path(path) if path else critic_base(cfg)
    if path is None and cfg.model.critic_path and src.resolve() != Path(cfg.model.path).resolve():
        check_critic_base(cfg.model.path, src)
    hf_cfg = AutoConfig.from_pretrained(str(src))
    if cfg.learner.value_head_surprise and not getattr(hf_cfg, "tie_word_embeddings", False):
        # The surprise features read log-probs through the input embeddings, which are the LM head only
        # when tied (Qwen2.5-7B/32B are not): with untied embeddings they would be meaningless numbers.
        raise ConfigError(f"learner.value_head_surprise=true needs a model with tied input/output embeddings; "
                          f"{src} has tie_word_embeddings=false (set learner.value_head_surprise=false)")
    _no_dropout(hf_cfg)
    backbone = _hf_module(AutoModel, src, hf_cfg, cfg.model.dtype, cfg if partitioned else None)
    if cfg.learner.activation_checkpointing:
        enable_activation_checkpointing(backbone, cfg.learner.activation_checkpointing_every)
    if cfg.learner.packing:
        use_packed_attention(backbone)
    critic = Critic(cast(PreTrainedModel, backbone), hf_cfg.hidden_size, cfg.learner.value_head_init_std,
                    cfg.learner.value_head_init_bias,
                    surprise=cfg.learner.value_head_surprise,
                    logit_chunk_elements=cfg.learner.logits_chunk_elements or 1 << 24,
                    surprise_source=cfg.learner.value_head_surprise_source,
                    frozen_base=_frozen_base(cfg, src, partitioned))
    head = src / "value_head.safetensors"
    if head.is_file():
        critic.load_head_state_dict(load_file(str(head)))
    return critic


def _frozen_base(cfg: Config, src: Path, partitioned: bool) -> PreTrainedModel | None:
    """The surprise features' frozen base model (learner.value_head_surprise_source=frozen_base) when the critic
    is loaded from a trained critic (``src`` not the base); None otherwise (the Critic copies its fresh backbone)."""
    lc = cfg.learner
    if not (lc.value_head_surprise and lc.value_head_surprise_source == "frozen_base"):
        return None
    if partitioned or lc.zero_stage == 3:
        raise ConfigError("learner.value_head_surprise_source=frozen_base keeps a whole frozen copy of the base model "
                          "on every rank: not with ZeRO-3 (learner.zero_stage=3)")
    base = critic_base(cfg)
    if src.resolve() == base.resolve():
        return None
    hf_cfg = AutoConfig.from_pretrained(str(base))
    _no_dropout(hf_cfg)
    frozen = _hf_module(AutoModel, base, hf_cfg, cfg.model.dtype, None)
    if lc.packing:
        use_packed_attention(frozen)
    return cast(PreTrainedModel, frozen)


def _host_head_state(module: Critic) -> dict[str, Tensor]:
    """``head_state_dict`` as fp32 host tensors on rank 0 (``{}`` elsewhere); collective under ZeRO-3."""
    head = [p for n, p in module.named_parameters() if not n.startswith("backbone.")]
    ctx: Any = nullcontext()
    if is_partitioned(module) and head:
        import deepspeed  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR

        ctx = deepspeed.zero.GatheredParameters(head, modifier_rank=None)
    with ctx:
        if rank() != 0:
            return {}
        return {k: v.detach().float().to("cpu", copy=True).contiguous() for k, v in module.head_state_dict().items()}


def save_critic(critic: Any, path: str | Path) -> Path:
    """Backbone as HF files (``learner.weights.export_hf``) + ``value_head.safetensors``, atomically (tmp
    dir + rename). ``critic`` is a :class:`Critic` or its DeepSpeed wrapper.

    Every rank calls it under ZeRO-3: the backbone is gathered a bounded group at a time and only rank 0
    copies it to host and writes. Without ZeRO-3 rank 0 alone writes and the other ranks return at once."""
    module = cast(Critic, unwrap(critic))
    out = Path(path)
    if rank() != 0 and not is_partitioned(module):
        return out
    tmp = out.with_name(out.name + ".tmp")
    error: BaseException | None = None
    if rank() == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        except BaseException as e:  # raised after the collectives below, never inside them
            error = e
    head = _host_head_state(module)
    try:
        export_hf(module.backbone, tmp)
    except BaseException as e:  # export_hf raises on rank 0 only, after its gathers
        error = error or e
    if error is not None:
        raise error
    if rank() == 0:
        save_file(head, str(tmp / "value_head.safetensors"))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return out


def _warmup(steps: int) -> Any:
    return lambda s: min(1.0, (s + 1) / steps) if steps > 0 else 1.0


def build_deepspeed(cfg: Config, module: nn.Module, lr: float, warmup_steps: int = 0, grad_clip: float | None = None,
                 head_lr_scale: float = 1.0) -> Any:
    """Wrap ``module`` in DeepSpeed (``deepspeed.initialize``) with a torch AdamW (and a linear warmup when asked).

    A :class:`Critic`'s surprise MLP gets ``lr * head_lr_scale``: Adam moves a parameter by about lr per
    step whatever its gradient, and that small, freshly initialised MLP must move its output by ~0.5 in a
    few dozen steps (the linear value head on 128 features does not need it and overshoots with it)."""
    import deepspeed  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR

    setup_distributed(cfg)
    train_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.learner.precision, torch.float32)
    module = to_device(module, device_for(cfg), train_dtype)
    params: Any = [p for p in module.parameters() if p.requires_grad]
    if isinstance(module, Critic):
        grown = inserted_layers(critic_base(cfg))
        params = lr_groups([(n, p) for n, p in module.named_parameters() if p.requires_grad], lr, head_lr_scale,
                           grown, cfg.learner.critic_grown_lr_scale)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.learner.weight_decay, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup(warmup_steps)) if warmup_steps > 0 else None
    clip = cfg.learner.grad_clip if grad_clip is None else grad_clip
    model, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, lr_scheduler=sched,
                                          config=ds_config(cfg, clip, model_shape(module)))
    if not model.zero_optimization() and not model.bfloat16_enabled() and not model.fp16_enabled():
        # DeepSpeed's fp32 ZeRO-0 path clips but drops the norm it computed, with a per-tensor loop; the
        # gradients are already all-reduced here and there is no model parallelism, so torch's fused
        # clip gives the same global norm, faster, and we keep it for the metrics.
        def _clip_and_record() -> None:
            model._global_grad_norm = torch.nn.utils.clip_grad_norm_(model.module.parameters(),
                                                                     model.gradient_clipping(), foreach=True)

        model.clip_fp32_gradients = _clip_and_record
    if world_size() == 1 and not model.zero_optimization():
        # One rank has nothing to reduce; DeepSpeed would still flatten and all-reduce every gradient.
        model.enable_backward_allreduce = False
    trace_per_pass_kind(model)  # ZeRO-3: a prefetch trace per pass kind, no-grad and training (learner.zero_trace)
    return model


def build_policy(cfg: Config, path: str | Path | None = None) -> Any:
    lc = cfg.learner
    module = load_policy_module(path or cfg.model.path, cfg.model.dtype, lc.activation_checkpointing,
                                partition=cfg if partitioned_build(cfg) else None,
                                checkpoint_every=lc.activation_checkpointing_every, packing=lc.packing)
    return build_deepspeed(cfg, module, cfg.learner.actor_lr, cfg.learner.warmup_steps)


def build_critic(cfg: Config, path: str | Path | None = None, lr: float | None = None) -> Any:
    return build_deepspeed(cfg, load_critic_module(cfg, path, partitioned=partitioned_build(cfg)),
                           cfg.learner.critic_lr if lr is None else lr,
                           cfg.learner.critic_warmup_steps, head_lr_scale=cfg.learner.value_head_lr_scale)


def release(model: Any) -> None:
    """Let go of a DeepSpeed-wrapped model's memory: its hooks and optimizer form reference cycles that keep
    weights, gradients and optimizer states alive until a garbage collection happens to run. The caller
    then drops its own references and calls ``collect``."""
    module = model.module
    model.destroy()
    # DeepSpeed 0.19's ZeRO-3 keeps two process-wide references that outlive destroy(): every engine's module
    # stays at the base of a module-level stack (its forward-hook bookkeeping), and a class-level lru_cache of
    # PartitionedParameterCoordinator keys on coordinators and submodules. Either keeps all states alive.
    from deepspeed.runtime.zero import parameter_offload  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR
    from deepspeed.runtime.zero.partitioned_param_coordinator import (  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR
        PartitionedParameterCoordinator as Coordinator,
    )

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]
    cached = getattr(Coordinator, "_PartitionedParameterCoordinator__params_to_release", None)
    for fn in (cached, *(c.cell_contents for c in getattr(cached, "__closure__", None) or ())):
        if hasattr(fn, "cache_clear"):  # a cache: the live engines' entries are recomputed when next used
            fn.cache_clear()


def collect() -> None:
    """Free what ``release``d models held, now (host and accelerator)."""
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR

    gc.collect()
    get_accelerator().empty_cache()


def grad_norm(model: Any) -> float:
    """Global gradient norm of the last ``step`` (before clipping); NaN when DeepSpeed has none."""
    g = model.get_global_grad_norm()
    if g is None:
        return float("nan")
    return float(g.item() if torch.is_tensor(g) else g)


def full_state_dict(model: Any, copy: bool = False) -> dict[str, Tensor]:
    """The unwrapped module's full state dict in host memory on rank 0; ``{}`` on every other rank.

    Collective under ZeRO-3 (every rank calls it): the parameters are gathered a bounded group at a time
    and only rank 0 keeps host copies, so no other rank ever holds the whole model. Without ZeRO-3 the
    tensors are rank 0's own (copied only with ``copy`` or when on an accelerator)."""
    return {k: v for k, v in iter_host_tensors(model, copy=copy, aliases=True) if v is not None}


__all__ = ["PARTITIONED_BUILD", "build_critic", "collect", "ds_config", "load_critic_module", "load_policy_module", "release"]
