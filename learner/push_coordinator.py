"""Rank 0's coordination of distributed weight pushes with the actors (``learner.weight_transport:
distributed``); ``learner.runner`` calls ``publish`` on every rank instead of the disk path.

Wire (ZeroMQ ROUTER at ``learner.push_addr``, each actor a DEALER; ``common.protocol``):

- ``PushJoin(actor_id, engine_start)``: an actor's engine is up (again); membership changes.
- ``PushGroup(epoch, master_address, master_port, rank_offset, world_size, group_name, backend, buckets)``:
  when membership changed, rank 0 opens group ``epoch`` (``WeightPusher.open_group``), tells each member
  its ``rank_offset`` (``1 + its place x engine.sglang_tp_size``) and the bucket plan, and joins (at most ``push_timeout_s``). Each
  member answers ``PushDone(version=-1)``. A failed join leaves this version to disk, and only the members
  that answered ok stay members (the others rejoin with their next ``PushJoin``).
- ``PushVersion(epoch, version)`` to every member: each pauses its engine, opens the engine's weight-update
  session (SGLang posts no receive outside one) and answers ``PushReady(ok)``. Rank 0 waits at most
  ``push_timeout_s`` for every member (less when one answers not ok), because a broadcast into a group
  with a member that will not receive (dead, refused, restarted) hangs until the group's timeout, and an
  NCCL one may not come back at all. All ready: ``PushGo(go=True)``, the buckets are gathered and
  broadcast (``WeightPusher.push``), each member posts them to its engine and answers ``PushDone(version,
  ok, pause_s)``. Otherwise: ``PushGo(go=False)`` to every member (they end the session and continue),
  not a byte is broadcast for that version (the buckets are still gathered on every rank for the disk
  copy), the group is closed, the members that refused (or, when none did, those silent at the deadline)
  are dropped and the group is rebuilt at the next publish with the others (and with whoever announces
  itself again). A member that does not answer
  ``PushDone`` ok by the next publish is dropped likewise; the learner never waits for a member past
  ``push_timeout_s`` per bucket.
- Before the first group, rank 0 checks that the bucket plan names exactly the tensors (and shapes) of
  the base checkpoint at ``model.path`` (``plan_mismatch``; SGLang would accept unknown names silently):
  if not, the distributed transport is refused for the run with that error and every version goes by disk.

Lifecycle: the constructor binds the socket (so a bad ``learner.push_addr`` fails at once, before value
pretraining); ``start()`` starts the socket's thread (nothing is received before it); ``close()`` stops it.

Disk: the pushed bytes are written as the durable version by ``DurableWriter`` in the background, and the
``WeightUpdate`` is published (PUB + REP, ``learner.publisher.WeightPublisher``) once that version is on
disk: actors whose engine missed the push (or restarted) load it from there. ``<weights root>/PUSHED``
records the newest version broadcast, written before its broadcast: a learner resumed behind it numbers
its next version past it (``learner.runner``), as it does past the newest version on disk.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import zmq

from common import protocol, security
from common.config import Config, CurveConfig
from common.metrics import Metrics
from learner.dist import rank
from learner.durable_push import DurableWriter
from learner.weight_push import PushResult, WeightPusher, bucket_plan, plan_mismatch
from learner.weights import prune

log = logging.getLogger(__name__)


PUSHED = "PUSHED"  # <weights root>/PUSHED: the newest version a push was started for


class Announcer(Protocol):
    """Where a complete durable version is announced (``learner.publisher.WeightPublisher``)."""

    def publish(self, update: protocol.WeightUpdate) -> None: ...


class Saveable(Protocol):
    """What is saved beside each durable version (a tokenizer, a model config)."""

    def save_pretrained(self, save_directory: Path, /) -> object: ...


def pushed_version(root: Path) -> int:
    """The newest version ever broadcast to the engines (-1 if none). The engines may serve it while its
    durable copy was never completed (a crash behind the push), so a resumed learner must number past it:
    a version is never reused."""
    try:
        return int(json.loads((root / PUSHED).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def _mark_pushed(root: Path, version: int) -> None:
    tmp = root / f".{PUSHED}.tmp"
    tmp.write_text(json.dumps({"version": version}))
    tmp.replace(root / PUSHED)


class PushCoordinator:
    """Membership and pushes (rank 0 holds the socket and the group; every rank calls ``publish``).

    ``publisher``: where each complete durable version is announced (None on ranks other than 0);
    ``tokenizer`` and ``model_config``: saved beside each durable version when given. Call ``start()``
    before the first ``publish``.
    """

    def __init__(self, cfg: Config, weights_root: Path, publisher: Announcer | None, metrics: Metrics | None = None,
                 tokenizer: Saveable | None = None, model_config: Saveable | None = None) -> None:
        learner_cfg = cfg.learner
        backend = learner_cfg.push_backend
        if backend == "auto":
            backend = "nccl" if cfg.run.device == "cuda" else "gloo"
        self.pusher = WeightPusher(learner_cfg.bucket_bytes, backend, learner_cfg.push_master_address,
                                   learner_cfg.push_master_port, learner_cfg.push_timeout_s)
        self.timeout_s = learner_cfg.push_timeout_s
        self.model_path = cfg.model.path
        self.refused: str | None = None  # why the distributed transport is off for this run (plan_mismatch)
        self.root = weights_root
        self.ranks_per_engine = cfg.engine.sglang_tp_size if cfg.engine.kind == "sglang" else 1
        self.keep = learner_cfg.keep_weights
        self.metrics = metrics
        self.publisher = publisher
        self._pub_lock = threading.Lock()
        self.members: dict[int, tuple[bytes, int]] = {}  # actor_id -> (ZeroMQ identity, engine_start)
        self.group_members: list[int] = []
        self.group_entries: dict[int, tuple[bytes, int]] = {}  # each group member's membership when it joined
        self.epoch = 0
        self.dirty = False
        self.done: dict[tuple[int, int], dict[int, protocol.PushDone]] = {}  # (epoch, version) -> actor -> report
        self.ready: dict[tuple[int, int], dict[int, protocol.PushReady]] = {}  # (epoch, version) -> actor -> ready
        self._cv = threading.Condition()
        self._out: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self._stop = threading.Event()
        self.writer: DurableWriter | None = None
        self.last: PushResult | None = None
        self._settled_upto = -1  # the newest version whose push is over (broadcast done, failed or no group)
        self._thread: threading.Thread | None = None  # the socket's, once started (rank 0)
        if rank() != 0:
            return

        def extra(tmp: Path) -> None:
            if model_config is not None:
                model_config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)

        self.writer = DurableWriter(weights_root, self._announce, extra, recycle=self.pusher.recycle)
        # A context of its own: one ZAP authenticator per context, and the weight publisher's has one.
        self.ctx = ctx = zmq.Context()
        self._curve: security.ServerCurve | None = None
        try:
            self._curve = security.server_curve(ctx, [learner_cfg.push_addr],
                                                cfg.buffer.curve if cfg.buffer.curve else CurveConfig())
            self.sock = ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                self._curve.apply(self.sock)
            self.sock.bind(learner_cfg.push_addr)
        except BaseException:
            # A context left with an open socket (and CurveZMQ's authenticator thread) blocks whoever collects
            # it later, forever: a failed bind releases everything here.
            if getattr(self, "sock", None) is not None:
                self.sock.close(linger=0)
            if self._curve is not None:
                self._curve.stop()
            ctx.term()
            raise
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        """Start receiving the members' messages (rank 0's socket thread); nothing to start on other ranks."""
        if rank() != 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._serve, name="weight-push", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ socket thread

    def _serve(self) -> None:
        while not self._stop.is_set():
            while not self._out.empty():
                ident, frame = self._out.get_nowait()
                self.sock.send_multipart([ident, frame])
            if not self.sock.poll(20):
                continue
            ident, frame = self.sock.recv_multipart()[:2]
            try:
                msg = protocol.decode(frame)
            except protocol.ProtocolError as e:
                log.warning("bad frame on the push socket: %s", e)
                continue
            with self._cv:
                if isinstance(msg, protocol.PushJoin):
                    if self.members.get(msg.actor_id) != (ident, msg.engine_start):
                        self.members[msg.actor_id] = (ident, msg.engine_start)
                        self.dirty = True
                        log.info("actor %d joins the weight push (engine start %d)", msg.actor_id, msg.engine_start)
                elif isinstance(msg, protocol.PushDone):
                    self.done.setdefault((msg.epoch, msg.version), {})[msg.actor_id] = msg
                    self._cv.notify_all()
                elif isinstance(msg, protocol.PushReady):
                    self.ready.setdefault((msg.epoch, msg.version), {})[msg.actor_id] = msg
                    self._cv.notify_all()
        self._release()

    def _release(self) -> None:
        """Rank 0's socket, CurveZMQ authenticator and context: by the socket's thread as it ends, or by
        ``close`` when it never started."""
        self.sock.close(linger=0)
        if self._curve is not None:
            self._curve.stop()
        self.ctx.term()

    def _send(self, actor_id: int, msg: protocol.Message) -> None:
        entry = self.members.get(actor_id) or self.group_entries.get(actor_id)
        if entry is not None:  # a member dropped meanwhile, never in a group: nobody to tell
            self._out.put((entry[0], protocol.encode(msg)))

    def _wait_done(self, key: tuple[int, int], ids: list[int], timeout_s: float) -> dict[int, protocol.PushDone]:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while len(self.done.get(key, {})) < len(ids) and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            return dict(self.done.get(key, {}))

    def _wait_ready(self, key: tuple[int, int], ids: list[int], timeout_s: float) -> dict[int, protocol.PushReady]:
        """Each member's PushReady for ``key``, once all answered, one answered not ok, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s

        def got() -> dict[int, protocol.PushReady]:
            return {a: r for a, r in self.ready.get(key, {}).items() if a in ids}

        with self._cv:
            while not (len(got()) == len(ids) or any(not r.ok for r in got().values())):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return got()

    # ------------------------------------------------------------------ group

    def _rebuild(self) -> bool:
        """A new group of the current members (rank 0); False when it could not be built."""
        with self._cv:
            ids = sorted(self.members)
            snapshot = dict(self.members)
            self.dirty = False
        self.pusher.close()
        self.group_members = []
        if not ids:
            return False
        self.epoch += 1
        t0 = time.perf_counter()
        try:
            bodies = self.pusher.open_group(len(ids), self.ranks_per_engine)
        except Exception as e:  # e.g. the fixed store port still held: this version goes by disk, training goes on
            log.warning("weight-update group %d: cannot listen for it (%s); this version goes by disk",
                        self.epoch, str(e)[:300])
            with self._cv:
                self.dirty = True  # tried again at the next publish
            return False
        plan = [b.body() for b in self.pusher.plan or []]
        for aid, body in zip(ids, bodies, strict=True):
            self._send(aid, protocol.PushGroup(epoch=self.epoch, buckets=plan, **body))
        try:
            self.pusher.join()
        except Exception as e:
            log.warning("weight-update group %d: not every engine joined within %.0f s (%s); this version goes by disk",
                        self.epoch, self.timeout_s, str(e)[:300])
        replies = self._wait_done((self.epoch, -1), ids, 5.0 if self.pusher.group is not None else 0.5)
        with self._cv:  # members that did not join are dropped until they join again (a newer join stays)
            for aid in ids:
                if not (aid in replies and replies[aid].ok) and self.members.get(aid) == snapshot[aid]:
                    self.members.pop(aid, None)
                    self.dirty = True
        self._observe("group", time.perf_counter() - t0)
        if self.pusher.group is None:
            return False
        self.group_members = ids
        self.group_entries = {aid: snapshot[aid] for aid in ids}
        if self.metrics is not None:
            self.metrics.weight_push_members.set(len(ids))
        log.info("weight-update group %d: learner + %d engines (actors %s)", self.epoch, len(ids), ids)
        return True

    # ------------------------------------------------------------------ publish

    def publish(self, model: Any, version: int) -> PushResult | None:
        """Push ``version`` to the group and queue its durable write (every rank calls this; collective
        under ZeRO-3). Returns rank 0's PushResult."""
        if self.pusher.plan is None:
            self.pusher.plan = bucket_plan(model, self.pusher.bucket_bytes)
            if rank() == 0:
                self.refused = plan_mismatch(self.pusher.plan, self.model_path)
                if self.refused is not None:
                    log.error("the distributed weight push is off for this run, every version goes by disk: %s",
                              self.refused)
        grouped = False
        if rank() == 0:
            self.pusher.settle()  # the previous push's final bucket: its outcome decides the membership below
            self._drop_silent()
            if self.refused is None and (self.dirty or (self.pusher.group is None and self.members)):
                self._rebuild()
            grouped = self.pusher.group is not None
            if grouped:
                self._confirm(version)  # not every member ready: the group is closed, nothing is broadcast
        held: list[Any] = []
        res = self.pusher.push(model, version, sink=lambda meta, buf: held.append((meta, buf)) if rank() == 0 else None,
                               on_settled=lambda r: self._settled(r, grouped))
        if res is None:
            return None
        assert self.writer is not None
        self.writer.submit(version, held)
        self.last = res
        return res

    def _confirm(self, version: int) -> bool:
        """Rank 0, before a byte of ``version`` is broadcast: PushVersion to every member, then PushGo to
        each: go when all answered PushReady ok within ``push_timeout_s``. Otherwise the group is closed
        (this version goes by disk), and the members that refused (or, when none did, those still silent at
        the deadline) are dropped until they announce themselves again. True when the broadcast may go."""
        ids, key = list(self.group_members), (self.epoch, version)
        with self._cv:  # answers for versions before this one are of no use any more
            for old in [k for k in (*self.ready, *self.done) if k[1] < version - 1]:
                self.ready.pop(old, None)
                self.done.pop(old, None)
        for aid in ids:
            self._send(aid, protocol.PushVersion(epoch=self.epoch, version=version))
        t0 = time.perf_counter()
        got = self._wait_ready(key, ids, self.timeout_s)
        # Dropped: the members that refused; when none did, the ones still silent at the deadline. A member
        # that had not answered yet when another refused is only told to go on.
        bad = {aid: r.message for aid, r in got.items() if not r.ok}
        if not bad:
            bad = {aid: "no PushReady" for aid in ids if aid not in got}
        if not bad:
            _mark_pushed(self.root, version)  # before any engine can hold it
        for aid in ids:
            self._send(aid, protocol.PushGo(epoch=self.epoch, version=version, go=not bad))
        if not bad:
            return True
        log.warning("weight push v%d: actors %s not ready after %.1f s (%s); nothing is broadcast, this version goes "
                    "by disk and the group is rebuilt without them", version, sorted(bad), time.perf_counter() - t0,
                    "; ".join(f"{aid}: {why[:200]}" for aid, why in sorted(bad.items())))
        with self._cv:
            for aid in bad:  # a member that joined again since (its engine restarted) stays: it is the new engine
                if self.members.get(aid) == self.group_entries.get(aid):
                    self.members.pop(aid, None)
            self.dirty = True
        self.pusher.close()
        self.group_members = []
        if self.metrics is not None:
            self.metrics.weight_push_members.set(0)
        return False

    def _settled(self, res: PushResult, grouped: bool) -> None:
        """A push's outcome, once its final broadcast is over (the learner's thread, or the pusher's tail)."""
        outcome = "no_group" if not grouped else "ok" if res.broadcast else "failed"
        with self._cv:
            self.dirty = self.dirty or outcome == "failed"
            self._settled_upto = max(self._settled_upto, res.version)
            self._cv.notify_all()
        if self.metrics is not None:
            self.metrics.weight_pushes.labels(outcome=outcome).inc()
        for phase, s in res.seconds.items():
            self._observe(phase, s)

    def _drop_silent(self) -> None:
        """Members that did not report the previous push ok (dead, hung or failed) leave the group."""
        if self.last is None or not self.group_members:
            return
        # The broadcast is over, so each live member is loading or has loaded; a short grace for its report.
        got = self._wait_done((self.epoch, self.last.version), self.group_members, min(5.0, self.timeout_s))
        bad = [aid for aid in self.group_members if not (aid in got and got[aid].ok)]
        if bad:
            log.warning("actors %s did not report weights v%d loaded; rebuilding the group without them until they rejoin",
                        bad, self.last.version)
            with self._cv:
                for aid in bad:
                    # A member that joined again since (its engine restarted) stays: it is the new engine.
                    if self.members.get(aid) == self.group_entries.get(aid):
                        self.members.pop(aid, None)
                self.dirty = True

    def _observe(self, phase: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.weight_sync_phase_seconds.labels(phase=phase, transport="distributed").observe(seconds)

    def _announce(self, update: protocol.WeightUpdate) -> None:
        """Writer thread: a durable version is complete; announce it (once its push is over) and prune old ones.

        The announcement waits for the push: the final bucket's broadcast completes in the background, and a
        small model's disk copy can be written sooner; announced first, it would have the group's engines
        load the version from disk as well as receive it (at scale the disk is the slower path anyway)."""
        with self._cv:
            self._cv.wait_for(lambda: self._settled_upto >= update.version, timeout=self.timeout_s + 5.0)
        if self.writer is not None and update.version in self.writer.seconds:
            self._observe("disk_write", self.writer.seconds[update.version])
        if self.publisher is not None:
            with self._pub_lock:
                self.publisher.publish(update)
        if self.metrics is not None:
            self.metrics.weights_published.inc()
        prune(Path(update.path).parent, self.keep)

    def close(self, timeout_s: float = 600.0) -> None:
        if self.writer is not None:
            self.writer.close(timeout_s)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        elif rank() == 0 and not self.sock.closed:
            self._release()
        self.pusher.close()


__all__ = ["PushCoordinator"]
