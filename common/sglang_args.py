"""Command lines of the real SGLang servers used on GPUs (``engine.kind = sglang``), one per actor: what the
placement plan (``common.placement``) lists and the launcher starts; ``actors.sglang_launcher`` prints them.

``sglang_command(cfg, i)`` for ``i < actors.num_actors``; actor ``i`` then talks to
``http://engine.host:engine.base_port + i``. Engine ``i`` gets its
``engine.sglang_tp_size`` GPUs of ``placement.engine_gpus`` through ``CUDA_VISIBLE_DEVICES`` (without a
placement: GPUs ``i·tp .. i·tp + tp - 1``). Every flag is a real ``sglang.launch_server`` argument (checked against
``python/sglang/srt/server_args.py``; the list is ``SGLANG_FLAGS_USED``). ``engine.logprobs = original``
sets ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so SGLang returns log_softmax(logits) before temperature, what the
learner recomputes. ``--enable-metrics`` is always passed: without it SGLang has no ``/metrics``.
The server starts at ``--weight-version 0``; the actor loads the newest published
weights through ``/update_weights_from_disk`` before it generates. With ``engine.admin_api_key_file`` the
command names ``--config <key file>.sglang.yaml``, which ``actors.sglang_launcher.write_admin_key_config``
writes (planning writes nothing).
"""

from __future__ import annotations

import sys
from pathlib import Path

from common.config import Config, ConfigError
from common.gpu_spec import parse_gpus

# Flags this module emits, as named in SGLang's ServerArgs (field name -> --kebab-case flag).
SGLANG_FLAGS_USED = (
    "--model-path", "--host", "--port", "--tp-size", "--mem-fraction-static", "--dtype",
    "--random-seed", "--weight-version", "--context-length", "--enable-metrics", "--config",
)
_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def gpu_ids(cfg: Config, index: int) -> list[int]:
    """Engine ``index``'s local GPU ids: from ``placement.engine_gpus`` when set (``common.gpu_spec``),
    else ``index·tp .. index·tp + tp - 1``."""
    tp = cfg.engine.sglang_tp_size
    if cfg.placement.engine_gpus.strip():
        gpus = parse_gpus(cfg.placement.engine_gpus, "placement.engine_gpus")[index * tp:(index + 1) * tp]
        return [g % cfg.placement.gpus_per_host for g in gpus]
    return list(range(index * tp, (index + 1) * tp))


def sglang_command(cfg: Config, index: int) -> tuple[list[str], dict[str, str]]:
    """``(argv, extra environment)`` that starts SGLang engine ``index`` for actor ``index``."""
    if not 0 <= index < cfg.actors.num_actors:
        raise ValueError(f"engine index {index} outside [0, {cfg.actors.num_actors})")
    e = cfg.engine
    if e.sglang_tp_size < 1:
        raise ConfigError("engine.sglang_tp_size: must be >= 1")
    if not 0 < e.sglang_mem_fraction_static <= 1:
        raise ConfigError("engine.sglang_mem_fraction_static: must be in (0, 1]")
    if e.base_port <= 0:
        raise ConfigError("engine.base_port: SGLang engines need fixed ports (> 0)")
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", cfg.model.path,
        "--host", e.host,
        "--port", str(e.base_port + index),
        "--tp-size", str(e.sglang_tp_size),
        "--mem-fraction-static", str(e.sglang_mem_fraction_static),
        "--dtype", _DTYPE[cfg.model.dtype],
        "--random-seed", str(cfg.run.seed * 1000 + index),
        "--weight-version", "0",
        "--enable-metrics",  # SGLang serves /metrics only with it (observability args): Prometheus' engine job
    ]
    if e.context_length > 0:
        argv += ["--context-length", str(e.context_length)]
    if e.admin_api_key_file:
        argv += ["--config", str(admin_key_config_path(e.admin_api_key_file))]  # written by write_admin_key_config
    argv += list(e.sglang_extra_args)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpu_ids(cfg, index))}
    if e.logprobs == "original":
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    return argv, env


def admin_key_config_path(key_file: str) -> Path:
    """Where ``write_admin_key_config`` puts SGLang's ``--config`` file for ``key_file`` (planning writes nothing)."""
    return Path(f"{key_file}.sglang.yaml")
