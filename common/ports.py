"""A free local TCP port, for processes started on ports of their own (benchmarks, tests) so they never collide
with a run on the default ports."""

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
