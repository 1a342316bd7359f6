"""Balance of a placement: learner and generation time per RL step, from what the code runs.

    b = estimate(cfg, n_engine_gpus, n_learner_gpus, counts, hf_config)   # counts: gpu_memory.count_parameters
    b["learner_s"], b["generation_s"], b["idle_side"], b["idle_fraction"], b["flip_response_tokens"]
    describe(b)                                                             # the lines `--dry-run` prints

Not a CLI: ``common.placement`` calls it for GPU plans and ``ops/launch.sh CONFIG --dry-run`` prints it.
Asynchronous RL runs at the pace of its slower side: admission control (``buffer.max_staleness``) holds the
engines back when the learner is slower, and the learner waits for batches when the engines are. Both sides
are estimated on the same synthetic step (``common.microplan.synthetic_lengths``): ``learner.batch_groups x
actors.group_size`` rows, prompts around ``placement.est_prompt_tokens``, responses log-normal (spread
``microplan.SIGMA``) of mean ``placement.est_response_tokens`` (0 = half of ``actors.max_new_tokens``) after
capping at ``actors.max_new_tokens``.

- Learner: the micro-batch plan the learner runs (``microplan.plan_step``: one deal per mini-batch over the
  ``placement.learner_gpus`` ranks, cut within ``learner.micro_batch_tokens`` for the training passes and
  ``learner.no_grad_micro_batch_tokens`` (0 = twice that) for the no-grad ones, ``learner.packing``; rows no
  loss reads left out under ``algo.truncated=mask``). Every pass costs the sum over micro-batch index j of
  the slowest rank's j-th micro-batch (the ranks run in lockstep), in forward FLOPs (``Workload.of_model``)
  times the pass's forward-equivalents: a training pass 1 + 2 (backward) + the recomputed share of the layers
  (``learner.activation_checkpointing``, ``activation_checkpointing_every``) per ``learner.ppo_epochs``; the
  no-grad passes 1 (policy: the recomputed pi_old of ``learner.off_policy``; critic: the value pass and, with
  ``algo.actor_values=post_update``, the fresh one). One learner GPU runs ``placement.gpu_peak_tflops`` x
  ``placement.learner_utilization``. Under ZeRO-3 a micro-batch's forward and backward each all-gather the
  model's bf16 weights at ``placement.learner_gather_gbps``; a micro-batch takes the longer of its compute and
  its gathers (prefetch overlaps them).
- Engines: the larger of FLOPs (``2·N`` a token plus attention ``4·layers·q_dim`` a token per attended token,
  at ``gpu_peak_tflops x engine_utilization``) and memory traffic at ``placement.gpu_memory_bandwidth_gbps x
  engine_bandwidth_utilization``: every decode iteration of an engine reads its weights (2 bytes a parameter,
  over its tensor-parallel GPUs) and every running request's KV cache (context x 2 x layers x kv_heads x
  head_dim x 2 bytes). Over a step that is the KV of every generated token's context, plus the weights once
  per iteration; the running requests per engine are ``actors.prompts_in_flight x group_size`` or as many as
  the KV memory left holds (``placement.gpu_memory_gib x engine.sglang_mem_fraction_static`` per GPU less the
  weights) at their mean context, whichever is fewer.
- The flip: the mean response length at which the step turns from learner-bound to generation-bound (or the
  reverse), searched by bisection between ``FLIP_RANGE`` of the cap; the search plans ``SEARCH_MINIBATCHES``
  mini-batches and scales them (mini-batches of synthetic rows are alike).

Not measured: the utilisations and bandwidths are assumptions to be replaced by measurements on the cluster;
attention kernels, the LM head on response tokens only, communication other than ZeRO-3's gathers, and the
engines' prefill/decode scheduling are not modelled (docs/SCALE.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.config import Config
from common.gpu_spec import engine_tp
from common.microplan import Rows, Workload, minibatches, plan_step, slot_costs, synthetic_lengths

IDLE_WARN = 0.5  # a side idle more than this fraction of the time is worth rebalancing
GIB = float(1 << 30)
SEARCH_MINIBATCHES = 4
FLIP_RANGE = (0.01, 0.9)  # of actors.max_new_tokens
SEARCH_STEPS = 10


@dataclass(frozen=True)
class Shape:
    """What the estimate reads of a model: layers, query and key/value widths, parameters, bytes a weight."""

    layers: int
    q_dim: int
    kv_dim: int
    policy: float
    critic: float
    wbytes: int

    @classmethod
    def of(cls, hf_config: dict[str, Any], counts: dict[str, int], dtype: str) -> Shape:
        c = hf_config.get("text_config", hf_config)
        heads = int(c.get("num_attention_heads", 1))
        hd = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        kv = int(c.get("num_key_value_heads", heads))
        return cls(int(c["num_hidden_layers"]), heads * hd, kv * hd, float(counts["policy"]), float(counts["critic"]),
                   4 if dtype == "float32" else 2)

    def work(self, model: str) -> Workload:
        """Forward FLOPs of a row (``microplan.Workload.of_model``) of the policy or the critic."""
        return Workload(2.0 * (self.policy if model == "policy" else self.critic), 2.0 * self.layers * self.q_dim)


@dataclass(frozen=True)
class Pass:
    """One pass of a step over its rows: which model, which plan (training or no-grad budget), its forward-
    equivalents per forward FLOP, and how many times it gathers the weights per micro-batch (ZeRO-3)."""

    name: str
    model: str
    plan: str
    forwards: float
    gathers: int


def recompute_share(cfg: Config, layers: int) -> float:
    """The share of a forward that activation checkpointing recomputes in the backward."""
    lc = cfg.learner
    if not lc.activation_checkpointing or layers <= 0:
        return 0.0
    return math.ceil(layers / max(lc.activation_checkpointing_every, 1)) / layers


def value_pass(cfg: Config) -> bool:
    """Whether the step runs a critic forward before the critic update (``learner.train.Learner.value_pass``)."""
    ac = cfg.algo
    return ac.actor_values == "pre_update" or not (ac.decoupled_gae and ac.lambda_critic == 1.0 and ac.value_clip <= 0.0)


def passes(cfg: Config, layers: int) -> list[Pass]:
    """The passes of one step, as ``learner.train.Learner.step`` runs them."""
    epochs, train = cfg.learner.ppo_epochs, 3.0 + recompute_share(cfg, layers)
    out = []
    if cfg.algo.advantage == "gae":
        if value_pass(cfg):
            out.append(Pass("values", "critic", "no_grad", 1.0, 1))
        out.append(Pass("critic_update", "critic", "train", epochs * train, 2 * epochs))
        if cfg.algo.actor_values == "post_update":
            out.append(Pass("fresh_values", "critic", "no_grad", 1.0, 1))
    if cfg.learner.off_policy != "behaviour":
        out.append(Pass("proximal", "policy", "no_grad", 1.0, 1))
    out.append(Pass("actor_update", "policy", "train", epochs * train, 2 * epochs))
    return out


def budgets(cfg: Config, longest: int) -> dict[str, int]:
    """Token budget of a training and of a no-grad micro-batch (``learner.micro_batch_tokens``, 0 = rows cap x
    the longest row; ``learner.no_grad_micro_batch_tokens``, 0 = twice the training budget)."""
    lc = cfg.learner
    train = lc.micro_batch_tokens or lc.micro_batch_size * longest
    return {"train": train, "no_grad": lc.no_grad_micro_batch_tokens or 2 * train}


def step_rows(cfg: Config, response: float, seed: int = 0) -> Rows:
    """The synthetic step both sides are estimated on (mean ``response`` tokens after the cap)."""
    cap = cfg.actors.max_new_tokens
    n = cfg.learner.batch_groups * cfg.actors.group_size
    return synthetic_lengths(n, min(response, 0.99 * cap), cap, prompt=float(cfg.placement.est_prompt_tokens), seed=seed)


def learner_time(cfg: Config, rows: Rows, shape: Shape, world: int, sample: int = 0) -> dict[str, Any]:
    """Seconds of every pass of the learner's step on ``rows`` over ``world`` ranks, planned as the learner
    plans; ``sample`` > 0 plans that many mini-batches and scales to all."""
    lc, pl = cfg.learner, cfg.placement
    lengths = rows.lengths
    skip = rows.truncated if cfg.algo.truncated == "mask" else np.zeros(len(lengths), dtype=bool)
    mbs = [[i for i in mb if not skip[i]] for mb in minibatches(len(lengths), lc.mini_batches)]
    scale = 1.0
    if 0 < sample < len(mbs):
        scale, mbs = len(mbs) / sample, mbs[:sample]
    budget = budgets(cfg, max(lengths))
    policy = shape.work("policy")
    plans = {k: plan_step(lengths, mbs, world, b, policy, lc.packing, lc.micro_batch_size) for k, b in budget.items()}
    rate = pl.gpu_peak_tflops * 1e12 * pl.learner_utilization
    out: dict[str, Any] = {"passes_s": {}}
    for p in passes(cfg, shape.layers):
        params = shape.policy if p.model == "policy" else shape.critic
        gather = (shape.wbytes * params * (world - 1) / world / (pl.learner_gather_gbps * 1e9)
                  if lc.zero_stage == 3 and world > 1 else 0.0)
        costs = slot_costs(plans[p.plan], lengths, shape.work(p.model), lc.packing)
        out["passes_s"][p.name] = scale * sum(max(c * p.forwards / rate, gather * p.gathers) for c in costs)
    kept = [i for mb in mbs for i in mb]
    ideal = sum(policy.row(lengths[i]) for i in kept) / world
    for k, plan in plans.items():
        out[f"plan_over_ideal_{k}"] = sum(slot_costs(plan, lengths, policy, lc.packing)) / ideal if ideal else 1.0
        out[f"slots_per_rank_{k}"] = round(scale * len(plan[0]))
    out["learner_s"] = sum(out["passes_s"].values())
    return out


def generation_time(cfg: Config, rows: Rows, shape: Shape, engine_gpus: int) -> dict[str, Any]:
    """Seconds the engines take to generate ``rows``: the larger of their FLOP time and their memory time."""
    pl = cfg.placement
    tp = engine_tp(cfg)
    engines = max(engine_gpus // tp, 1)
    p, r = rows.prompts.astype(np.float64), rows.responses.astype(np.float64)
    tokens = float(r.sum())
    context = float((p * r + r * (r - 1) / 2).sum())  # KV entries each decode step reads, over all of them
    flops = 2.0 * shape.policy * (float(p.sum()) + tokens) + 4.0 * shape.layers * shape.q_dim * (
        context + float((p * p / 2).sum()))
    flop_s = flops / (max(engine_gpus, 1) * pl.gpu_peak_tflops * 1e12 * pl.engine_utilization)
    weights = shape.policy * shape.wbytes  # one engine's, over its tp GPUs
    kv_token = 2.0 * shape.layers * shape.kv_dim * shape.wbytes
    kv_room = max(tp * pl.gpu_memory_gib * GIB * cfg.engine.sglang_mem_fraction_static - weights, 0.0)
    mean_context = context / tokens if tokens else 1.0
    running = max(1.0, min(float(cfg.actors.prompts_in_flight * cfg.actors.group_size), kv_room / (kv_token * max(mean_context, 1.0))))
    traffic = context * kv_token + tokens / running * weights
    mem_s = traffic / (max(engine_gpus, 1) * pl.gpu_memory_bandwidth_gbps * 1e9 * pl.engine_bandwidth_utilization)
    return {"generation_s": max(flop_s, mem_s), "generation_flop_s": flop_s, "generation_memory_s": mem_s,
            "generation_pflop": flops / 1e15, "kv_read_tb": context * kv_token / 1e12,
            "weights_read_tb": tokens / running * weights / 1e12, "running_per_engine": running, "engines": engines}


def idle(generation_s: float, learner_s: float) -> tuple[str, float]:
    """Which side waits for the other, and for what fraction of the time."""
    if generation_s >= learner_s:
        return "learner", 1.0 - learner_s / generation_s if generation_s > 0 else 0.0
    return "engines", 1.0 - generation_s / learner_s


def gap(cfg: Config, shape: Shape, engine_gpus: int, learner_gpus: int, response: float) -> float:
    """log(generation time / learner time) at mean response length ``response`` (> 0: generation-bound)."""
    rows = step_rows(cfg, response)
    gen = generation_time(cfg, rows, shape, engine_gpus)["generation_s"]
    learn = learner_time(cfg, rows, shape, learner_gpus, sample=SEARCH_MINIBATCHES)["learner_s"]
    return math.log(max(gen, 1e-12) / max(learn, 1e-12))


def flip(cfg: Config, shape: Shape, engine_gpus: int, learner_gpus: int) -> dict[str, Any]:
    """The mean response length at which the bound flips (bisection on a log scale within ``FLIP_RANGE`` of
    the cap); ``flip_response_tokens`` None when one side binds over the whole range (``bound`` says which)."""
    cap = cfg.actors.max_new_tokens
    lo, hi = max(FLIP_RANGE[0] * cap, 1.0), FLIP_RANGE[1] * cap
    g_lo, g_hi = (gap(cfg, shape, engine_gpus, learner_gpus, x) for x in (lo, hi))
    below = "generation" if g_lo > 0 else "learner"
    if (g_lo > 0) == (g_hi > 0):
        return {"flip_response_tokens": None, "bound_below": below, "flip_range": [round(lo), round(hi)]}
    for _ in range(SEARCH_STEPS):
        mid = math.sqrt(lo * hi)
        if (gap(cfg, shape, engine_gpus, learner_gpus, mid) > 0) == (g_lo > 0):
            lo = mid
        else:
            hi = mid
    return {"flip_response_tokens": round(math.sqrt(lo * hi)), "bound_below": below,
            "flip_range": [round(FLIP_RANGE[0] * cap), round(FLIP_RANGE[1] * cap)]}


def estimate(cfg: Config, engine_gpus: int, learner_gpus: int, counts: dict[str, int],
             hf_config: dict[str, Any]) -> dict[str, Any]:
    """The balance of this placement (``counts`` from ``gpu_memory.count_parameters``)."""
    pl = cfg.placement
    shape = Shape.of(hf_config, counts, cfg.model.dtype)
    response = float(pl.est_response_tokens or cfg.actors.max_new_tokens / 2)
    rows = step_rows(cfg, response)
    learn = learner_time(cfg, rows, shape, learner_gpus)
    gen = generation_time(cfg, rows, shape, engine_gpus)
    side, frac = idle(gen["generation_s"], learn["learner_s"])
    out = {"samples_per_step": len(rows.responses), "response_tokens": response,
           "truncated_fraction": float(rows.truncated.mean()), "engine_gpus": engine_gpus, "learner_gpus": learner_gpus,
           **learn, **gen, "idle_side": side, "idle_fraction": frac,
           **(flip(cfg, shape, engine_gpus, learner_gpus) if engine_gpus else {"flip_response_tokens": None})}
    return _rounded(out)


def _rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x


def describe(b: dict[str, Any]) -> list[str]:
    """The ``--dry-run`` lines of a balance estimate; a WARNING line when one side idles over half the time."""
    passes_s = ", ".join(f"{k} {v / 60:.1f}" for k, v in b["passes_s"].items())
    gen_bound = "memory" if b["generation_memory_s"] >= b["generation_flop_s"] else "FLOP"
    lines = [
        f"balance at ~{b['response_tokens']:.0f}-token mean responses ({b['samples_per_step']} samples a step, "
        f"{100 * b['truncated_fraction']:.1f}% cut at the cap):",
        f"  learner ~{b['learner_s'] / 60:.1f} min/step on {b['learner_gpus']} GPU(s) (passes, min: {passes_s}); micro-batch plan "
        f"{b['plan_over_ideal_train']:.2f}x the ideal in training, {b['plan_over_ideal_no_grad']:.2f}x in no-grad passes, "
        f"{b['slots_per_rank_train']} / {b['slots_per_rank_no_grad']} micro-batches a rank a pass",
        f"  generation ~{b['generation_s'] / 60:.1f} min/step on {b['engine_gpus']} engine GPU(s), {gen_bound}-bound "
        f"(memory {b['generation_memory_s'] / 60:.1f} min: KV cache {b['kv_read_tb'] / 1e3:.1f} PB + weights "
        f"{b['weights_read_tb'] / 1e3:.1f} PB read, ~{b['running_per_engine']:.0f} requests running an engine; FLOPs "
        f"{b['generation_flop_s'] / 60:.1f} min)",
        f"  the {b['idle_side']} would idle ~{100 * b['idle_fraction']:.0f}% of the time",
    ]
    if b.get("flip_response_tokens") is not None:
        other = "generation" if b["bound_below"] == "learner" else "learner"
        lines.append(f"  the run turns from {b['bound_below']}-bound to {other}-bound at a mean response length of "
                     f"~{b['flip_response_tokens']} tokens")
    elif "bound_below" in b:
        lo, hi = b["flip_range"]
        lines.append(f"  {b['bound_below']}-bound at every mean response length from {lo} to {hi} tokens")
    if b["idle_fraction"] > IDLE_WARN:
        move = "from the engines to the learner" if b["idle_side"] == "engines" else "from the learner to the engines"
        lines.append(f"WARNING: the {b['idle_side']} would idle ~{100 * b['idle_fraction']:.0f}% of the time: move GPUs "
                     f"{move} (placement.engine_gpus / learner_gpus), or correct placement.learner_utilization, "
                     "engine_utilization, gpu_memory_bandwidth_gbps, est_response_tokens")
    return lines
