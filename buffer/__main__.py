"""``python -m buffer [config.yaml] [key=value ...]``: run the durable buffer server.

Reads the ``buffer`` and ``learner`` sections of the one config tree (``common.config``); see
``buffer.server`` for the protocol and ``python -m common.config --help`` for every field.
Exit status: 0 after SIGTERM/SIGINT, 2 for a bad config or an insecure bind, 1 for other start failures.
"""

from __future__ import annotations

import sys

from buffer.server import serve_forever
from common.allocator import keep_freed_memory
from common.cli import config_from_argv, setup_logging
from common.security import SecurityError

USAGE = """usage: python -m buffer [config.yaml] [key=value ...]

Runs the vapo buffer: actors push groups to buffer.ingest_addr (ZeroMQ ROUTER), the learner pulls
batches from buffer.serve_addr (ROUTER, REQ/REP envelope); data lives in LMDB at buffer.path (default <run dir>/buffer).
Prometheus metrics on buffer.metrics_port. Clients authenticate with the run's CurveZMQ keys
(buffer.curve.keys_dir: the launcher writes <run dir>/keys; python -m buffer.keys DIR); without keys only
a local bind is allowed and any local process may connect. Inspect the data with python -m buffer.inspect PATH (its
--set-learner-version N repairs a wrong learner version while the buffer is stopped).

examples:
  python -m buffer ops/configs/default.yaml
  python -m buffer buffer.path=/tmp/buf buffer.max_staleness=0 learner.batch_groups=8
"""


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv("buffer", USAGE, argv)
    if isinstance(cfg, int):
        return cfg  # --help (0) or a config error, already explained (2)
    setup_logging(cfg.run.log_level)
    keep_freed_memory()  # every group's frames are allocated and freed here

    try:
        return serve_forever(cfg)
    except SecurityError as e:
        print(f"buffer: refusing to start: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"buffer: cannot start: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
