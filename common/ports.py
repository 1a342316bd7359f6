"""A free local TCP port, for processes started on ports of their own (benchmarks, tests) so they never collide
with a run on the default ports."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
