"""Command lines of the real SGLang servers vapo starts (``engine.kind = sglang``), one per actor, on GPUs or on
the CPU: what the placement plan (``common.placement``) lists and the launcher starts; ``actors.sglang_launcher``
prints them.

``sglang_command(cfg, i)`` for ``i < actors.num_actors``; actor ``i`` then talks to
``http://engine.host:engine.base_port + i``. Every flag is a real ``sglang.launch_server`` argument (checked
against SGLang 0.5.23's ``srt/server_args.py`` and ``srt/arg_groups/fields/``; the list is
``SGLANG_FLAGS_USED``; ``engine.sglang_extra_args`` come last and so override). ``engine.logprobs = original``
sets ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so SGLang returns log_softmax(logits) before temperature, what the
learner recomputes. ``--enable-metrics`` is always passed: without it SGLang has no ``/metrics``. The server
starts at ``--weight-version 0``; the actor loads the newest published weights through
``/update_weights_from_disk`` before it generates. With ``engine.admin_api_key_file`` the command names
``--config <key file>.sglang.yaml``, which ``actors.sglang_launcher.write_admin_key_config`` writes (planning
writes nothing).

GPUs (``run.device = cuda``): engine ``i`` gets its ``engine.sglang_tp_size`` GPUs of ``placement.engine_gpus``
through ``CUDA_VISIBLE_DEVICES`` (without a placement: GPUs ``i·tp .. i·tp + tp - 1``).

CPU (``run.device = cpu``; ``ops/setup.sh --sglang`` installs SGLang on the CPU torch): ``SGLANG_USE_CPU_ENGINE=1``
and ``OMP_NUM_THREADS = engine.threads`` (as rollout_server's engine has; SGLang would leave torch at all
cores, against the learner's on a small host), ``--device cpu``, ``--attention-backend torch_native``
(``intel_amx`` only where SGLang's AMX path really runs: AMX tiles and SGLang's compiled ``sgl_kernel``, which
vapo's pure-torch stand-in is not; SGLang's CPU default is ``intel_amx`` whatever the CPU),
``--disable-overlap-schedule``, ``--sleep-on-idle`` (without it the idle scheduler busy-polls a core) and
``--max-total-tokens`` (``max_total_tokens``: the actor's sequences in flight, not SGLang's sizing from host
memory). No CUDA variables.

Temporary files, ``private_tmp_env(dir)``: a server started here (the launcher's engines on its own host,
``ops.sglang_cpu.live``'s for the tests and the engine and weight sync benchmarks) gets ``TMPDIR`` of its own,
which whoever started it removes after it: SGLang names its ZeroMQ ipc sockets with
``NamedTemporaryFile(delete=False)`` (``PortArgs``, five a start) and never removes them, and the Prometheus
multiprocess directory ``--enable-metrics`` makes stays when the server is killed; with the system's TMPDIR every
start left them there. An engine on another host gets its directory on that host from the guard it runs under
(``common.remote``'s ``--private-tmp``), which removes it after the engine.

Radix (prefix) cache, ``engine.sglang_radix_cache``: SGLang flushes it after each weight update
(``flush_cache`` defaults to true) but only when no request is running (``Scheduler.flush_cache``); refused,
every later prompt whose prefix is cached (every prompt shares the task's template) reuses KV computed by
the old weights until a flush succeeds, which no staleness count sees. Where vapo's updates leave it:

- disk (``/update_weights_from_disk``), ``actors.weight_sync = wait``: SGLang's model-update lock is taken
  as a writer, so the update waits for every running ``/generate`` to end and holds new ones back: the
  engine is idle at the flush. Measured against the real server on this CPU: 6 of 6 updates posted under
  16 streams of n = 8 requests plus a 200-token one flushed (200, ~2.8 s each), and all 40 of a
  ``sglang-cpu.yaml`` run; ``weight_sync = abort`` aborts them first;
- distributed push, ``actors.push_pause = in_place``: the requests stay running through the update, so the
  flush is refused every time (SGLang answers 400 "Weights were updated, but the cache was not flushed
  because requests are still running or queued", measured alike) and the stale prefix stays for the run;
  ``retract`` (a paused engine's flush ignores its waiting queue), ``abort`` and ``none`` (SGLang drains
  before each bucket) leave it flushable.

``auto`` therefore passes ``--disable-radix-cache`` exactly for a distributed push paused ``in_place`` (the
GPU configs' default), the same rule on GPUs and CPU. Its cost, measured with ``ops/bench/sglang_radix.py``
(the default workload: 16 prompts in flight × 8 samples, ~12-token prompts, ~41-token responses; 96 prompts
a round, 6 paired rounds, 2 cores shared with other jobs, load 1.3-3.4): disabled/enabled rollout tokens/s
0.971 (median of the paired rounds, 0.85-1.01), per engine CPU-second 0.976; medians 1,613 against 1,653
tokens/s. Workloads whose prompts are long against their responses pay more: ``push_pause = retract``
keeps the cache correct under ``auto``, at the price of recomputing the retracted requests.
"""

from __future__ import annotations

import functools
import getpass
import json
import os
import sys
import tempfile
from pathlib import Path

from common.config import Config, ConfigError
from common.gpu_spec import parse_gpus

# Flags this module emits, as named in SGLang's ServerArgs (field name -> --kebab-case flag).
SGLANG_FLAGS_USED = (
    "--model-path", "--host", "--port", "--tp-size", "--mem-fraction-static", "--dtype",
    "--random-seed", "--weight-version", "--context-length", "--enable-metrics", "--config",
    "--disable-radix-cache", "--device", "--attention-backend", "--disable-overlap-schedule", "--sleep-on-idle",
    "--max-total-tokens",
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
    if e.sglang_max_total_tokens < 0:
        raise ConfigError("engine.sglang_max_total_tokens: must be >= 0 (0 = sized from the config)")
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
    if not radix_cache_kept(cfg):
        argv += ["--disable-radix-cache"]
    if cfg.run.device == "cpu":
        argv += cpu_args(cfg)
        # SGLang's CPU engine (CUDA_VISIBLE_DEVICES means nothing here), with engine.threads torch threads as
        # rollout_server has: SGLang leaves torch's thread count alone on CPU (all cores) unless it binds AMX threads.
        env = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": str(e.threads)}
    else:
        if e.sglang_max_total_tokens > 0:
            argv += ["--max-total-tokens", str(e.sglang_max_total_tokens)]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpu_ids(cfg, index))}
    if e.admin_api_key_file:
        argv += ["--config", str(admin_key_config_path(e.admin_api_key_file))]  # written by write_admin_key_config
    argv += list(e.sglang_extra_args)  # last: argparse keeps a repeated flag's last value, so these override
    if e.logprobs == "original":
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    return argv, env


def private_tmp_env(tmp_dir: Path | str) -> dict[str, str]:
    """The environment that keeps one SGLang server's temporary files in ``tmp_dir`` (module docstring). Torch's
    compile cache, whose default follows TMPDIR, stays where it was: a private one would be cold at every start."""
    env = {"TMPDIR": str(tmp_dir)}
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # no passwd entry (some containers): torch names it by uid then
            user = f"uid_{os.getuid()}"
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"torchinductor_{user}")
    return env


def radix_cache_kept(cfg: Config) -> bool:
    """Whether SGLang keeps its radix cache (``engine.sglang_radix_cache``; the module docstring says where a
    weight update leaves it stale: ``auto`` keeps it unless a distributed push pauses in place)."""
    mode = cfg.engine.sglang_radix_cache
    if mode not in ("auto", "enabled", "disabled"):  # not on/off: YAML reads those as booleans
        raise ConfigError(f"engine.sglang_radix_cache: {mode!r} is not one of auto, enabled, disabled")
    if mode != "auto":
        return mode == "enabled"
    # In place, requests keep running through the update and SGLang refuses the flush after it, every time.
    return not (cfg.learner.weight_transport == "distributed" and cfg.actors.push_pause == "in_place")


def cpu_args(cfg: Config) -> list[str]:
    """The flags of SGLang's CPU engine (``run.device = cpu``), each needed on a small shared CPU host."""
    return [
        "--device", "cpu",
        # SGLang's CPU default is intel_amx, which needs AMX tiles and its compiled sgl_kernel.
        "--attention-backend", "intel_amx" if amx_path_available() else "torch_native",
        # The overlap scheduler runs a thread that keeps a second core busy; these hosts have few.
        "--disable-overlap-schedule",
        # Without it the idle scheduler busy-polls one core at 100%, taking the learner's core.
        "--sleep-on-idle",
        # SGLang would size the pool from host memory (GBs); the rollouts of one actor need far less.
        "--max-total-tokens", str(max_total_tokens(cfg)),
    ]


@functools.lru_cache(maxsize=1)
def amx_path_available() -> bool:
    """SGLang's AMX attention can run here: the CPU has AMX tiles and the installed ``sgl_kernel`` is SGLang's
    compiled one (it registers ``convert_weight_packed``; vapo's pure-torch stub from ``ops/setup.sh --sglang``
    does not). The same test as SGLang's ``cpu_has_amx_support``; False wherever either part is missing."""
    try:
        import torch  # noqa: PLC0415 - heavy; planning an SGLang command line (launcher CLI) needs it only here

        if not torch.cpu._is_amx_tile_supported():
            return False
        import sgl_kernel  # noqa: F401, PLC0415 - optional (registers torch.ops.sgl_kernel.*), absent without SGLang

        return hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    except Exception:  # no torch, no sgl_kernel, or one that fails to load: the portable path
        return False


def max_total_tokens(cfg: Config) -> int:
    """``--max-total-tokens`` of a CPU engine: ``engine.sglang_max_total_tokens``, or (0) room for every sequence
    of the actor's prompts in flight at its estimated length, and at least one full context."""
    if cfg.engine.sglang_max_total_tokens > 0:
        return cfg.engine.sglang_max_total_tokens
    a = cfg.actors
    seq = cfg.placement.est_prompt_tokens + a.max_new_tokens
    context = cfg.engine.context_length or model_context_length(cfg.model.path)
    if context:
        seq = min(seq, context)
    return max(a.prompts_in_flight * a.group_size * seq, context or seq)


def model_context_length(model_path: str) -> int:
    """``max_position_embeddings`` of ``model_path/config.json`` (0 when it cannot be read: planning for a
    model that is not on this host)."""
    try:
        value = json.loads((Path(model_path) / "config.json").read_text()).get("max_position_embeddings", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


def admin_key_config_path(key_file: str) -> Path:
    """Where ``write_admin_key_config`` puts SGLang's ``--config`` file for ``key_file`` (planning writes nothing)."""
    return Path(f"{key_file}.sglang.yaml")
