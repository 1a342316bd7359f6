"""Weight watcher: learns about new policy versions from the learner and checks them before use.

Not a CLI; ``actors.worker`` runs one per worker:

- SUB on ``learner.publish_addr`` receives every ``WeightUpdate`` the learner publishes.
- REQ on ``learner.query_addr`` asks ``WeightQuery`` at start, after an engine restart and every
  ``actors.weight_poll_s`` (ZeroMQ PUB drops messages silently: before the SUB is connected, past the
  high-water mark, so the poll is what makes delivery certain). A REQ that gets no
  answer within ``actors.weight_query_timeout_s`` is closed and recreated (lazy pirate); no learner yet
  means no update (the worker serves the base model as version 0).
- ``verify_update`` recomputes ``common.checksum.weights_sha256`` of the update's directory and compares
  it with ``WeightUpdate.sha256`` before any engine is told to load it (a version the learner hashed while
  writing, with its sizes in ``STABLE``, is checked by file sizes instead of being read again); ``verify_tensors`` then checks
  that every tensor of the base model is there with its shape and that none holds NaN/Inf (engines load
  partial or non-finite weight sets without complaint).

Both sockets use the buffer's CurveZMQ client keys (``buffer.curve``) when configured, like the learner's
publisher.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import zmq
import zmq.asyncio
from safetensors import safe_open

from common import protocol
from common.checksum import checkpoint_shapes, weight_files, weights_sha256
from common.protocol import WeightUpdate
from common.security import ClientKeys, apply_client_curve

log = logging.getLogger("vapo.actors.weights")


def learner_checked(path: str | Path, sha256: str | None = None) -> dict[str, int] | None:
    """The file sizes the learner recorded in ``STABLE`` when it hashed the version while writing it and
    refused non-finite weights on the device (a durable version of the distributed push), if the marker says
    so (and names ``sha256`` when given); else None."""
    try:
        info = json.loads((Path(path) / "STABLE").read_text())
    except (OSError, ValueError):
        return None
    sizes = info.get("sizes") if isinstance(info, dict) else None
    if not isinstance(sizes, dict) or info.get("finite") is not True or (sha256 is not None and info.get("sha256") != sha256):
        return None
    return sizes


def _sizes_match(path: str | Path, sizes: dict[str, int]) -> str | None:
    found = {p.name: p.stat().st_size for p in weight_files(path)}
    if found != sizes:
        return f"files of {path} are {found}, the learner wrote {sizes}"
    return None


def verify_update(update: WeightUpdate) -> tuple[str, str] | None:
    """None when the update's files match its checksum, else ``(reason, message)``.

    A version whose ``STABLE`` marker carries the learner's own check (``learner_checked``, with the
    update's digest) is verified by its files' names and sizes, without reading it again: a partial copy or
    a missing shard fails, bit rot inside a file does not (the engine's own read then refuses non-finite
    values). Any other version is re-hashed whole.

    Reasons (``vapo_actor_weight_sync_failures{reason}``): ``missing`` (directory or files gone, e.g.
    pruned by the learner), ``checksum`` (digest or sizes differ: partial copy, corruption, tampering).
    """
    sizes = learner_checked(update.path, update.sha256)
    if sizes is not None:
        try:
            bad = _sizes_match(update.path, sizes)
        except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
            return "missing", str(e)
        return None if bad is None else ("checksum", bad)
    try:
        digest = weights_sha256(update.path)
    except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
        return "missing", str(e)
    except OSError as e:
        return "missing", f"cannot read {update.path}: {e}"
    if digest != update.sha256:
        return "checksum", f"sha256 of {update.path} is {digest}, WeightUpdate v{update.version} says {update.sha256}"
    return None


def verify_tensors(path: str | Path, expected: dict[str, tuple[int, ...]]) -> tuple[str, str] | None:
    """None when the weights at ``path`` hold every tensor of ``expected`` with its shape, all finite;
    else ``(reason, message)``. SGLang loads whatever names it finds and copies NaN without a word, so
    a partial or diverged export would be served silently; this is the check it does not do.

    Reasons: ``missing_tensors``, ``shape``, ``non_finite``, ``unreadable``.
    """
    import torch  # noqa: PLC0415 - torch only for a check that runs in a thread, not at the worker's start

    try:
        found = checkpoint_shapes(path)
    except Exception as e:  # truncated header, not safetensors, unreadable
        return "unreadable", f"cannot read the safetensors headers in {path}: {e}"
    missing = sorted(set(expected) - set(found))
    if missing:
        return "missing_tensors", f"{len(missing)} tensors of the model are not in {path}: {missing[:5]}"
    bad_shape = [n for n in expected if tuple(found[n]) != tuple(expected[n])]
    if bad_shape:
        n = bad_shape[0]
        return "shape", f"{n} has shape {found[n]} in {path}, the model's is {expected[n]}"
    sizes = learner_checked(path)
    if sizes is not None and _sizes_match(path, sizes) is None:
        return None  # the learner refused non-finite weights before they left its device
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    t = st.get_tensor(name)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        return "non_finite", f"{name} in {f} holds NaN or Inf values"
        except Exception as e:
            return "unreadable", f"cannot read {f}: {e}"
    return None


class WeightWatcher:
    """Tracks the newest ``WeightUpdate`` announced by the learner; ``changed`` is set when it moves."""

    def __init__(self, publish_addr: str, query_addr: str, *, curve: ClientKeys | None = None,
                 poll_s: float = 5.0, query_timeout_s: float = 2.0, ctx: zmq.asyncio.Context | None = None) -> None:
        self.publish_addr, self.query_addr = publish_addr, query_addr
        self.curve, self.poll_s, self.query_timeout_s = curve, poll_s, query_timeout_s
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.latest: WeightUpdate | None = None  # newest heard of
        self.changed = asyncio.Event()
        self.received_at: dict[int, float] = {}  # version -> when this worker first heard of it
        self._req: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()
        self.bad_frames = 0

    # ------------------------------------------------------------------ state

    def offer(self, update: WeightUpdate) -> bool:
        """Record an update if it is newer than what we know; returns True when it is."""
        if self.latest is not None and update.version <= self.latest.version:
            return False
        self.latest = update
        self.received_at.setdefault(update.version, time.time())
        self.changed.set()
        return True

    def nudge(self) -> None:
        """Wake ``next_change`` as if a version had been announced: an engine (re)started or re-synced may
        be behind the newest one, which the weight follower then loads."""
        self.changed.set()

    async def next_change(self) -> None:
        """Until a newer version is announced (or ``nudge``), then ready for the next one."""
        await self.changed.wait()
        self.changed.clear()

    # ------------------------------------------------------------------ sockets

    def _new_req(self) -> zmq.asyncio.Socket:
        s = self.ctx.socket(zmq.REQ)
        s.linger = 0
        apply_client_curve(s, self.curve)
        s.connect(self.query_addr)
        return s

    async def query(self, timeout_s: float | None = None) -> WeightUpdate | None:
        """Ask the learner for its latest WeightUpdate; None if it has none or does not answer in time."""
        timeout = self.query_timeout_s if timeout_s is None else timeout_s
        async with self._lock:
            if self._req is None:
                self._req = self._new_req()
            try:
                await self._req.send(protocol.encode(protocol.WeightQuery()))
                if not await self._req.poll(int(timeout * 1000)):
                    raise TimeoutError
                frame = await self._req.recv()
            except (TimeoutError, zmq.ZMQError):
                self._req.close(linger=0)  # a REQ that missed its reply is stuck in the send state
                self._req = None
                return None
        try:
            msg = protocol.decode(frame)
        except protocol.ProtocolError as e:
            self.bad_frames += 1
            log.warning("bad WeightQuery reply from %s: %s", self.query_addr, e)
            return None
        if isinstance(msg, WeightUpdate):
            self.offer(msg)
            return msg
        if isinstance(msg, protocol.ErrorReply) and msg.reason != "no_weights":
            log.warning("WeightQuery refused by %s: %s: %s", self.query_addr, msg.reason, msg.message)
        return None

    async def run(self) -> None:
        """Receive published updates and poll the query socket until cancelled."""
        self._sub = self.ctx.socket(zmq.SUB)
        self._sub.linger = 0
        apply_client_curve(self._sub, self.curve)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.publish_addr)
        next_poll = time.monotonic() + self.poll_s
        try:
            while True:
                wait_ms = max(0, int((next_poll - time.monotonic()) * 1000))
                if await self._sub.poll(wait_ms):
                    frame = await self._sub.recv()
                    try:
                        msg = protocol.decode(frame)
                    except protocol.ProtocolError as e:
                        self.bad_frames += 1
                        log.warning("bad frame on %s: %s", self.publish_addr, e)
                        continue
                    if isinstance(msg, WeightUpdate):
                        if self.offer(msg):
                            log.info("weights v%d announced (%s)", msg.version, msg.path)
                    continue
                next_poll = time.monotonic() + self.poll_s
                await self.query()
        finally:
            self._sub.close(linger=0)
            self._sub = None

    def close(self) -> None:
        for s in (self._req, self._sub):
            if s is not None:
                s.close(linger=0)
        self._req = self._sub = None
        if self._own_ctx:
            self.ctx.term()


__all__ = ["WeightWatcher", "verify_tensors", "verify_update"]
