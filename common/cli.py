"""What every vapo command line shares: ``[config.yaml] [key=value ...]`` parsing and log setup.

    cfg = config_from_argv("buffer", USAGE, argv)
    if isinstance(cfg, int):
        return cfg          # --help printed (0) or a config error explained on stderr (2)
    setup_logging(cfg.run.log_level)

One place decides the exit codes (0 help, 2 bad config) and the log line format, so that every process of
a run reads alike in the launcher's logs.
"""

from __future__ import annotations

import logging
import sys

from common.config import Config, ConfigError, load_config_args


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


def setup_logging(level: str, name: str = "%(name)s") -> None:
    """One format for every process: ``time name LEVEL message`` on stderr."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
