"""Files a config names, checked before a run starts (``ops/launch.sh CONFIG --dry-run`` and every launch).

    missing_files(cfg, root)   # ["model.path: /models/x has no config.json", ...]; [] when all are there
    check_dataset(cfg, root)   # a dataset: task's rows loaded and fitted to the context: (problems, bad-row report)

Relative paths are taken from ``root`` (the repository: every process of a run starts there). Paths the
launcher itself creates are not required: the base model when it can bootstrap one (``learner.sft``), the
run's CurveZMQ keys when ``buffer.curve`` names no key file (the launcher writes them into ``keys_dir`` or
``<run dir>/keys``). On several hosts the same paths must exist on every host (a shared filesystem); this
checks host 0.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from common.config import Config
from common.security import ROLES  # the client roles of a launched run, one key each


def _path(root: Path, p: str) -> Path:
    q = Path(p).expanduser()
    return q if q.is_absolute() else root / q


def can_bootstrap(cfg: Config) -> bool:
    """The launcher builds a missing base model with learner.sft (the tiny CPU models of the shipped tasks)."""
    return cfg.engine.kind == "rollout_server" or cfg.task.name == "addition"


def _curve_files(cfg: Config) -> list[tuple[str, str, str]]:
    """(config key, path, kind: file | dir | any) of the CurveZMQ key files a run will read."""
    c = cfg.buffer.curve
    named = [("buffer.curve.server_secret_key", c.server_secret_key, "file"),
             ("buffer.curve.server_public_key", c.server_public_key, "file"),
             ("buffer.curve.client_secret_key", c.client_secret_key, "file"),
             ("buffer.curve.authorized_clients_dir", c.authorized_clients_dir, "dir")]
    if not any(p for _, p, _ in named):
        return []  # the launcher writes the run's own keys
    out = [(k, p, d) for k, p, d in named if p]
    if c.keys_dir:  # what is not named comes from keys_dir
        d = c.keys_dir
        defaults = {"buffer.curve.server_secret_key": [f"{d}/server.key_secret"],
                    "buffer.curve.server_public_key": [f"{d}/server.key"],
                    "buffer.curve.client_secret_key": [f"{d}/{r}.key_secret" for r in ROLES],
                    "buffer.curve.authorized_clients_dir": [f"{d}/authorized_clients"]}
        for key, paths in defaults.items():
            if not getattr(c, key.rsplit(".", 1)[1]):
                kind = "dir" if key.endswith("_dir") else "file"
                out += [(f"buffer.curve.keys_dir ({key.rsplit('.', 1)[1]})", p, kind) for p in paths]
    return out


def _ssh_files(cfg: Config) -> list[tuple[str, str, str]]:
    """Files named by ssh's -F (config) and -i (identity) in placement.ssh_args."""
    words = shlex.split(cfg.placement.ssh_args)
    return [("placement.ssh_args", w[2:] or (words[i + 1] if i + 1 < len(words) else ""), "file")
            for i, w in enumerate(words) if w[:2] in ("-F", "-i")]


def _reward_files(cfg: Config) -> list[tuple[str, str, str]]:
    """The users' reward files ``task.reward`` and ``task.reward_by_source`` name (``file:<path>:<function>``)."""
    named = [("task.reward", cfg.task.reward),
             *((f"task.reward_by_source[{src!r}]", name) for src, name in cfg.task.reward_by_source.items())]
    return [(key, name[len("file:"):].rpartition(":")[0], "file") for key, name in named if name.startswith("file:")]


ANY_PATH = {"any": "checkpoint", "data": "file"}  # how a kind that may be a file or a directory is named


def missing_files(cfg: Config, root: Path) -> list[str]:
    """One line per file or directory the config names that does not exist, led by its config key."""
    problems: list[str] = []
    model = _path(root, cfg.model.path)
    if not (model / "config.json").is_file() and not can_bootstrap(cfg):
        problems.append(f"model.path: {model} has no config.json (a local HF checkpoint; nothing is downloaded)")
    if cfg.model.critic_path and not (_path(root, cfg.model.critic_path) / "config.json").is_file():
        problems.append(f"model.critic_path: {_path(root, cfg.model.critic_path)} has no config.json (the critic's base "
                        "is never built by the launcher: python -m learner.sft CONFIG model.path=DIR builds one)")
    if cfg.task.name.startswith("jsonl:"):
        data = _path(root, cfg.task.name.split(":", 1)[1])
        if not data.is_file():
            problems.append(f"task.name: the jsonl file {data} does not exist")
    if cfg.task.name.startswith("dataset:"):
        data = _path(root, cfg.task.name.split(":", 1)[1])
        if not data.exists():
            problems.append(f"task.name: the data set {data} does not exist")
    checks = [*_curve_files(cfg), *_ssh_files(cfg), *_reward_files(cfg)]
    # A set is a file or a datasets.save_to_disk directory.
    checks += [(f"task.eval_sets[{i}].path ({s.name})", s.path, "data") for i, s in enumerate(cfg.task.eval_sets)]
    if cfg.engine.admin_api_key_file:
        checks.append(("engine.admin_api_key_file", cfg.engine.admin_api_key_file, "file"))
    if cfg.learner.resume not in ("auto", "never"):
        checks.append(("learner.resume", cfg.learner.resume, "any"))
    for key, p, kind in checks:
        q = _path(root, p)
        if not {"file": q.is_file, "dir": q.is_dir, "any": q.exists, "data": q.exists}[kind]():
            hint = " (python -m buffer.keys DIR writes a run's keys)" if key.startswith("buffer.curve") else ""
            problems.append(f"{key}: {ANY_PATH.get(kind, kind)} {q} does not exist{hint}")
    return problems


def check_dataset(cfg: Config, root: Path) -> tuple[list[str], str]:
    """A ``dataset:`` task loaded as a run will load it, with model.path's tokenizer when model.path is there:
    (problems led by task.name, the bad-row report of ``task.bad_rows=skip``). Nothing for other tasks."""
    if not cfg.task.name.startswith("dataset:"):
        return [], ""
    data = _path(root, cfg.task.name.split(":", 1)[1])
    if not data.exists():
        return [], ""  # missing_files names it
    # Deliberate lazy imports: the launcher's other checks need neither pyarrow nor transformers.
    from common.tasks import fit_task, get_task  # noqa: PLC0415 - pyarrow and math_verify, for dataset tasks only
    try:
        task = get_task(dataclasses.replace(cfg.task, name=f"dataset:{data}"))
        model = _path(root, cfg.model.path)
        if (model / "config.json").is_file():
            from common.modeling import load_tokenizer  # noqa: PLC0415 - transformers takes seconds; only dataset tasks pay

            fit_task(task, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model))),
                     load_tokenizer(model))
    except ValueError as e:
        return [f"task.name: {e}"], ""
    return [], getattr(task, "report", "")
