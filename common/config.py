"""The one config tree of vapo: dataclasses (declared in ``common.config_sections``, re-exported here), YAML +
dotted overrides, strict validation.

Every process loads the same tree:

    cfg = load_config("ops/configs/default.yaml", ["learner.total_steps=50", "run.seed=1"])

Unknown keys and values of the wrong type are errors that name the dotted key. The resolved config is
written into the run directory (``save_config``) and can be loaded back unchanged.

``python -m common.config [config.yaml] [key=value ...]`` prints the resolved tree; ``--help`` lists every
field with its documentation.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from common.config_sections import (
    ActorsConfig,
    AlgoConfig,
    BootstrapConfig,
    BufferConfig,
    Config,
    CurveConfig,
    EngineConfig,
    EvalSetConfig,
    LearnerConfig,
    MetricsConfig,
    ModelConfig,
    NLLConfig,
    PlacementConfig,
    RunConfig,
    TaskConfig,
    ValuePretrainConfig,
)
from common.security import is_loopback_host  # one definition of "loopback" for every bind rule

# The sections are re-exported: every importer takes them from here, with the loader.
__all__ = [
    "ActorsConfig",
    "AlgoConfig",
    "BootstrapConfig",
    "BufferConfig",
    "Config",
    "CurveConfig",
    "EngineConfig",
    "EvalSetConfig",
    "LearnerConfig",
    "MetricsConfig",
    "ModelConfig",
    "NLLConfig",
    "PlacementConfig",
    "RunConfig",
    "TaskConfig",
    "ValuePretrainConfig",
    "ConfigError", "config_from_argv", "describe", "dump_yaml", "load_config", "load_config_args",
    "save_config", "to_dict", "usage", "REWARD_BUILTINS", "named_rewards", "reward_name_problem",
]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the dotted key."""


_CHOICES: dict[str, tuple[str, ...]] = {
    "run.device": ("cpu", "cuda"),
    "task.bad_rows": ("skip", "error"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "engine.kind": ("rollout_server", "sglang", "external"),
    "engine.logprobs": ("original", "scaled"),
    "algo.critic": ("learned", "oracle"),
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
_ITEM_CHOICES: dict[str, tuple[str, ...]] = {
    "metrics.trackers": ("tensorboard", "wandb"),
}


Check = tuple[str, bool, str]  # (dotted key, holds, why not)


def _validate(cfg: Config) -> None:
    """The first broken rule as a ConfigError: choices first, then the checks in declaration order."""
    for key, allowed in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
    for key, allowed in _ITEM_CHOICES.items():
        section, name = key.split(".")
        for item in getattr(getattr(cfg, section), name):
            if item not in allowed:
                raise ConfigError(f"{key}: {item!r} is not one of {', '.join(allowed)}")
    checks = [*_actor_engine_checks(cfg), *_buffer_checks(cfg), *_learner_algo_checks(cfg), *_placement_task_checks(cfg),
              *_eval_set_checks(cfg)]
    for key, ok, why in checks:
        if not ok:
            raise ConfigError(f"{key}: {why}")


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


# ------------------------------------------------------------------------------------- typed merging


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; allow int -> float, nothing else implicit."""
    origin = typing.get_origin(tp)
    if origin is dict:  # a mapping replaces the whole default (string keys only: they are YAML mapping keys)
        key_tp, item_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return {_coerce(f"{key} key", key_tp, k): _coerce(f"{key}[{k!r}]", item_tp, v) for k, v in value.items()}
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", item_tp, v) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):  # an entry of a list of small records (task.eval_sets)
        allowed = ", ".join(fl.name for fl in dataclasses.fields(tp))
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping with {allowed}, got {type(value).__name__} {value!r}")
        for k in value:
            if k not in {fl.name for fl in dataclasses.fields(tp)}:
                raise ConfigError(f"{key}.{k}: unknown field; an entry takes {allowed}")
        entry = tp()
        _merge(entry, value, key + ".")
        return entry
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, arg, value)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} does not match {tp}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a bool, got {type(value).__name__} {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an int, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a float, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


def _did_you_mean(key: str, names: set[str]) -> str:
    """A hint naming the known keys nearest ``key``: close spellings (``group_sizee``), else keys with
    ``key`` as one of their ``_`` words (``lr`` -> ``actor_lr, critic_lr, ...``), else a shared prefix."""
    close = (difflib.get_close_matches(key, names, n=3, cutoff=0.75)
             or [n for n in names if key in n.split("_")]
             or [n for n in names if n.startswith(key[:3])])
    return f" (did you mean {', '.join(sorted(close))}?)" if close else ""


def _merge(obj: Any, data: dict[str, Any], prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {fl.name for fl in dataclasses.fields(obj)}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            hint = _did_you_mean(str(k), names)
            raise ConfigError(f"{key}: unknown config key{hint}")
        current = getattr(obj, k)
        if dataclasses.is_dataclass(current):
            _merge(current, v, key + ".")
        else:
            setattr(obj, k, _coerce(key, hints[k], v))


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. learner.total_steps=10)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw.strip()  # not YAML (e.g. `[::]`): the text itself, which the field's type check then judges
    return key.split("."), value


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path):
        out = {part: out}
    return out


def _coerce_override(cfg: Config, path: list[str], value: Any, raw: str = "") -> Any:
    """YAML parses `x=1e-4` as a string and `x=3` as int; coerce to what the field wants. A string field takes
    the text as written when YAML made something else of it (`engine.host=::` is a mapping to YAML)."""
    obj: Any = cfg
    for part in path[:-1]:
        obj = getattr(obj, part, None)
        if obj is None or not dataclasses.is_dataclass(obj):
            return value
    hints = typing.get_type_hints(type(obj)) if dataclasses.is_dataclass(obj) else {}
    tp = hints.get(path[-1])
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if tp is str and isinstance(value, dict | list):
        return raw.strip()
    if tp is str and value is not None and not isinstance(value, str):
        return str(value)
    return value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build the config: defaults <- YAML file <- dotted ``key=value`` overrides, then validate."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}") from e
        _merge(cfg, data)
    for item in overrides or []:
        keypath, value = _parse_override(item)
        value = _coerce_override(cfg, keypath, value, item.split("=", 1)[1])
        _merge(cfg, _nest(keypath, value))
    _validate(cfg)
    return cfg


def load_config_args(argv: list[str]) -> Config:
    """``[config.yaml] [key=value ...]`` as every vapo CLI takes them (raises ConfigError)."""
    path = argv[0] if argv and "=" not in argv[0] else None
    return load_config(path, argv[1:] if path else argv)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: Config, path: str | Path | None = None) -> Path:
    """Write the resolved config (default ``<run dir>/config.yaml``) atomically."""
    out = Path(path) if path is not None else cfg.run_dir / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(dump_yaml(cfg))
    tmp.replace(out)
    return out


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) for every leaf field, in declaration order."""
    rows: list[tuple[str, str, Any, str]] = []
    inst = cls()
    hints = typing.get_type_hints(cls)
    for fl in dataclasses.fields(cls):
        value = getattr(inst, fl.name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe(type(value), f"{prefix}{fl.name}."))
        else:
            tp = hints[fl.name]
            args = ", ".join(_type_name(a) for a in typing.get_args(tp))  # list[EvalSetConfig], not its module path
            tp_name = str(tp) if typing.get_origin(tp) is not list else f"list[{args}]"
            rows.append((f"{prefix}{fl.name}", _type_name(tp) if not typing.get_origin(tp) else tp_name, value, fl.metadata.get("doc", "")))
    return rows


def usage() -> str:
    """The ``--help`` of every config-driven command: how to pass the config, then every field."""
    rows = [f"  {key:<36} {tp:<10} {default!r:<28} {doc}" for key, tp, default, doc in describe()]
    return "usage: python -m common.config [config.yaml] [key=value ...]\n\nPrints the resolved config. Fields:\n\n" + "\n".join(rows)


def config_from_argv(prog: str, usage: str, argv: list[str] | None = None) -> Config | int:
    """The config named by ``argv`` (default ``sys.argv[1:]``), or the exit code the command should return.

    ``-h``/``--help`` prints ``usage`` and gives 0; an unknown key, bad value or unreadable file is reported
    as ``<prog>: config error: ...`` on stderr and gives 2. ``--local_rank=N`` (added by the DeepSpeed
    launcher) is ignored.
    """
    args = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    if any(a in ("-h", "--help") for a in args):
        print(usage)
        return 0
    try:
        return load_config_args(args)
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv("common.config", usage(), argv)
    if isinstance(cfg, int):
        return cfg
    print(dump_yaml(cfg), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
