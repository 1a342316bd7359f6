"""How often a group and a positive are encoded and decoded on their way from an actor to the learner.

The buffer server runs in a thread of this process (the real ``BufferServer`` with real LMDB and real
ZeroMQ sockets), so one set of counters sees every hop. Each hop runs alone (the next starts only after the
previous one was answered), and calls made on the server's threads are told apart from the client's (the
main thread), which is how a count is attributed to a hop.

Counted: ``protocol.encode`` / ``protocol.decode`` (every module that imported them), ``Sample.to_wire`` /
``from_wire`` and ``SampleGroup.to_wire`` / ``from_wire``, and the samples ``protocol.samples_from_wire`` builds
(``Sample.decoded``: a message's samples are decoded there, in one pass when they have the usual shape).

Per group (G samples): the actor encodes it once (1 SampleGroup.to_wire, G Sample.to_wire); the buffer decodes
it once at ingest and serves the stored frame as it is; the learner client decodes the BatchReply once (1
SampleGroup.from_wire; ``protocol.decode`` runs twice there: on the reply, and on the group frame nested in it,
which is still one parse of the group's bytes).

Per positive: before, Sample.to_wire ran 3 times (actor, buffer ingest storing it, buffer serve re-encoding
the reply) and Sample.from_wire 3 times (buffer ingest, buffer serve decoding the stored frame, learner
client). Now 1 to_wire (actor) and 2 decodes (buffer ingest, learner client): the buffer stores the bytes
it received and splices them into the reply.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from buffer.client import AsyncGroupSender, BatchClient
from buffer.server import BufferServer
from common import protocol
from common.config import load_config
from common.metrics import Metrics
from tests.buffer.fixtures import make_group


class Counts:
    """Calls per (side, name); side is ``client`` on the main thread and ``buffer`` on any other."""

    def __init__(self) -> None:
        self.c: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*a: Any, **kw: Any) -> Any:
            side = "client" if threading.current_thread() is threading.main_thread() else "buffer"
            with self._lock:
                self.c[(side, name)] += 1
            return fn(*a, **kw)

        return counted

    def wrap_items(self, name: str, fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """Like ``wrap``, counting the items of the list ``fn`` is given rather than the calls."""
        def counted(items: list[Any]) -> Any:
            side = "client" if threading.current_thread() is threading.main_thread() else "buffer"
            with self._lock:
                self.c[(side, name)] += len(items)
            return fn(items)

        return counted

    def take(self) -> dict[str, int]:
        """Counts since the last call, as ``side.name``."""
        with self._lock:
            out = {f"{s}.{n}": v for (s, n), v in sorted(self.c.items())}
            self.c.clear()
        return out


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    k = Counts()
    for name in ("encode", "decode"):
        orig = getattr(protocol, name)
        wrapped = k.wrap(name, orig)
        for mod in list(sys.modules.values()):  # `from common.protocol import decode` made private bindings
            if mod is not None and getattr(mod, name, None) is orig and (
                    mod.__name__.startswith(("buffer", "common.protocol"))):
                monkeypatch.setattr(mod, name, wrapped)
    for cls in (protocol.Sample, protocol.SampleGroup):
        to_wire = cls.to_wire
        monkeypatch.setattr(cls, "to_wire", k.wrap(f"{cls.__name__}.to_wire", to_wire))
        from_wire = cls.__dict__["from_wire"].__func__
        monkeypatch.setattr(cls, "from_wire", classmethod(k.wrap(f"{cls.__name__}.from_wire", from_wire)))
    monkeypatch.setattr(protocol, "samples_from_wire", k.wrap_items("Sample.decoded", protocol.samples_from_wire))
    return k


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BufferServer]:
    sock = tmp_path / "s"
    sock.mkdir()
    cfg = load_config(None, [
        f"buffer.path={tmp_path / 'lmdb'}", f"buffer.ingest_addr=ipc://{sock}/i", f"buffer.serve_addr=ipc://{sock}/s",
        "buffer.metrics_port=0", "metrics.prometheus=false", "learner.batch_groups=1", "buffer.positive_reward=1.0",
        "buffer.vocab_size=1000", f"model.path={tmp_path / 'no-model'}",
    ])
    srv = BufferServer(cfg, Metrics("buffer"))
    t = threading.Thread(target=srv.run, name="buffer-server", daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(timeout=30)
    assert not t.is_alive()


def _send(addr: str, group: protocol.SampleGroup) -> None:
    async def main() -> None:
        async with AsyncGroupSender(addr, 0) as s:
            assert (await s.send(group, timeout_s=10)).committed

    asyncio.run(main())


def test_one_group_is_encoded_once_and_decoded_once_per_hop(server: BufferServer, counts: Counts) -> None:
    # Rewards all 0: no positive is harvested, so only the group's own path is counted. 4 samples.
    group = make_group("g", rewards=[0.0] * 4, seed=1)
    counts.take()
    _send(server.cfg.buffer.ingest_addr, group)
    ingest = counts.take()
    with BatchClient(server.cfg.buffer.serve_addr) as c:
        reply = c.get_batch(0, 1, 10)
    serve = counts.take()
    assert reply.groups == [group]
    # Actor: one encode of the group (its 4 samples packed inside it).
    assert ingest["client.encode"] == 1
    assert ingest["client.SampleGroup.to_wire"] == 1 and ingest["client.Sample.to_wire"] == 4
    # Buffer at ingest: one decode (validation) of the group, and one encode: its IngestAck.
    assert ingest["buffer.decode"] == 1  # the group frame
    assert ingest["buffer.SampleGroup.from_wire"] == 1 and ingest["buffer.Sample.decoded"] == 4
    assert ingest["buffer.encode"] == 1  # the IngestAck
    assert "buffer.SampleGroup.to_wire" not in ingest and "buffer.Sample.to_wire" not in ingest
    # Buffer at serve: decodes the BatchRequest only; the stored group frame is spliced into the reply.
    assert serve.get("buffer.SampleGroup.from_wire", 0) == 0 and serve.get("buffer.Sample.decoded", 0) == 0
    assert serve.get("buffer.Sample.from_wire", 0) == 0
    assert serve.get("buffer.SampleGroup.to_wire", 0) == 0 and serve.get("buffer.Sample.to_wire", 0) == 0
    assert serve["buffer.decode"] == 1  # the BatchRequest
    # Learner client: the reply frame and the group frame nested in it, each parsed once.
    assert serve["client.decode"] == 2
    assert serve["client.SampleGroup.from_wire"] == 1 and serve["client.Sample.decoded"] == 4


def test_a_positive_is_copied_not_reencoded_on_its_way_to_the_learner(server: BufferServer, counts: Counts) -> None:
    # One positive (reward 1) among 4 samples; the other three are not harvested.
    group = make_group("p", rewards=[0.0, 1.0, 0.0, 0.0], seed=2)
    counts.take()
    _send(server.cfg.buffer.ingest_addr, group)
    ingest = counts.take()
    with BatchClient(server.cfg.buffer.serve_addr) as c:
        samples = c.positives(5)
    serve = counts.take()
    assert samples == [group.samples[1]]
    # Ingest: the group decoded once (its 4 samples with it); the positive is stored as its exact bytes.
    assert ingest["buffer.Sample.decoded"] == 4
    assert ingest.get("buffer.Sample.to_wire", 0) == 0
    # Serve: the stored frame goes into the PositivesReply as it is.
    assert serve.get("buffer.Sample.decoded", 0) == 0 and serve.get("buffer.Sample.from_wire", 0) == 0
    assert serve.get("buffer.Sample.to_wire", 0) == 0
    assert serve["buffer.decode"] == 1  # the PositivesRequest
    assert serve["client.decode"] == 1 and serve["client.Sample.decoded"] == 1
