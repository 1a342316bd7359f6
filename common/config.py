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
import sys
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from common.config_checks import REWARD_BUILTINS, first_problem, named_rewards, reward_name_problem
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

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

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


def _validate(cfg: Config) -> None:
    problem = first_problem(cfg)
    if problem is not None:
        raise ConfigError(problem)


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
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # an entry of a list of small records (task.eval_sets)
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
    if cfg.task.shuffle_seed < 0:  # the run's seed orders its data; saved resolved, so a resume keeps the order
        cfg.task.shuffle_seed = cfg.run.seed
    _validate(cfg)
    return cfg


def load_config_args(argv: list[str]) -> Config:
    """``[config.yaml] [key=value ...]`` as every vapo CLI takes them (raises ConfigError)."""
    path = argv[0] if argv and "=" not in argv[0] else None
    return load_config(path, argv[1:] if path else argv)


def to_dict(cfg: DataclassInstance) -> dict[str, Any]:
    """The config, or any section of it, as plain dicts and lists."""
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
