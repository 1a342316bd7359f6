"""What an engine link's parts share, as a protocol: the state ``actors.engine_link.EngineLink`` holds.

The supervisor (``actors.engine_supervisor``) and the weight follower (``actors.weight_follower``) read and
move that state; they name it through ``LinkState`` rather than through ``EngineLink``, which builds them, so
that the link's modules import in one direction (engine_link -> its parts -> this module) and draw no circle.
``LinkCounts`` lives here for the same reason: every part counts into it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

from actors.engine import Engine
from actors.weight_sync import WeightWatcher
from common.config import Config


@dataclasses.dataclass
class LinkCounts:
    """What the link did, for the worker's ``ACTOR DONE`` line."""

    engine_restarts: int = 0
    weight_syncs: int = 0  # from disk and by distributed push
    weight_sync_failures: int = 0
    weight_pushes: int = 0
    push_pause_ms: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name; the push counters only once a push arrived (as they always appeared)."""
        out = dataclasses.asdict(self)
        if not self.weight_pushes:
            del out["weight_pushes"], out["push_pause_ms"]
        return out


class LinkState(Protocol):
    """The link's shared state and the moves every part may make on it (``EngineLink`` implements it)."""

    cfg: Config
    actor_id: int
    watcher: WeightWatcher
    generate_timeout_s: float
    counts: LinkCounts
    version: int
    model_path: str
    client: Engine | None
    gate: asyncio.Event  # set while the engine accepts requests
    control: asyncio.Lock  # weight syncs and engine restarts, one at a time
    trouble: asyncio.Event  # a request failed: the engine may be gone
    engine_starts: int
    api_key: str

    @property
    def url(self) -> str | None: ...

    @property
    def pushing_now(self) -> bool: ...

    def metric(self, name: str, **labels: str) -> Any: ...

    def stopping(self) -> bool: ...

    def notify_change(self) -> None: ...

    def set_version(self, version: int, path: str) -> None: ...

    def count_restart(self) -> int: ...

    async def use_engine(self, url: str) -> Engine: ...

    async def wait_changed(self, timeout_s: float) -> None: ...
