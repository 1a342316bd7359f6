"""ZeRO-3's prefetch trace kept complete across the learner's two pass kinds, and ZeRO-3's sizes for a model.

Not a CLI. ``learner.models.ds_config`` adds ``zero3_settings`` of the model's ``config.json`` under ZeRO-3, and
``learner.models.build_deepspeed`` calls ``trace_per_pass_kind`` on every ZeRO-3 engine. Measured by
``python -m ops.bench.zero3_traffic`` (bytes all-gathered per phase against a floor, trace invalidations).

The trace. DeepSpeed 0.19's ZeRO-3 (``deepspeed/runtime/zero/partitioned_param_coordinator.py``) gives an engine ONE
``PartitionedParameterCoordinator``. It records the order of sub-module calls from one root forward to the next (a
forward, and the backward when one follows), and once that trace is complete it prefetches by it and releases each
parameter when the trace says it is not needed again soon; a call out of order invalidates it, and until a new trace
is recorded over a whole pass every module is gathered on demand, in series with compute. The learner runs two kinds
of pass per model and step: no-grad forwards (the values; the recomputed π_old) and training passes (forward, then
backward with the activation-checkpointing recompute inside). Under one trace for both:

- a training pass after a trace recorded in a no-grad pass runs past its end at the first backward module and
  invalidates it: every phase boundary of the warm-up step, and every boundary after any other invalidation;
- a no-grad pass under a training trace matches its forward part but is planned by the whole trace: it keeps
  gathered what the backward that never comes would reuse, and at the forward's end it prefetches the backward's
  first bucket (``stage3_prefetch_bucket_size``: a layer, below), gathered for nothing and dropped at the next pass;
- the release decisions are cached per (coordinator, module, step) and never cleared when a trace is re-recorded,
  so after a re-record the other kind's decisions apply.

The fix: one coordinator per pass kind (autograd on or off at the root forward), swapped in by a forward pre-hook on
the root module that runs before DeepSpeed's own (which starts the new pass on the coordinator it finds). Each
records its own trace, complete from its second pass on, and every later pass of its kind matches it.

Why the swap is safe (DeepSpeed 0.19.8: ``parameter_offload.py``, ``partitioned_param_coordinator.py``,
``stage3.py``): every user of the coordinator reaches it through ``DeepSpeedZeRoOffload.get_param_coordinator()``,
which returns the attribute ``param_coordinator`` (the module hooks, stage 3's ``_get_param_coordinator``,
``release_backward_leftovers``, ``partition_all_parameters``); the swap happens only at a root forward, between
passes: the previous backward and its epilogue (which drains that coordinator's backward leftovers) are over and
nothing is being fetched; the in-flight registry is the module's (``ds_inflight_param_registry``), shared by both
coordinators, so the incoming one's ``reset_step`` waits for and releases whatever the outgoing one prefetched;
parameter and module state (``ds_status``, ``ds_active_sub_modules``, ``ds_persist``, ``ds_id``,
``ds_recompute_parameters``) lives on the parameters and modules; a coordinator's own counters (step, live
parameters, fetch queue) are reset by ``reset_step`` at the start of each of its passes. A second coordinator costs
its trace (a tuple of module and parameter references) and nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.gpu_memory import count_parameters, read_model_config


def layer_parameters(hf_config: dict[str, Any]) -> int:
    """Parameters of one decoder layer of a Llama/Qwen2-style model, from its HF ``config.json``."""
    n = count_parameters(hf_config)
    layers = int(hf_config.get("text_config", hf_config)["num_hidden_layers"])
    backbone = n["critic"] - n["hidden"] - 1  # count_parameters' critic = backbone + a value head of hidden + 1
    return max(1, (backbone - n["vocab"] * n["hidden"] - n["hidden"]) // max(1, layers))


def model_shape(module: Any) -> dict[str, Any] | None:
    """The HF config (as ``config.json``'s dict) of a policy module, or of a critic's backbone; None without one."""
    hf = getattr(getattr(module, "backbone", module), "config", None)
    return hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else None


def zero3_settings(stage: int, shape: dict[str, Any] | str | Path | None) -> dict[str, Any]:
    """The ``zero_optimization`` keys vapo adds at ZeRO stage ``stage`` ({} below 3) for a model of this shape (a
    ``config.json`` dict, or a model directory to read it from). A shape ``count_parameters`` cannot read: only the
    warnings, DeepSpeed's sizes stay.

    - ``stage3_prefetch_bucket_size`` = one decoder layer: while a module computes, the next layer's parameters
      are gathered (DeepSpeed's 5e7 is a tenth of a Qwen2.5-32B layer, 4.9e8: most of each gather would wait);
    - ``stage3_max_reuse_distance`` = one layer: a parameter stays gathered when the trace uses it again within a
      layer's worth of parameters (the LM head across the forward/backward turn, a checkpointed layer from its
      recompute to its backward), not across passes. At 32B this is what DeepSpeed's 1e9 does; on a small model
      1e9 would keep the whole model gathered from the forward to the backward;
    - ``stage3_max_live_parameters`` = the largest module (LM head or embedding) + 2 layers: the module computing,
      the layer kept for its backward and the layer being prefetched (DeepSpeed's 1e9 is less than the 32B head
      plus one prefetched layer, 1.27e9, so at the head every prefetch would be cut short);
    - ``stage3_param_persistence_threshold`` = hidden size: the vectors (norm weights, biases, the value head) stay
      whole on every rank, since a gather of a few KB costs a collective's latency for nothing, and every matrix is
      partitioned (DeepSpeed's 1e5 leaves every matrix of a small model whole, so its ZeRO-3 would not be);
    - ``log_trace_cache_warnings``: DeepSpeed prints (rank 0) each trace invalidation, and nothing otherwise."""
    if stage != 3:
        return {}
    warnings = {"log_trace_cache_warnings": True}
    hf_config = read_model_config(shape) if isinstance(shape, (str, Path)) else shape
    if hf_config is None:
        return warnings
    try:
        n = count_parameters(hf_config)
        layer = layer_parameters(hf_config)
    except (KeyError, TypeError, ValueError):
        return warnings
    return {**warnings, "stage3_prefetch_bucket_size": layer, "stage3_max_reuse_distance": layer,
            "stage3_max_live_parameters": max(layer, n["vocab"] * n["hidden"]) + 2 * layer,
            "stage3_param_persistence_threshold": n["hidden"]}


def _coordinator_like(offload: Any) -> Any:
    """A new coordinator made as ``DeepSpeedZeRoOffload.__init__`` makes its own, sharing its in-flight registry."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR
    from deepspeed.runtime.zero.partitioned_param_coordinator import (  # noqa: PLC0415 - DeepSpeed picks its accelerator at import: after setup_distributed set DS_ACCELERATOR
        PartitionedParameterCoordinator,
    )

    return PartitionedParameterCoordinator(
        prefetch_bucket_sz=offload._prefetch_bucket_sz,
        max_reuse_distance_in_numel=offload._max_reuse_distance_in_numel,
        max_available_parameters_in_numel=offload._max_available_parameters_in_numel,
        allgather_stream=offload._DeepSpeedZeRoOffload__allgather_stream,
        inflight_param_registry=offload.module.ds_inflight_param_registry,
        prefetch_nvme=offload.offload_device == OffloadDeviceEnum.nvme,
        timers=offload.timers,
        zero_quantized_weights=offload.zero_quantized_weights,
        zero_quantized_nontrainable_weights=offload.zero_quantized_nontrainable_weights,
        fast_sharding_for_leaf_module=offload.fast_sharding_for_leaf_module,
        log_trace_cache_warnings=offload.log_trace_cache_warnings,
    )


def trace_per_pass_kind(engine: Any) -> dict[bool, Any]:
    """Give a ZeRO-3 ``engine`` one parameter coordinator for training passes and one for no-grad passes (module
    docstring); returns them by ``torch.is_grad_enabled()``. A no-op ({}) for an engine below ZeRO-3."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if offload is None:
        return {}
    if not hasattr(offload, "param_coordinator") or offload.get_param_coordinator() is not offload.param_coordinator:
        raise RuntimeError("DeepSpeed's ZeRO-3 no longer keeps its coordinator in param_coordinator: "
                           "learner.zero_trace needs updating for this DeepSpeed version")
    if offload.get_param_coordinator().is_complete_trace():
        raise RuntimeError("trace_per_pass_kind must be applied before the engine's first forward")
    coordinators = {True: offload.param_coordinator, False: _coordinator_like(offload)}

    def swap(_module: Any, _args: Any) -> None:
        offload.param_coordinator = coordinators[torch.is_grad_enabled()]

    engine.module.register_forward_pre_hook(swap, prepend=True)  # before DeepSpeed's reset_step of the new pass
    return coordinators
