"""``python -m buffer [config.yaml] [key=value ...]``: run the durable buffer server.

Reads the ``buffer`` and ``learner`` sections of the one config tree (``common.config``); see
``buffer.server`` for the protocol and ``python -m common.config --help`` for every field.
Exit status: 0 after SIGTERM/SIGINT, 2 for a bad config or an insecure bind, 1 for other start failures.
"""

from __future__ import annotations

import logging
import sys

USAGE = """usage: python -m buffer [config.yaml] [key=value ...]

Runs the vapo buffer: actors push groups to buffer.ingest_addr (ZeroMQ ROUTER), the learner pulls
batches from buffer.serve_addr (REP); data lives in LMDB at buffer.path (default <run dir>/buffer).
Prometheus metrics on buffer.metrics_port. Non-loopback binds need CurveZMQ keys
(python -m buffer.keys DIR). Inspect the data with python -m buffer.inspect PATH (its
--set-learner-version N repairs a wrong learner version while the buffer is stopped).

examples:
  python -m buffer ops/configs/default.yaml
  python -m buffer buffer.path=/tmp/buf buffer.max_staleness=0 learner.batch_groups=8
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from common.config import ConfigError, load_config_args
    from common.security import SecurityError

    try:
        cfg = load_config_args(argv)
    except ConfigError as e:
        print(f"buffer: config error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.run.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from buffer.server import serve_forever

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
