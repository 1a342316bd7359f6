"""Weight push: the policy as HF safetensors in ``<run dir>/weights/v<N>/``, announced on ZeroMQ.

Not a CLI; ``learner.train`` calls ``publish_policy`` after every ``learner.weights_every`` updates.

- Atomic versions (PITFALLS Systems 3): ``save_pretrained`` into ``v<N>.tmp``, then a ``STABLE`` marker
  (JSON: version, sha256, files, created_at) is written inside it, then the directory is renamed to
  ``v<N>``. A directory named ``v<N>`` is therefore always complete; readers must still check ``STABLE``.
- Checksum: ``common.checksum.weights_sha256`` (names, sizes and bytes of the ``*.safetensors`` files),
  the same function the actors verify with.
- ``WeightUpdate`` goes out on a PUB socket (``learner.publish_addr``); a REP socket
  (``learner.query_addr``) answers ``WeightQuery`` with the latest ``WeightUpdate`` (or ``ErrorReply``
  ``no_weights``), so a late or reconnecting subscriber never depends on a PUB message it missed.
- The newest ``learner.keep_weights`` versions are kept; older ones are deleted after each publish.
- Both sockets bind to 127.0.0.1 by default; any other bind needs CurveZMQ keys
  (``buffer.curve.*``, ``common.security``).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from common import protocol
from common.checksum import weights_sha256

log = logging.getLogger(__name__)
STABLE = "STABLE"


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version}"


def read_stable(path: Path) -> protocol.WeightUpdate | None:  # type: ignore[name-defined]
    marker = path / STABLE
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
        return protocol.WeightUpdate(version=int(info["version"]), path=str(path.resolve()), sha256=info["sha256"],
                                     created_at=float(info["created_at"]))
    except (ValueError, KeyError, OSError):
        return None


def complete_versions(root: Path) -> list[int]:
    """Versions with a complete (STABLE) directory under ``root``, ascending."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit() and (p / STABLE).is_file():
                out.append(int(p.name[1:]))
    return sorted(out)


def latest_update(root: Path) -> protocol.WeightUpdate | None:  # type: ignore[name-defined]
    vs = complete_versions(root)
    return read_stable(version_dir(root, vs[-1])) if vs else None


def write_version(root: Path, version: int, module: Any, tokenizer: Any, state_dict: dict | None = None) -> protocol.WeightUpdate:  # type: ignore[name-defined]
    """Write ``module`` (an HF ``PreTrainedModel``) as version ``version``; returns its WeightUpdate."""
    final = version_dir(root, version)
    if final.exists():
        raise FileExistsError(f"weights {final} already exist; a version is never published twice")
    tmp = root / f"v{version}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    module.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    files = sorted(p.name for p in tmp.glob("*.safetensors"))
    digest = weights_sha256(tmp)
    created = time.time()
    (tmp / STABLE).write_text(json.dumps({"version": version, "sha256": digest, "files": files, "created_at": created}))
    tmp.rename(final)
    return protocol.WeightUpdate(version=version, path=str(final.resolve()), sha256=digest, created_at=created)


def prune(root: Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete versions and any leftover ``*.tmp`` directories."""
    removed = []
    vs = complete_versions(root)
    for v in vs[: max(0, len(vs) - max(keep, 1))]:
        shutil.rmtree(version_dir(root, v), ignore_errors=True)
        removed.append(v)
    for p in root.glob("v*.tmp") if root.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
    return removed


class WeightPublisher:
    """PUB socket for WeightUpdate + a REP thread answering WeightQuery with the latest one."""

    def __init__(self, publish_addr: str, query_addr: str, curve: Any = None,
                 latest: protocol.WeightUpdate | None = None) -> None:  # type: ignore[name-defined]
        self.ctx = zmq.Context.instance()
        self._curve = None
        self._latest = latest
        self._stop = threading.Event()
        addrs = [publish_addr, query_addr]
        try:
            from common import security
        except ImportError:  # the CurveZMQ helpers are optional for loopback binds
            security = None  # type: ignore[assignment]
        if security is not None:
            from common.config import CurveConfig

            self._curve = security.server_curve(self.ctx, addrs, curve if curve is not None else CurveConfig())
        elif any(not a.startswith(("tcp://127.", "tcp://localhost", "ipc://", "inproc://")) for a in addrs):
            raise RuntimeError("binding the weight publisher off loopback needs CurveZMQ (common.security)")
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 1000)
        if self._curve is not None:
            self._curve.apply(self.pub)
        self.pub.bind(publish_addr)
        self.publish_endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._rep_ready = threading.Event()
        self._rep_error: BaseException | None = None
        self.query_endpoint = ""
        self._thread = threading.Thread(target=self._serve, args=(query_addr,), name="weight-query", daemon=True)
        self._thread.start()
        self._rep_ready.wait(10)
        if self._rep_error is not None:
            self.close()
            raise self._rep_error

    def _serve(self, addr: str) -> None:
        rep = self.ctx.socket(zmq.REP)
        rep.setsockopt(zmq.LINGER, 0)
        try:
            if self._curve is not None:
                self._curve.apply(rep)
            rep.bind(addr)
            self.query_endpoint = rep.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException as e:  # surfaced to the constructor
            self._rep_error = e
            self._rep_ready.set()
            rep.close()
            return
        self._rep_ready.set()
        poller = zmq.Poller()
        poller.register(rep, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frame = rep.recv()
            try:
                protocol.decode_as(frame, protocol.WeightQuery)
                latest = self._latest
                out = protocol.encode(latest) if latest is not None else protocol.encode(
                    protocol.ErrorReply(reason="no_weights", message="no weight version published yet"))
            except protocol.ProtocolError as e:
                out = protocol.encode(protocol.ErrorReply(reason=e.reason, message=str(e)[:4000]))
            rep.send(out)
        rep.close()

    @property
    def latest(self) -> protocol.WeightUpdate | None:  # type: ignore[name-defined]
        return self._latest

    def publish(self, update: protocol.WeightUpdate) -> None:  # type: ignore[name-defined]
        self._latest = update
        self.pub.send(protocol.encode(update))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.pub.close()
        if self._curve is not None:
            self._curve.stop()


def publish_policy(engine: Any, tokenizer: Any, root: Path, version: int, keep: int,
                   publisher: WeightPublisher | None) -> protocol.WeightUpdate | None:  # type: ignore[name-defined]
    """Every rank calls this (ZeRO-3 gathers collectively); rank 0 writes, publishes and prunes."""
    from learner.engines import full_state_dict, rank

    state = full_state_dict(engine) if engine.zero_optimization_stage() == 3 else None
    if rank() != 0:
        return None
    update = write_version(root, version, engine.module, tokenizer, state_dict=state)
    if publisher is not None:
        publisher.publish(update)
    prune(root, keep)
    return update
