"""learner.push_coordinator: a durable version is announced only once its push is over, so the group's
engines receive it by broadcast rather than also loading it from disk; a plan whose names are not the base
checkpoint's is never pushed; every member must confirm it is paused with its engine's weight-update
session open before rank 0 broadcasts a byte, else the version goes by disk and the group is rebuilt
without the members that were not ready (real PushMembers over workers' EngineLinks to real rollout_server
engines, real ZeroMQ sockets, a real gloo group)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from actors.engine_link import EngineLink
from actors.weight_push_client import PushMember
from common import protocol
from common.config import Config, load_config
from common.modeling import load_model
from common.ports import free_port
from learner.push_coordinator import PushCoordinator
from learner.weight_push import PushResult, bucket_plan, plan_mismatch
from tests.actors.push_fixtures import (
    bump,
    connected_link,
    distributed_updates,
    engine_digest,
    member_config,
    perturbed,
    served_digest,
    until,
)
from tests.actors.servers import start_rollout_server
from tests.polling import wait_for


class _Publisher:
    def __init__(self) -> None:
        self.versions: list[int] = []
        self.published = threading.Event()

    def publish(self, update: protocol.WeightUpdate) -> None:
        self.versions.append(update.version)
        self.published.set()


def test_a_written_version_is_announced_after_its_push_settles(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
                             "learner.weight_transport=distributed", f"learner.push_addr=tcp://127.0.0.1:{free_port()}",
                             "learner.push_timeout_s=30"])
    pub = _Publisher()
    coord = PushCoordinator(cfg, tmp_path / "weights", pub)
    coord.start()
    try:
        update = protocol.WeightUpdate(version=1, path=str(tmp_path / "weights" / "v1"), sha256="0" * 64,
                                       created_at=time.time())
        # The writer thread finished v1 while v1's final bucket is still on the wire: it must wait.
        writer = threading.Thread(target=coord._announce, args=(update,))
        writer.start()
        assert not pub.published.wait(0.5) and writer.is_alive()
        coord._settled(PushResult(version=0, broadcast=True), grouped=True)  # an older push: still waits
        assert not pub.published.wait(0.2)
        coord._settled(PushResult(version=1, broadcast=False, error="engine gone"), grouped=True)
        assert pub.published.wait(10) and pub.versions == [1]  # a failed push announces too: disk is the fallback
        writer.join(10)
        assert not writer.is_alive() and coord.dirty  # and the failure rebuilds the group at the next publish
        # A version whose push is already over is announced at once.
        coord._announce(protocol.WeightUpdate(version=1, path=update.path, sha256="0" * 64, created_at=time.time()))
        assert pub.versions == [1, 1]
    finally:
        coord.close()


# --------------------------------------------------------------------------- names checked before any push


def _renamed_base(model_dir: Path, out: Path) -> str:
    """A copy of the base checkpoint with one tensor under another name; returns the old name."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    f = next(out.glob("*.safetensors"))
    tensors = load_file(str(f))
    name = next(n for n in sorted(tensors) if n.endswith("norm.weight"))
    tensors[name.replace("norm.weight", "norm.renamed")] = tensors.pop(name)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return name


def test_plan_names_that_differ_from_the_base_checkpoint_refuse_the_push(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SGLang accepts unknown names without a word, so a learner whose tensors are not the served
    checkpoint's is never pushed: no group is built, the error names the first differing names, and the
    durable version still serves the engines from disk."""
    model = load_model(tiny_model_dir)
    assert plan_mismatch(bucket_plan(model, 4096), tiny_model_dir) is None  # the learner's own base matches
    missing = _renamed_base(tiny_model_dir, tmp_path / "base")
    cfg = _cfg(tmp_path, tmp_path / "base", "learner.push_timeout_s=5")
    pub = _Publisher()
    coord = PushCoordinator(cfg, tmp_path / "weights", pub)
    coord.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    try:
        dealer.connect(coord.endpoint)
        dealer.send(protocol.encode(protocol.PushJoin(actor_id=0, engine_start=1)))
        wait_for(lambda: 0 in coord.members, 20, "the member's join")
        res = coord.publish(model, 1)
        assert res is not None and not res.broadcast
        assert coord.refused is not None and missing in coord.refused and "norm.renamed" in coord.refused
        assert coord.epoch == 0 and not dealer.poll(1000)  # no PushGroup, no PushVersion: nothing was offered
        assert coord.writer is not None and coord.writer.wait(60) and pub.published.wait(30)
        assert pub.versions == [1]  # the disk path serves it
    finally:
        dealer.close()
        ctx.term()
        coord.close()


# --------------------------------------------------------------------------- every member ready before a byte


def _cfg(tmp_path: Path, model_path: Path, *extra: str, urls: list[str] | None = None) -> Config:
    return member_config(model_path, urls or ["http://127.0.0.1:9"], f"run.root={tmp_path}", "run.name=r",
                         f"learner.push_addr=tcp://127.0.0.1:{free_port()}", *extra)


class _Relay(_Publisher):
    """The learner's publisher, delivering each durable version to the members' watchers (their event loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, links: list[EngineLink]) -> None:
        super().__init__()
        self.loop, self.links = loop, links

    def publish(self, update: protocol.WeightUpdate) -> None:
        super().publish(update)
        for link in self.links:
            self.loop.call_soon_threadsafe(link.watcher.offer, update)


async def _group(tmp_path: Path, model_dir: Path, n: int, push_timeout_s: float) -> tuple[
        PushCoordinator, list[EngineLink], dict[int, asyncio.Task[None]], list[Any], zmq.asyncio.Context]:
    """``n`` rollout_server engines, their workers' links and members, the learner's coordinator; every
    member joined."""
    engines = [start_rollout_server(model_dir, tmp_path) for _ in range(n)]
    cfg = _cfg(tmp_path, model_dir, f"learner.push_timeout_s={push_timeout_s}", urls=[e.url for e in engines])
    links = [await connected_link(cfg, i) for i in range(n)]
    (tmp_path / "weights").mkdir()  # the runner makes it before the first publish
    coord = PushCoordinator(cfg, tmp_path / "weights", _Relay(asyncio.get_running_loop(), links))
    coord.start()
    ctx = zmq.asyncio.Context()
    tasks = {i: asyncio.ensure_future(PushMember(link, coord.endpoint, "in_place", ctx=ctx).run())
             for i, link in enumerate(links)}
    for i, link in enumerate(links):
        tasks[n + i] = asyncio.ensure_future(link.sync_loop())  # durable versions load from disk
    await until(lambda: len(coord.members) == n, 60, "every member's join")
    return coord, links, tasks, engines, ctx


async def _close(coord: PushCoordinator, links: list[EngineLink], tasks: dict[int, asyncio.Task[None]],
                 engines: list[Any], ctx: zmq.asyncio.Context) -> None:
    for t in tasks.values():
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t
    await asyncio.to_thread(coord.close, 60)
    ctx.term()
    for link in links:
        await link.close()
    for e in engines:
        e.stop()


def test_a_dead_member_stops_the_broadcast_before_a_byte_and_the_group_is_rebuilt_without_it(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """All ready: the version is broadcast. One engine dead (its member cannot pause it and says so): not a
    byte of that version is broadcast (the other engine receives nothing, and is generating again at once),
    it reaches the live engine from disk, the dead member is dropped and the next version is pushed to the
    group rebuilt without it."""
    model = perturbed(tiny_model_dir, 1e-3)

    async def main() -> None:
        coord, links, tasks, engines, ctx = await _group(tmp_path, tiny_model_dir, 2, 30.0)
        a = links[0].client
        assert a is not None
        try:
            res = await asyncio.to_thread(coord.publish, model, 1)
            await asyncio.to_thread(coord.pusher.settle)
            assert res is not None and res.broadcast, res
            await until(lambda: [link.version for link in links] == [1, 1], 60, "v1 on both engines")
            assert links[0].counts.weight_pushes == links[1].counts.weight_pushes == 1
            assert await engine_digest(a) == (served_digest(model, tmp_path / "disk", 1), "1")
            received = await distributed_updates(a)
            engines[1].proc.kill()
            engines[1].proc.wait()
            bump(model, 1e-3)
            t0 = time.monotonic()
            res = await asyncio.to_thread(coord.publish, model, 2)
            assert res is not None and not res.broadcast and res.seconds["broadcast"] == 0.0
            assert time.monotonic() - t0 < 30  # the refusal ended the wait, not push_timeout_s
            assert 1 not in coord.members and coord.pusher.group is None
            tasks.pop(1).cancel()  # the dead engine's worker is gone (its supervisor would close its gate)
            assert await distributed_updates(a) == received  # not a bucket of v2 reached the live engine
            await until(lambda: links[0].version == 2, 60, "v2 from disk on the live engine")
            assert links[0].counts.weight_pushes == 1
            assert await engine_digest(a) == (served_digest(model, tmp_path / "disk", 2), "2")
            bump(model, 1e-3)
            res = await asyncio.to_thread(coord.publish, model, 3)
            await asyncio.to_thread(coord.pusher.settle)
            assert res is not None and res.broadcast and coord.group_members == [0] and coord.epoch == 2
            await until(lambda: links[0].version == 3, 60, "v3 by push")
            assert links[0].counts.weight_pushes == 2
            assert await engine_digest(a) == (served_digest(model, tmp_path / "disk", 3), "3")
        finally:
            await _close(coord, links, tasks, engines, ctx)

    asyncio.run(main())


def test_a_silent_member_stops_the_broadcast_after_the_bounded_wait(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A member that never answers PushReady (its worker hung): rank 0 waits push_timeout_s, broadcasts
    nothing, tells the ready member to go on (it ends its session and generates again), drops the silent
    one and rebuilds the group without it."""
    model = perturbed(tiny_model_dir, 1e-3)

    async def main() -> None:
        coord, links, tasks, engines, ctx = await _group(tmp_path, tiny_model_dir, 2, 8.0)
        a = links[0].client
        assert a is not None
        try:
            res = await asyncio.to_thread(coord.publish, model, 1)
            await asyncio.to_thread(coord.pusher.settle)
            assert res is not None and res.broadcast, res
            await until(lambda: [link.version for link in links] == [1, 1], 60, "v1 on both engines")
            task = tasks.pop(1)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            received = await distributed_updates(a)
            bump(model, 1e-3)
            t0 = time.monotonic()
            res = await asyncio.to_thread(coord.publish, model, 2)
            waited = time.monotonic() - t0
            assert res is not None and not res.broadcast and 8.0 <= waited < 8.0 + 20, waited
            assert 1 not in coord.members and coord.group_members == [] and coord.pusher.group is None
            assert await distributed_updates(a) == received
            _, info, _ = await a._request("GET", "get_server_info", timeout_s=30)
            assert info["paused"] is None  # the ready member was told to go on
            await until(lambda: links[0].version == 2, 60, "v2 from disk")
            bump(model, 1e-3)
            res = await asyncio.to_thread(coord.publish, model, 3)
            await asyncio.to_thread(coord.pusher.settle)
            assert res is not None and res.broadcast and coord.group_members == [0]
            await until(lambda: links[0].version == 3, 60, "v3 by push")
            assert links[0].counts.weight_pushes == 2 and links[1].counts.weight_pushes == 1  # nothing more by push
        finally:
            await _close(coord, links, tasks, engines, ctx)

    asyncio.run(main())


def test_a_group_that_cannot_listen_sends_that_version_by_disk_and_is_tried_again(tiny_model_dir: Path,
                                                                                   tmp_path: Path) -> None:
    """A fixed store port still held (another process, a store not yet released) must not end the learner:
    no group this time, the version goes by disk, and the next publish tries again."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
                                 "learner.weight_transport=distributed", f"learner.push_addr=tcp://127.0.0.1:{free_port()}",
                                 "learner.push_timeout_s=5", "learner.push_master_address=127.0.0.1",
                                 f"learner.push_master_port={port}"])
        coord = PushCoordinator(cfg, tmp_path / "weights", _Publisher())
        coord.start()
        try:
            coord.members[0] = (b"actor-0", 1)
            assert coord._rebuild() is False
            assert coord.pusher.group is None and coord.dirty and coord.group_members == []
        finally:
            coord.close()


def test_a_push_address_that_cannot_be_bound_leaves_no_context_behind(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A bind that fails (an address of another host) must release the socket, CurveZMQ's authenticator thread
    and the context: left to the garbage collector, that context's teardown blocks forever, in whatever code
    happens to collect it next."""
    import gc

    import zmq

    from common.security import generate_run_keys

    keys = generate_run_keys(tmp_path / "keys")
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
                             "learner.weight_transport=distributed", "learner.push_addr=tcp://198.51.100.7:5559",
                             f"buffer.curve.keys_dir={keys}"])
    from zmq.auth.thread import AuthenticationThread

    def authenticators() -> int:
        return sum(isinstance(t, AuthenticationThread) and t.is_alive() for t in threading.enumerate())

    before = authenticators()
    with pytest.raises(zmq.ZMQError) as failed:
        PushCoordinator(cfg, tmp_path / "weights", _Publisher())
    del failed  # its traceback holds the half-built coordinator
    assert authenticators() == before  # CurveZMQ's thread stopped with the failed bind
    collected = threading.Thread(target=gc.collect, daemon=True)
    collected.start()
    collected.join(20)
    assert not collected.is_alive(), "collecting the failed coordinator's context blocked"
