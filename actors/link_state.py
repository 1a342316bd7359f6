"""What every part of a worker's engine link uses and none owns alone: the engine's client, the gate, the
control lock and the trouble flag.

``actors.engine_link.EngineLink`` builds one ``LinkState`` and passes it to each of its parts
(``actors.weight_follower.WeightFollower``, the supervisors and ``HealthWatch`` of
``actors.engine_supervisor``), which share it and nothing else: the served version belongs to the weight
follower, the engine's process and its start and restart counts to the supervisor, the probe hold to the
health watch. The client is replaced only through ``use_engine`` (a supervisor's (re)start); the gate, the
lock and the trouble flag are asyncio primitives every part may wait on, set or clear.

Not a CLI; used by ``actors.engine_link``.
"""

from __future__ import annotations

import asyncio
import contextlib

from actors.engine import Engine, engine_class
from common.config import Config


class LinkState:
    """The engine a link talks to and the primitives its parts coordinate with (see the module docstring).

    ``api_key``: the engine's admin API key (``actors.engine_address.engine_api_key``), sent with every
    request; ``generate_timeout_s``: the deadline of a ``/generate`` call (control calls get a probe's).
    """

    def __init__(self, cfg: Config, api_key: str, generate_timeout_s: float) -> None:
        self._engine_cfg = cfg.engine
        self.api_key = api_key
        self.generate_timeout_s = generate_timeout_s
        self._client: Engine | None = None
        self.gate = asyncio.Event()  # set while the engine accepts requests
        self.control = asyncio.Lock()  # weight syncs, pushes and engine restarts, one at a time
        self.trouble = asyncio.Event()  # a request failed or came back on older weights: check the engine

    @property
    def client(self) -> Engine | None:
        """The engine's client (None before the first start)."""
        return self._client

    @property
    def url(self) -> str | None:
        return self._client.base_url if self._client is not None else None

    async def use_engine(self, url: str) -> Engine:
        """Talk to the engine at ``url`` from now on (the previous client closed)."""
        if self._client is not None:
            await self._client.close()
        e = self._engine_cfg
        # Control requests (pause, continue, model info) get a probe's deadline.
        self._client = engine_class(e.kind, e.imitate_sglang)(
            url, timeout_s=self.generate_timeout_s, control_timeout_s=e.health_timeout_s,
            api_key=self.api_key or None)
        return self._client

    def report_trouble(self) -> None:
        """A request failed or came back on older weights: the supervisor checks the engine."""
        self.trouble.set()

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()


__all__ = ["LinkState"]
