"""common.ports: a free local TCP port is one that can be bound at once, and never handed out twice."""

from __future__ import annotations

import socket

import pytest

from common import ports
from common.config import describe, load_config
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


def test_a_launch_on_fresh_ports_moves_every_address_and_port_the_config_has_for_one_host() -> None:
    """Every config key a launch binds on one host (an address or a port with a default to collide on) is in
    LAUNCH_LISTENS, so a run on fresh ports shares none with a run on the defaults (learner.push_master_port's
    default 0 is a free port already)."""
    several_hosts = {"placement.master_port"}  # torch.distributed's rendezvous on host 0; one host's ranks meet in a file
    binds = {key for key, _tp, default, _doc in describe()
             if key.endswith(("_addr", "_port")) and default and key not in several_hosts}
    assert binds == set(ports.LAUNCH_LISTENS)
    fresh = ports.fresh_ports()
    assert len(set(fresh.values())) == len(fresh) == len(ports.LAUNCH_LISTENS)
    overrides = ports.as_overrides({"buffer.ingest_addr": 41000, "buffer.metrics_port": 41001})
    assert overrides == ["buffer.ingest_addr=tcp://127.0.0.1:41000", "buffer.metrics_port=41001"]
    assert load_config(None, ports.as_overrides(fresh)).buffer.metrics_port == fresh["buffer.metrics_port"]
