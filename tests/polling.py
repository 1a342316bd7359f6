"""Polling with a deadline: the one way tests wait for another process (never a bare sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(cond: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition", interval_s: float = 0.02) -> Any:
    """Call ``cond()`` until it returns something truthy and return that; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)  # the poll interval, not synchronisation: cond() decides
