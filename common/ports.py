"""A free local TCP port, and every port of one launch on fresh ones, for processes started on ports of their
own (benchmarks, tests) so they never collide with a run on the default ports or with each other."""

from __future__ import annotations

import socket
import threading

_HANDED_OUT: set[int] = set()  # every port this process gave out: a port free now is not reserved
_LOCK = threading.Lock()


def free_port() -> int:
    """A port free now and never handed out before by this process. Callers draw several before any is bound
    (a run's ten, or two runs' at once), and the kernel may give the same free port twice: two runs of the chaos
    benchmark side by side did get one port twice (one run's engine took the other's learner /metrics port)."""
    with _LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


# Every socket and /metrics server one launch on one host binds, by config key (a test holds this to the config:
# a new listening key must be added here). Not here: placement.master_port, the rendezvous of a learner on several
# hosts (one host's ranks meet in a file), and learner.push_master_port, whose default 0 is a free port already.
LAUNCH_LISTENS = ("buffer.ingest_addr", "buffer.serve_addr", "learner.publish_addr", "learner.query_addr",
                  "learner.push_addr", "buffer.metrics_port", "learner.metrics_port", "actors.metrics_base_port",
                  "metrics.launcher_port", "engine.base_port")


def fresh_ports() -> dict[str, int]:
    """Each of ``LAUNCH_LISTENS`` on a port of its own (``free_port``): config key -> port."""
    return {key: free_port() for key in LAUNCH_LISTENS}


def as_overrides(ports: dict[str, int]) -> list[str]:
    """``key=value`` overrides for ``ports``: a ``*_addr`` key gets tcp://127.0.0.1:<port>."""
    return [f"{key}=tcp://127.0.0.1:{port}" if key.endswith("_addr") else f"{key}={port}" for key, port in ports.items()]
