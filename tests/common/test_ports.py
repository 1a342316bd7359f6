"""common.ports: a free local TCP port is one that can be bound at once, and never handed out twice."""

from __future__ import annotations

import socket

import pytest

from common import ports
from common.ports import free_port


def test_the_port_is_free_to_bind_on_the_loopback() -> None:
    port = free_port()
    assert 1024 <= port <= 65535  # the kernel's ephemeral range, never a privileged port
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port


def test_a_port_the_kernel_gives_twice_is_handed_out_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several ports are drawn before any is bound (a run's ten, two runs at once), and the kernel may give
    the same free port again: the second draw goes on to a port not given before."""
    given = iter([41000, 41001, 41000, 41001, 41002])

    class Socket:  # the kernel's choice, scripted: bind(("127.0.0.1", 0)) answers these ports in turn
        def __enter__(self) -> Socket:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def bind(self, _addr: object) -> None:
            self.port = next(given)

        def getsockname(self) -> tuple[str, int]:
            return "127.0.0.1", self.port
    monkeypatch.setattr(ports.socket, "socket", Socket)
    monkeypatch.setattr(ports, "_HANDED_OUT", set())
    assert [free_port(), free_port(), free_port()] == [41000, 41001, 41002]
