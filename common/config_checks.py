"""The config tree's rules beyond types: allowed values of choice keys, ranges and cross-key checks, reward
names, evaluation-set entries. Not a CLI; ``common.config.load_config`` raises the first broken rule as a
``ConfigError`` (kept apart from the loader so each file stays one job).
"""

from __future__ import annotations

import re

from common.config_sections import Config, TaskConfig
from common.security import is_loopback_host  # one definition of "loopback" for every bind rule

CHOICES: dict[str, tuple[str, ...]] = {
    "run.device": ("cpu", "cuda"),
    "task.bad_rows": ("skip", "error"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "engine.kind": ("rollout_server", "sglang", "external"),
    "engine.logprobs": ("original", "scaled"),
    "algo.critic": ("learned", "oracle"),
    "algo.baseline": ("critic", "group_loo"),
    "learner.value_head_surprise_source": ("critic_head", "behaviour", "frozen_base"),
    "engine.bind_protection": ("", "firewall", "private_network", "auth_proxy"),
    "metrics.bind_protection": ("", "firewall", "private_network", "auth_proxy"),
    "actors.weight_sync": ("wait", "abort"),
    "actors.push_pause": ("in_place", "retract", "abort", "none"),
    "learner.weight_transport": ("disk", "distributed"),
    "learner.push_backend": ("auto", "gloo", "nccl"),
    "learner.precision": ("fp32", "bf16", "fp16"),
    "learner.off_policy": ("behaviour", "decoupled", "rollout_correction"),
    "learner.rollout_correction_level": ("token", "sequence"),
    "algo.truncated": ("keep", "mask", "zero_reward"),
    "algo.actor_values": ("post_update", "pre_update"),
    "learner.eval_via": ("auto", "local", "engine"),
    "learner.resume_damaged": ("fallback", "refuse"),
    "algo.advantage": ("gae", "grpo"),
    "algo.loss_agg": ("token_mean", "seq_mean"),
    "placement.remote": ("ssh", "srun"),
    "placement.store_protection": ("", "firewall", "private_network"),
    "metrics.wandb_mode": ("offline", "online"),
}
# List-valued keys whose every item must be one of these.
ITEM_CHOICES: dict[str, tuple[str, ...]] = {
    "metrics.trackers": ("tensorboard", "wandb"),
}


Check = tuple[str, bool, str]  # (dotted key, holds, why not)


def first_problem(cfg: Config) -> str | None:
    """The first broken rule as ``"<dotted key>: <why>"`` (None when every rule holds): choices first, then the
    checks in declaration order."""
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            return f"{key}: {value!r} is not one of {', '.join(allowed)}"
    for key, allowed in ITEM_CHOICES.items():
        section, name = key.split(".")
        for item in getattr(getattr(cfg, section), name):
            if item not in allowed:
                return f"{key}: {item!r} is not one of {', '.join(allowed)}"
    checks = [*_actor_engine_checks(cfg), *_buffer_checks(cfg), *_learner_algo_checks(cfg), *_placement_task_checks(cfg),
              *_eval_set_checks(cfg)]
    return next((f"{key}: {why}" for key, ok, why in checks if not ok), None)


def _actor_engine_checks(cfg: Config) -> list[Check]:
    return [
        ("actors.group_size", cfg.actors.group_size >= 1, "must be >= 1"),
        ("actors.num_actors", cfg.actors.num_actors >= 1, "must be >= 1"),
        ("actors.max_new_tokens", cfg.actors.max_new_tokens >= 1, "must be >= 1"),
        ("actors.temperature", cfg.actors.temperature >= 0, "must be >= 0"),
        ("actors.temperature", cfg.actors.temperature == 1.0 or cfg.engine.logprobs == "scaled",
         f"{cfg.actors.temperature} needs engine.logprobs=scaled: with original the engine returns log π at "
         "temperature 1, not of the distribution it samples from, and every importance ratio would be off"),
        ("actors.top_p", 0 < cfg.actors.top_p <= 1, "must be in (0, 1]"),
        ("actors.prompts_in_flight", cfg.actors.prompts_in_flight >= 1, "must be >= 1"),
        ("actors.max_prompts", cfg.actors.max_prompts >= 0, "must be >= 0"),
        ("actors.weight_poll_s", cfg.actors.weight_poll_s > 0, "must be > 0"),
        ("actors.weight_wait_s", cfg.actors.weight_wait_s >= 0, "must be >= 0"),
        ("actors.send_timeout_s", cfg.actors.send_timeout_s > 0, "must be > 0"),
        ("actors.generate_timeout_s", cfg.actors.generate_timeout_s >= 0, "must be >= 0 (0 = auto)"),
        ("actors.min_tokens_per_s", cfg.actors.min_tokens_per_s > 0, "must be > 0"),
        ("engine.health_failures", cfg.engine.health_failures >= 1, "must be >= 1"),
        ("engine.health_interval_s", cfg.engine.health_interval_s > 0, "must be > 0"),
        ("engine.health_timeout_s", cfg.engine.health_timeout_s > 0, "must be > 0"),
        ("engine.host", not cfg.engine.host.startswith("["), "an IPv6 address is written without brackets (e.g. :: "
         "for every interface, ::1 for loopback)"),
        ("engine.host", is_loopback_host(cfg.engine.host) or bool(cfg.engine.bind_protection),
         f"{cfg.engine.host!r} is not a loopback address: the engine's /generate has no authentication (its control "
         "endpoints take an admin API key); bind 127.0.0.1 or set engine.bind_protection (firewall | private_network | auth_proxy)"),
        ("metrics.host", not cfg.metrics.prometheus or is_loopback_host(cfg.metrics.host) or bool(cfg.metrics.bind_protection),
         f"{cfg.metrics.host!r} is not a loopback address: every process's /metrics (no authentication) would be open "
         "to whoever reaches it; bind 127.0.0.1 or set metrics.bind_protection (firewall | private_network | auth_proxy)"),
    ]


def _buffer_checks(cfg: Config) -> list[Check]:
    return [
        ("buffer.max_staleness", cfg.buffer.max_staleness >= 0, "must be >= 0"),
        ("buffer.vocab_size", cfg.buffer.vocab_size >= 0, "must be >= 0"),
        ("task.reward_max", cfg.task.reward_min <= cfg.task.reward_max, "must be >= task.reward_min"),
        ("buffer.capacity_groups", cfg.buffer.capacity_groups >= 1, "must be >= 1"),
        ("buffer.capacity_bytes", cfg.buffer.capacity_bytes >= 1, "must be >= 1"),
        ("buffer.positives_capacity", cfg.buffer.positives_capacity >= 0, "must be >= 0"),
        ("buffer.max_frame_bytes", cfg.buffer.max_frame_bytes >= 1024, "must be >= 1024"),
        ("buffer.map_size_bytes", cfg.buffer.map_size_bytes >= 1 << 20, "must be >= 1 MiB"),
        ("buffer.commit_batch", cfg.buffer.commit_batch >= 1, "must be >= 1"),
        ("buffer.credit_ttl_s", cfg.buffer.credit_ttl_s > 0, "must be > 0"),
        ("buffer.peer_timeout_s", cfg.buffer.peer_timeout_s >= 0, "must be >= 0"),
        ("buffer.max_credit_per_actor", cfg.buffer.max_credit_per_actor >= 0, "must be >= 0"),
        ("buffer.max_credit_per_connection", cfg.buffer.max_credit_per_connection >= 0, "must be >= 0"),
        ("buffer.max_batch_groups", cfg.buffer.max_batch_groups >= 1, "must be >= 1"),
        ("buffer.max_batch_wait_s", cfg.buffer.max_batch_wait_s >= 5, "must be >= 5 (the learner asks in waits of 5 s)"),
        ("buffer.learner_version_max_step", cfg.buffer.learner_version_max_step >= 1, "must be >= 1"),
    ]


def _learner_algo_checks(cfg: Config) -> list[Check]:
    return [
        ("learner.batch_groups", cfg.learner.batch_groups >= 1, "must be >= 1"),
        ("learner.mini_batches", cfg.learner.mini_batches >= 1, "must be >= 1"),
        ("learner.ppo_epochs", cfg.learner.ppo_epochs >= 1, "must be >= 1"),
        ("learner.micro_batch_size", cfg.learner.micro_batch_size >= 1, "must be >= 1"),
        ("learner.micro_batch_tokens", cfg.learner.micro_batch_tokens >= 0, "must be >= 0 (0 = micro_batch_size x the longest row)"),
        ("learner.no_grad_micro_batch_tokens", cfg.learner.no_grad_micro_batch_tokens >= 0, "must be >= 0 (0 = 2 x the training budget)"),
        ("learner.activation_checkpointing_every", cfg.learner.activation_checkpointing_every >= 1, "must be >= 1"),
        ("learner.peak_tflops", cfg.learner.peak_tflops >= 0, "must be >= 0 (0 = by the device)"),
        ("learner.zero_stage", 0 <= cfg.learner.zero_stage <= 3, "must be 0..3"),
        ("learner.dist_timeout_s", cfg.learner.dist_timeout_s >= 1, "must be >= 1"),
        ("algo.gamma", 0 <= cfg.algo.gamma <= 1, "must be in [0, 1]"),
        ("algo.lambda_critic", 0 <= cfg.algo.lambda_critic <= 1, "must be in [0, 1]"),
        ("algo.lambda_actor", 0 <= cfg.algo.lambda_actor <= 1, "must be in [0, 1]"),
        ("algo.alpha", cfg.algo.alpha > 0, "must be > 0"),
        ("algo.clip_low", 0 <= cfg.algo.clip_low < 1, "must be in [0, 1)"),
        ("algo.clip_high", cfg.algo.clip_high >= 0, "must be >= 0"),
        ("algo.clip_ratio_c", cfg.algo.clip_ratio_c == 0 or cfg.algo.clip_ratio_c > 1, "must be 0 (off) or > 1"),
        ("algo.overlong_max_length", cfg.algo.overlong_max_length >= 0, "must be >= 0"),
        ("algo.critic", cfg.algo.critic == "learned" or (cfg.task.name == "chain" and cfg.algo.advantage == "gae"),
         "oracle needs task.name=chain (the only task whose state the oracle reads) and algo.advantage=gae"),
        ("algo.oracle_line_accuracy", 0 <= cfg.algo.oracle_line_accuracy <= 1, "must be in [0, 1] (0 = each batch's own)"),
        ("learner.critic_updates", cfg.learner.critic_updates >= 0, "must be >= 0 (0 = learner.mini_batches)"),
        ("learner.value_head_surprise_source", not (cfg.learner.value_head_surprise and cfg.learner.zero_stage == 3
                                                    and cfg.learner.value_head_surprise_source == "frozen_base"),
         "frozen_base keeps a whole frozen copy of the base model on every rank: not with learner.zero_stage=3 "
         "(behaviour reads the same features' source from the samples)"),
        ("algo.baseline", cfg.algo.baseline == "critic" or cfg.algo.advantage == "gae", "group_loo needs algo.advantage=gae"),
        ("value_pretrain.pool_groups", cfg.value_pretrain.pool_groups == 0
         or cfg.value_pretrain.pool_groups >= cfg.value_pretrain.batch_groups, "must be 0 or >= value_pretrain.batch_groups"),
        ("learner.decoupled_weight_cap", cfg.learner.decoupled_weight_cap > 0, "must be > 0"),
        ("learner.rollout_correction_cap", cfg.learner.rollout_correction_cap > 0, "must be > 0"),
        ("nll.coef", cfg.nll.coef >= 0, "must be >= 0"),
        ("nll.replay_fraction", cfg.nll.replay_fraction >= 0, "must be >= 0"),
        ("metrics.final_scrape_wait_s", cfg.metrics.final_scrape_wait_s >= 0, "must be >= 0"),
    ]


def _placement_task_checks(cfg: Config) -> list[Check]:
    return [
        ("placement.hosts", len(cfg.placement.hosts) >= 1 and all(cfg.placement.hosts), "must name at least one host"),
        ("placement.gpus_per_host", cfg.placement.gpus_per_host >= 1, "must be >= 1"),
        ("placement.master_port", 0 < cfg.placement.master_port < 65536, "must be a port number"),
        ("placement.gpu_memory_gib", cfg.placement.gpu_memory_gib > 0, "must be > 0"),
        ("placement.learner_memory_fraction", 0 < cfg.placement.learner_memory_fraction <= 1, "must be in (0, 1]"),
        ("placement.ssh_connect_timeout_s", cfg.placement.ssh_connect_timeout_s >= 1, "must be >= 1"),
        ("placement.ssh_alive_interval_s", cfg.placement.ssh_alive_interval_s >= 1, "must be >= 1"),
        ("placement.ssh_alive_count_max", cfg.placement.ssh_alive_count_max >= 1, "must be >= 1"),
        ("placement.min_engines", cfg.placement.min_engines >= 1, "must be >= 1"),
        ("placement.min_engines_grace_s", cfg.placement.min_engines_grace_s >= 0, "must be >= 0"),
        ("placement.srun_cpus_per_task", cfg.placement.srun_cpus_per_task >= 0, "must be >= 0"),
        ("placement.gpu_peak_tflops", cfg.placement.gpu_peak_tflops > 0, "must be > 0"),
        ("placement.learner_utilization", 0 < cfg.placement.learner_utilization <= 1, "must be in (0, 1]"),
        ("placement.engine_utilization", 0 < cfg.placement.engine_utilization <= 1, "must be in (0, 1]"),
        ("placement.learner_gather_gbps", cfg.placement.learner_gather_gbps > 0, "must be > 0"),
        ("placement.gpu_memory_bandwidth_gbps", cfg.placement.gpu_memory_bandwidth_gbps > 0, "must be > 0"),
        ("placement.engine_bandwidth_utilization", 0 < cfg.placement.engine_bandwidth_utilization <= 1, "must be in (0, 1]"),
        ("placement.est_prompt_tokens", cfg.placement.est_prompt_tokens >= 0, "must be >= 0"),
        ("placement.est_response_tokens", 0 <= cfg.placement.est_response_tokens < cfg.actors.max_new_tokens,
         "must be >= 0 and below actors.max_new_tokens (a mean response length; 0 = half of it)"),
        ("task.min_digits", 1 <= cfg.task.min_digits <= cfg.task.max_digits, "must satisfy 1 <= min <= max_digits"),
        ("task.min_steps", 1 <= cfg.task.min_steps <= cfg.task.max_steps <= 99, "must satisfy 1 <= min <= max_steps <= 99"),
        ("task.reward", reward_name_problem(cfg.task.reward) is None, reward_name_problem(cfg.task.reward) or ""),
        *[(f"task.reward_by_source[{src!r}]", reward_name_problem(name) is None, reward_name_problem(name) or "")
          for src, name in cfg.task.reward_by_source.items()],
        ("task.reward_workers", cfg.task.reward_workers >= 1, "must be >= 1"),
        ("task.reward_timeout_s", cfg.task.reward_timeout_s > 0, "must be > 0"),
        ("task.reward_memory_mb", cfg.task.reward_memory_mb >= 64, "must be >= 64"),
        ("task.reward_max", cfg.task.reward_min <= 0.0 <= cfg.task.reward_max or not named_rewards(cfg.task),
         "a named task.reward scores a failed call 0: task.reward_min <= 0 <= task.reward_max"),
    ]


REWARD_BUILTINS = ("boxed", "answer_line", "exact")


def reward_name_problem(name: str) -> str | None:
    """Why ``name`` is not a reward name (None when it is): '' | a built-in | ``file:<path>:<function>``."""
    if name == "" or name in REWARD_BUILTINS:
        return None
    if name.startswith("file:"):
        path, _, function = name[len("file:"):].rpartition(":")
        if path and function.isidentifier():
            return None
        return f"{name!r}: expected file:<path>:<function> with a Python function name"
    return f"{name!r} is not a reward: use '' (the task's verifier) | {' | '.join(REWARD_BUILTINS)} | file:<path>:<function>"


def named_rewards(task: TaskConfig) -> set[str]:
    """The rewards ``task`` names other than the task's own verifier ('')."""
    return {n for n in (task.reward, *task.reward_by_source.values()) if n}


def _eval_set_checks(cfg: Config) -> list[Check]:
    """Each set's name is a metric label value and a key of the eval record: safe characters, unique."""
    sets, out = cfg.task.eval_sets, []
    for i, s in enumerate(sets):
        key = f"task.eval_sets[{i}]"
        out += [(f"{key}.name", bool(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", s.name)) and s.name != "heldout",
                 f"{s.name!r}: needs 1-64 of A-Z a-z 0-9 _ . - (not heldout: the held-out slice's name)"),
                (f"{key}.path", bool(s.path), "must name the set's file (.jsonl, .parquet or a datasets.save_to_disk directory)"),
                (f"{key}.k", s.k >= 0, "must be >= 0 (0 = learner.eval_k)"),
                (f"{key}.max_new_tokens", s.max_new_tokens >= 0, "must be >= 0 (0 = actors.max_new_tokens)")]
    names = [s.name for s in sets]
    dup = sorted({n for n in names if names.count(n) > 1})
    return [*out, ("task.eval_sets", not dup, f"set names must be unique; repeated: {', '.join(dup)}")]
