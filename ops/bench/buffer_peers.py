"""The buffer benchmark's other processes (``ops/bench/buffer.py`` starts them; not a CLI): the senders, an
actor's ``AsyncGroupSender`` each, whose refused sends end the benchmark instead of being re-sent, and the
transport sink, which acknowledges a group as soon as it read its group_id.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import msgpack
import numpy as np
import zmq

from buffer.client import AsyncGroupSender
from common.allocator import keep_freed_memory
from common.config import CurveConfig
from common.protocol import IngestAck, Sample, SampleGroup, encode
from common.security import client_curve_keys, server_curve

SEND_TIMEOUT_S = 300.0  # one group unacknowledged this long (re-sent every 30 s meanwhile) ends the benchmark


class BenchError(RuntimeError):
    """Why the benchmark gives no figure (a refused send, a sender gone, the wall-time cap): exit 1."""


def build_groups(n: int, seed: int, prefix: str, g: int, tokens: int) -> list[Any]:
    """``n`` groups of ``g`` samples (100-token prompts, ``tokens``-token responses, reward 0), seeded."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        samples = [
            Sample(prompt_ids=rng.integers(0, 150000, 100, dtype=np.int32),
                   output_ids=rng.integers(0, 150000, tokens, dtype=np.int32),
                   output_logprobs=-rng.random(tokens, dtype=np.float32),
                   reward=0.0, finish_reason="stop", weight_version=0, response_length=tokens)
            for _ in range(g)
        ]
        out.append(SampleGroup(group_id=f"{prefix}-{i}", prompt_id=f"{prefix}-p{i}", task="bench", actor_id=seed,
                               samples=samples, created_at=time.time()))
    return out


def client_keys(keys_dir: str, role: str) -> Any:
    """The CurveZMQ client keys of ``role`` from the run's ``keys_dir`` (none for plain sockets: ``""``)."""
    return client_curve_keys(CurveConfig(keys_dir=keys_dir), role) if keys_dir else None


class AckWatch(dict[str, "asyncio.Future[IngestAck]"]):
    """``AsyncGroupSender``'s table of awaited acks (``_acks``), watched: the first ack with ``committed=False``
    is kept in ``error`` and sets ``refused``. ``send`` re-sends a ``full``/``storage`` refusal until its timeout;
    nothing drains the buffer during a call, so here that would be a loop without end."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = asyncio.Event()
        self.error = ""

    def __setitem__(self, gid: str, fut: asyncio.Future[IngestAck]) -> None:
        fut.add_done_callback(self._seen)
        super().__setitem__(gid, fut)

    def _seen(self, fut: asyncio.Future[IngestAck]) -> None:
        if not fut.cancelled() and fut.exception() is None and not fut.result().committed and not self.error:
            self.error = fut.result().error or "committed=False"
            self.refused.set()


async def send_all(s: AsyncGroupSender, watch: AckWatch, groups: list[Any], window: int) -> list[IngestAck]:
    """``groups`` sent with at most ``window`` unacknowledged (as an actor's loops), all committed, or
    ``BenchError`` at the first refusal."""
    slots = asyncio.Semaphore(window)

    async def one(group: Any) -> IngestAck:
        async with slots:
            return await s.send(group, timeout_s=SEND_TIMEOUT_S)

    sends = asyncio.gather(*(one(x) for x in groups))
    refused = asyncio.ensure_future(watch.refused.wait())
    racers: set[asyncio.Future[Any]] = {sends, refused}  # results of two types: Future is invariant in them
    await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
    refused.cancel()
    if watch.error:
        sends.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sends
        raise BenchError(f"the buffer refused a group: {watch.error}")
    acks = sends.result()
    if bad := [a for a in acks if not a.committed or a.duplicate]:
        raise BenchError(f"{len(bad)} groups not stored once: {bad[0]}")
    return acks


def sender_main(addrs: dict[str, str], actor: int, n: int, g: int, tokens: int, window: int, commands: Any,
                barrier: Any, results: Any, keys_dir: str = "") -> None:
    """One sender process: builds its ``n`` groups once, then per command (a tag, one of ``addrs``' names and
    a count) sends that many of them, cycling, to that address under fresh group_ids ``{tag}-{actor}-{i}`` (the
    buffer stores a group_id once) and reports (t0, t1, groups, resent), or ``("error", why)`` and sends no more."""

    keep_freed_memory()  # as an actor process does
    pool = build_groups(n, actor, f"s{actor}", g, tokens)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        senders = {name: AsyncGroupSender(addr, actor, ack_timeout_s=30.0, curve=client_keys(keys_dir, "actor"))
                   for name, addr in addrs.items()}
        watches = {name: AckWatch() for name in addrs}
        for name, s in senders.items():
            s._acks = watches[name]  # the one place a refused ack shows before ``send`` re-sends the group
        failed = False
        try:
            while (command := await loop.run_in_executor(None, commands.get)) is not None:
                if failed:
                    continue  # the benchmark is ending: wait for the main process's stop
                tag, target, count = command
                s = senders[target]
                groups = [dataclasses.replace(pool[i % n], group_id=f"{tag}-{actor}-{i}") for i in range(count)]
                resent = s.resent
                await loop.run_in_executor(None, barrier.wait)  # every sender starts together
                t0 = time.perf_counter()
                try:
                    await send_all(s, watches[target], groups, window)
                except Exception as e:  # a refusal, a timeout, an ErrorReply: the main process ends the run
                    results.put(("error", f"sender {actor} to the {target}: {e}"))
                    failed = True
                    continue
                results.put((t0, time.perf_counter(), len(groups), s.resent - resent))
        finally:
            for s in senders.values():
                await s.close()

    asyncio.run(main())


def sink_main(addr: str, keys_dir: str, ready: Any) -> None:
    """The transport's limit: a ROUTER with the buffer's CurveZMQ setup that answers each group with a committed
    ``IngestAck`` as soon as it read the group_id (the frame's first field), validating and storing nothing.
    What the senders reach into it bounds what any buffer can reach on these cores (runs until killed)."""
    keep_freed_memory()  # as the buffer does
    ctx = zmq.Context()
    curve = server_curve(ctx, [addr], CurveConfig(keys_dir=keys_dir))
    sock = ctx.socket(zmq.ROUTER)
    curve.apply(sock)
    sock.bind(addr)
    ready.set()
    while True:
        ident, frame = sock.recv_multipart(copy=False)
        head = msgpack.Unpacker(raw=False)
        head.feed(frame.buffer[:1024])  # group_id is the first field and at most 512 characters
        head.read_map_header()
        head.unpack()
        ack = IngestAck(group_id=head.unpack(), committed=True, duplicate=False, error="")
        sock.send_multipart([ident.bytes, encode(ack)])
