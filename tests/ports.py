"""Free TCP ports for tests that start real servers, so they never collide with a run on the default ports."""

from __future__ import annotations

from common.ports import as_overrides, free_port, fresh_ports

__all__ = ["free_port", "port_overrides"]  # free_port: for the tests that import it from here


def port_overrides() -> list[str]:
    """Config overrides that give every socket and /metrics server of one launch its own fresh port."""
    return as_overrides(fresh_ports())
