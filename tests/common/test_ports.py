"""common.ports: a free local TCP port is one that can be bound at once."""

from __future__ import annotations

import socket

from common.ports import free_port


def test_the_port_is_free_to_bind_on_the_loopback() -> None:
    port = free_port()
    assert 1024 <= port <= 65535  # the kernel's ephemeral range, never a privileged port
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port
