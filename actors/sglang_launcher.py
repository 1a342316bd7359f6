"""Command lines of the real SGLang servers used on GPUs (``engine.kind = sglang``), one per actor.

    python -m actors.sglang_launcher [config.yaml] [key=value ...]   # print the commands (shell-quoted)

The command lines are ``common.sglang_args.sglang_command(cfg, i)`` for ``i < actors.num_actors`` (what the
placement plan lists); ``ops/launch.py`` starts and supervises the processes; actor ``i`` then talks to
``http://engine.host:engine.base_port + i``. Engine ``i`` gets its
``engine.sglang_tp_size`` GPUs of ``placement.engine_gpus`` through ``CUDA_VISIBLE_DEVICES`` (without a
placement: GPUs ``i·tp .. i·tp + tp - 1``). Every flag is a real ``sglang.launch_server`` argument (checked against
``python/sglang/srt/server_args.py``; the list is ``SGLANG_FLAGS_USED``). ``engine.logprobs = original``
sets ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so SGLang returns log_softmax(logits) before temperature, what the
learner recomputes. ``--enable-metrics`` is always passed: without it SGLang has no ``/metrics``. A
non-loopback ``engine.host`` needs ``engine.bind_protection`` (config validation refuses it otherwise).
The server starts at ``--weight-version 0``; the actor loads the newest published
weights through ``/update_weights_from_disk`` before it generates.

With ``engine.admin_api_key_file``, SGLang's control endpoints (weight updates, pause, continue, abort,
flush) require that key (``--admin-api-key``), which the actors send: it reaches SGLang through
``--config <key file>.sglang.yaml`` (written 0600 next to the key file), never on the command line, which
every user of the machine can read.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from common.cli import config_from_argv
from common.config import ConfigError
from common.sglang_args import admin_key_config_path, sglang_command


def write_admin_key_config(key_file: str) -> Path:
    """``<key_file>.sglang.yaml`` (0600): ``admin-api-key: <the key>``, for SGLang's ``--config``; written by
    whoever starts the engines (the launcher, this module's CLI), not by planning (``--dry-run`` writes nothing)."""
    try:
        key = Path(key_file).read_text().strip()
    except OSError as ex:
        raise ConfigError(f"engine.admin_api_key_file: cannot read {key_file}: {ex}") from ex
    if not key:
        raise ConfigError(f"engine.admin_api_key_file: {key_file} is empty")
    if key.startswith("-"):  # SGLang turns --config into command-line arguments: argparse reads it as a flag
        raise ConfigError(f"engine.admin_api_key_file: the key in {key_file} starts with '-', which SGLang's "
                          "--config passes on as a flag, not a value; use a key that does not (e.g. `openssl rand -hex 32`)")
    out = admin_key_config_path(key_file)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"admin-api-key: {json.dumps(key)}\n")  # a JSON string is a YAML string
    return out


USAGE = (f"{__doc__}\nusage: python -m actors.sglang_launcher [config.yaml] [key=value ...]\n"
         "Prints one shell command per engine (environment prefix included); ops/launch.sh runs them.")


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv("actors.sglang_launcher", USAGE, argv)
    if isinstance(cfg, int):
        return cfg
    try:
        if cfg.engine.admin_api_key_file:
            write_admin_key_config(cfg.engine.admin_api_key_file)
        for i in range(cfg.actors.num_actors):
            cmd, env = sglang_command(cfg, i)
            print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
    except ConfigError as e:  # engine.* values only sglang_command checks
        print(f"actors.sglang_launcher: config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
