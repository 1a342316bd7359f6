"""Balance of a placement: estimated generation time and learner time per RL step, from FLOP counts.

    b = estimate(cfg, n_engine_gpus, n_learner_gpus, hf_config)   # None without a model shape
    b["generation_s"], b["learner_s"], b["idle_side"], b["idle_fraction"]

Asynchronous RL runs at the pace of its slower side: admission control (``buffer.max_staleness``) holds the
engines back when the learner is slower, and the learner waits for batches when the engines are. Both
sides' work per step is counted in FLOPs:

- a forward pass costs ``2·N`` per token (N parameters) plus attention, ``4·L·q·c`` per token (L layers,
  q = heads × head_dim, c = the tokens it attends to);
- generation: each of the step's ``S = learner.batch_groups × actors.group_size`` samples prefills
  P prompt tokens (mean context P/2) and decodes R response tokens (mean context P + R/2);
- learner: per sample T = P + R tokens at mean context T/2; the policy trains with forward + backward
  (3 forward passes' worth, one more with activation checkpointing) per PPO epoch, a recomputed π_old is one
  forward (``learner.off_policy`` decoupled / rollout_correction), the critic (GAE) one forward for the
  values plus its own training passes;

with P = ``placement.est_prompt_tokens``, R = ``placement.est_response_tokens`` (0 = half of
``actors.max_new_tokens``), each side's GPUs at ``placement.gpu_peak_tflops`` × its utilisation
(``placement.learner_utilization``, ``placement.engine_utilization``: decoding is memory-bound, so the
engines' share of peak is far lower; measure both on the real hardware and write them in the config).
"""

from __future__ import annotations

from typing import Any

from common.config import Config

IDLE_WARN = 0.5  # a side idle more than this fraction of the time is worth rebalancing


def forward_flops(n_params: float, layers: int, q_dim: int, context: float) -> float:
    """FLOPs of one token's forward pass: the weights' multiply-adds plus attention over ``context`` tokens."""
    return 2.0 * n_params + 4.0 * layers * q_dim * context


def step_flops(n_policy: float, n_critic: float, layers: int, q_dim: int, samples: int, prompt: float,
               response: float, policy_passes: float, critic_passes: float) -> tuple[float, float]:
    """(generation FLOPs, learner FLOPs) of one step. ``*_passes``: forward-pass equivalents per token."""
    decode = response * forward_flops(n_policy, layers, q_dim, prompt + response / 2)
    prefill = prompt * forward_flops(n_policy, layers, q_dim, prompt / 2)
    tokens = prompt + response
    per_sample_learner = tokens * (policy_passes * forward_flops(n_policy, layers, q_dim, tokens / 2)
                                   + critic_passes * forward_flops(n_critic, layers, q_dim, tokens / 2))
    return samples * (decode + prefill), samples * per_sample_learner


def passes(cfg: Config) -> tuple[float, float]:
    """Forward-pass equivalents per token per step: (policy, critic)."""
    train = 3.0 + (1.0 if cfg.learner.activation_checkpointing else 0.0)  # forward + backward (+ recompute)
    epochs = cfg.learner.ppo_epochs
    policy = epochs * train + (1.0 if cfg.learner.off_policy != "behaviour" else 0.0)
    critic = 1.0 + epochs * train if cfg.algo.advantage == "gae" else 0.0
    return policy, critic


def seconds(flops: float, gpus: int, peak_tflops: float, utilization: float) -> float:
    return flops / (max(gpus, 1) * peak_tflops * 1e12 * utilization)


def idle(generation_s: float, learner_s: float) -> tuple[str, float]:
    """Which side waits for the other, and for what fraction of the time."""
    if generation_s >= learner_s:
        return "learner", 1.0 - learner_s / generation_s if generation_s > 0 else 0.0
    return "engines", 1.0 - generation_s / learner_s


def estimate(cfg: Config, engine_gpus: int, learner_gpus: int, counts: dict[str, int],
             hf_config: dict[str, Any]) -> dict[str, Any]:
    """The balance of this placement (``counts`` from ``gpu_memory.count_parameters``)."""
    pl = cfg.placement
    c = hf_config.get("text_config", hf_config)
    layers, heads = int(c["num_hidden_layers"]), int(c.get("num_attention_heads", 1))
    q_dim = heads * int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    response = float(pl.est_response_tokens or cfg.actors.max_new_tokens / 2)
    samples = cfg.learner.batch_groups * cfg.actors.group_size
    p_pass, c_pass = passes(cfg)
    gen, learn = step_flops(counts["policy"], counts["critic"], layers, q_dim, samples, float(pl.est_prompt_tokens),
                            response, p_pass, c_pass)
    gen_s = seconds(gen, engine_gpus, pl.gpu_peak_tflops, pl.engine_utilization)
    learn_s = seconds(learn, learner_gpus, pl.gpu_peak_tflops, pl.learner_utilization)
    side, frac = idle(gen_s, learn_s)
    return {"samples_per_step": samples, "response_tokens": response, "generation_pflop": round(gen / 1e15, 1),
            "learner_pflop": round(learn / 1e15, 1), "engine_gpus": engine_gpus, "learner_gpus": learner_gpus,
            "generation_s": round(gen_s, 1), "learner_s": round(learn_s, 1), "idle_side": side,
            "idle_fraction": round(frac, 3)}


def describe(b: dict[str, Any]) -> tuple[str, str | None]:
    """The ``--dry-run`` line of a balance estimate, and a warning when one side idles over half the time."""
    line = (f"balance: generation ~{b['generation_s'] / 60:.1f} min/step on {b['engine_gpus']} engine GPU(s), learner "
            f"~{b['learner_s'] / 60:.1f} min/step on {b['learner_gpus']} learner GPU(s) ({b['samples_per_step']} "
            f"samples of ~{b['response_tokens']:.0f} response tokens); the {b['idle_side']} would idle "
            f"~{100 * b['idle_fraction']:.0f}% of the time")
    if b["idle_fraction"] <= IDLE_WARN:
        return line, None
    move = "from the engines to the learner" if b["idle_side"] == "engines" else "from the learner to the engines"
    return line, (f"WARNING: the {b['idle_side']} would idle ~{100 * b['idle_fraction']:.0f}% of the time: move GPUs "
                  f"{move} (placement.engine_gpus / learner_gpus), or correct placement.gpu_peak_tflops, "
                  "placement.learner_utilization, placement.engine_utilization, placement.est_response_tokens")
