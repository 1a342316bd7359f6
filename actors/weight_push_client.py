"""An engine's side of a distributed weight push, through SGLang's own API (``common.sglang_client``).

- ``join_group(client, body)``: ``/init_weights_update_group`` with the body the learner's
  ``WeightPusher.open_group`` made for this engine (it blocks until every member has joined).
- ``receive_push(client, buckets, version, pause)``: one version, bucket by bucket, each
  ``/update_weights_from_distributed`` posted while the learner broadcasts that bucket
  (``load_format="flattened_bucket"``; ``weight_version`` only with the last bucket, so the engine's
  version moves when the whole version is in; ``flush_cache`` only there too). ``pause``:
  ``in_place`` (running requests keep their KV cache and continue on the new weights; SGLang refuses to
  flush the cache while they exist, so no flush is asked for) or ``retract`` (they are re-queued and
  recomputed; the cache is flushed) around the buckets, then ``/continue_generation``; ``abort`` aborts
  them first; ``none`` pauses nothing (SGLang then loads each bucket only once the running requests end:
  the drain this path exists to avoid).

A failure (the engine or the group died, a bucket refused) raises ``SGLangError`` and leaves the engine
paused: its weights may be a mix of two versions (as SGLang warns), so the caller loads the version from
disk (``/update_weights_from_disk`` applies at once while paused) before it continues generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.protocol import PushDone, PushGroup, PushVersion
from common.sglang_client import SGLangClient, SGLangError

if TYPE_CHECKING:
    import zmq.asyncio

    from actors.engine_link import EngineLink
    from common.security import ClientKeys

PAUSE_MODES = ("in_place", "retract", "abort", "none")
REJOIN_BACKOFF_S = 10.0
MAX_REJOIN_BACKOFF_S = 600.0


@dataclass
class PushReport:
    """What one engine's side of a push took."""

    pause_s: float = 0.0  # generation paused: from /pause_generation sent to /continue_generation answered
    receive_s: float = 0.0  # the bucket posts, first sent to last answered


async def join_group(client: SGLangClient, body: dict[str, Any], timeout_s: float | None = None) -> str:
    return await client.init_weights_update_group(
        body["master_address"], body["master_port"], body["rank_offset"], body["world_size"],
        group_name=body.get("group_name", "weight_update_group"), backend=body.get("backend", "nccl"),
        timeout_s=timeout_s)


async def _post_buckets(client: SGLangClient, buckets: list[dict[str, Any]], version: int | str, flush: bool,
                        group_name: str, timeout_s: float | None) -> None:
    for i, b in enumerate(buckets):
        last = i == len(buckets) - 1
        await client.update_weights_from_distributed(
            b["names"], b["dtypes"], b["shapes"], weight_version=version if last else None,
            flush_cache=flush and last, load_format="flattened_bucket", group_name=group_name, timeout_s=timeout_s)


async def receive_push(client: SGLangClient, buckets: list[dict[str, Any]], version: int | str,
                       pause: str = "in_place", group_name: str = "weight_update_group",
                       timeout_s: float | None = None) -> PushReport:
    """Receive and load one pushed version (see the module docstring); SGLangError on any failure."""
    if pause not in PAUSE_MODES:
        raise ValueError(f"pause {pause!r}: one of {PAUSE_MODES}")
    rep = PushReport()
    t0 = time.perf_counter()
    if pause == "none":
        await _post_buckets(client, buckets, version, True, group_name, timeout_s)
        rep.receive_s = time.perf_counter() - t0
        return rep
    await client.pause_generation(pause)
    t1 = time.perf_counter()
    await _post_buckets(client, buckets, version, pause != "in_place", group_name, timeout_s)
    rep.receive_s = time.perf_counter() - t1
    await client.continue_generation()
    rep.pause_s = time.perf_counter() - t0
    return rep


class PushMember:
    """One worker's membership in the learner's weight push (``learner.weight_transport: distributed``).

    A DEALER to ``learner.push_addr`` (the buffer's CurveZMQ client keys when configured). Whenever the
    link's engine is up with a client not yet announced (start, restart), sends ``PushJoin``; on
    ``PushGroup`` posts ``/init_weights_update_group`` and answers ``PushDone(version=-1)``; on
    ``PushVersion`` takes the link's control lock (no disk sync or restart meanwhile), posts the buckets
    (``receive_push`` with ``actors.push_pause``), moves the link to the version and answers ``PushDone``.
    A push that fails leaves the engine's weights a mix: the link is told the engine is in trouble and
    stays on the old version number, so the version's durable copy is loaded from disk once announced
    (``EngineLink.sync_loop``), or the engine is restarted with it.
    """

    def __init__(self, link: EngineLink, push_addr: str, pause: str, curve: ClientKeys | None = None,
                 ctx: zmq.asyncio.Context | None = None, recover_timeout_s: float = 600.0) -> None:
        import zmq.asyncio

        self.recover_timeout_s = recover_timeout_s
        self.link, self.push_addr, self.pause, self.curve = link, push_addr, pause, curve
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.group: PushGroup | None = None  # the group this engine joined
        self._announced: SGLangClient | None = None  # the client a PushJoin was sent for
        self.starts = 0
        # After a failed join or push the learner drops this member; it joins again after a back-off that
        # doubles while joins keep failing (each failed join costs the learner its push_timeout_s).
        self._rejoin_at = 0.0
        self._backoff_s = REJOIN_BACKOFF_S
        self._failed_client: SGLangClient | None = None  # a restarted engine (a new client) joins at once
        self._group_client: SGLangClient | None = None  # the client whose engine joined self.group

    async def run(self) -> None:
        import zmq

        from common import protocol
        from common.security import apply_client_curve

        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        apply_client_curve(sock, self.curve)
        sock.connect(self.push_addr)
        try:
            while True:
                link = self.link
                if (link.client is not None and link.client is not self._announced and link.gate.is_set()
                        and (time.monotonic() >= self._rejoin_at or link.client is not self._failed_client)):
                    self._announced, self.group = link.client, None
                    self.starts += 1
                    await sock.send(protocol.encode(protocol.PushJoin(actor_id=link.actor_id, engine_start=self.starts)))
                if not await sock.poll(200):
                    continue
                try:
                    msg = protocol.decode(await sock.recv())
                except protocol.ProtocolError:
                    continue
                if isinstance(msg, protocol.PushGroup):
                    asyncio.ensure_future(self._join(sock, msg))
                elif isinstance(msg, protocol.PushVersion):
                    await sock.send(protocol.encode(await self._receive(msg)))
        finally:
            sock.close(linger=0)

    async def _join(self, sock: zmq.asyncio.Socket, msg: PushGroup) -> None:
        from common import protocol

        old, self.group = self.group, None
        client = self.link.client
        ok, text = True, ""
        if old is not None:  # a rebuilt group has a new name: free the old one's connections on the engine
            with contextlib.suppress(SGLangError):
                await client.destroy_weights_update_group(old.group_name)
        try:
            await join_group(client, msg.to_wire(), timeout_s=None)
            self.group, self._group_client = msg, client
        except SGLangError as e:
            ok, text = False, e.message[:2000]
        if ok:
            self._backoff_s = REJOIN_BACKOFF_S
        else:
            self._dropped(double=True)
        await sock.send(protocol.encode(protocol.PushDone(actor_id=self.link.actor_id, epoch=msg.epoch, version=-1,
                                                          ok=ok, pause_s=0.0, message=text)))

    async def _receive(self, msg: PushVersion) -> PushDone:
        from common import protocol

        link = self.link
        ok, text, rep = False, "", PushReport()
        async with link.control:  # restarts happen under it: the client is the engine's from here on
            if self.group is None or self.group.epoch != msg.epoch:
                text = f"not in group {msg.epoch}"
            elif link.client is not self._group_client:
                # Restarted since it joined: the new engine is in no group (it joins again, at once).
                text, self.group = "engine restarted since it joined", None
            else:
                try:
                    rep = await receive_push(link.client, self.group.buckets, msg.version, pause=self.pause,
                                             group_name=self.group.group_name)
                    ok = True
                except SGLangError as e:
                    text = e.message[:2000]
                    self.group = None
                    self._dropped(double=False)
                    link.gate.clear()  # paused on a possible mix of versions: nothing new goes to it
                    asyncio.ensure_future(self._recover(msg.version))
                if ok and msg.version > link.version:
                    link.pushed(msg.version, rep.pause_s)
                for phase, s in (("pause", rep.pause_s), ("load", rep.receive_s)):
                    link.metric("weight_sync_phase_seconds", phase=phase, transport="distributed").observe(s)
        return protocol.PushDone(actor_id=link.actor_id, epoch=msg.epoch, version=msg.version, ok=ok,
                                 pause_s=rep.pause_s, message=text)

    def _dropped(self, double: bool) -> None:
        """The learner leaves this member out after a failure: announce again (same engine) after a back-off."""
        self._announced, self._failed_client = None, self.link.client
        self._rejoin_at = time.monotonic() + self._backoff_s
        if double:
            self._backoff_s = min(self._backoff_s * 2, MAX_REJOIN_BACKOFF_S)

    async def _recover(self, version: int) -> None:
        """After a failed push: load ``version`` (or newer) from disk once its durable copy is announced,
        then continue generation. An engine that is gone is the supervisor's (it restarts it with the
        newest verified weights)."""
        link = self.link
        deadline = time.monotonic() + self.recover_timeout_s
        while (link.watcher.latest is None or link.watcher.latest.version < version) and time.monotonic() < deadline:
            await link.watcher.query()
            await asyncio.sleep(0.5)
        async with link.control:
            client = link.client
            with contextlib.suppress(SGLangError):
                await link._sync_locked(idle=True)
                await client.continue_generation()
            if link.version < version:
                link.report_trouble()  # still not on it: let the health path decide (restart reloads)
            link.gate.set()


__all__ = ["PAUSE_MODES", "PushMember", "PushReport", "join_group", "receive_push"]
