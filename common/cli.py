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

# config_from_argv lives beside the config it reads (``python -m common.config`` uses it too, and common.config
# importing this module back would be a cycle); every other command takes it from here.
from common.config import config_from_argv

__all__ = ["config_from_argv", "setup_logging"]


def setup_logging(level: str, name: str = "%(name)s") -> None:
    """One format for every process: ``time name LEVEL message`` on stderr."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
