"""The buffer's writer thread: LMDB commits of one batch of groups overlap validation of the next.

Not a CLI; started by ``buffer.server``, fed and collected by ``buffer.ingest``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import NamedTuple

import zmq

from buffer.store import BufferStore, GroupRecord, StorageError

log = logging.getLogger("vapo.buffer")

# A validated group waiting for its commit, and who to acknowledge: (ROUTER identity, group_id, actor_id).
Pending = tuple[GroupRecord, tuple[bytes, str, int]]


class Done(NamedTuple):
    """A finished commit: the batch, the store counters before it, ``(outcome, duplicate)`` per group or the
    storage error (exactly one of ``results`` and ``err`` is set)."""

    batch: list[Pending]
    before: dict[str, int]
    results: list[tuple[str, bool]] | None
    err: StorageError | None


class Writer:
    """One thread that runs ``store.put_groups`` for a batch while the main thread validates the next.

    LMDB commits (page writes + fsync) release the GIL, so decoding overlaps the disk. The main thread
    touches LMDB only while the writer is idle (``Ingest.settle``: ``wait`` then ``collect``); sockets stay on the main
    thread, which is woken through an inproc PAIR socket.
    """

    def __init__(self, store: BufferStore, ctx: zmq.Context) -> None:
        self.store = store
        self.ctx = ctx
        self.addr = f"inproc://buffer-writer-{id(self)}"
        self.notify = ctx.socket(zmq.PAIR)
        self.notify.bind(self.addr)
        self.batch: list[Pending] = []
        self.busy = False
        self._jobs: queue.Queue[tuple[list[Pending], dict[str, int]] | None] = queue.Queue(maxsize=1)
        self._done: deque[Done] = deque()
        self._thread = threading.Thread(target=self._run, name="buffer-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        out = self.ctx.socket(zmq.PAIR)
        out.connect(self.addr)
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                batch, before = job
                results: list[tuple[str, bool]] | None = None
                err: StorageError | None = None
                try:
                    results = self.store.put_groups([r for r, _ in batch])
                except StorageError as e:
                    err = e
                except Exception as e:  # never let the writer die silently: report it as a storage error
                    log.exception("writer failed")
                    err = StorageError("internal", repr(e))
                self._done.append(Done(batch, before, results, err))
                out.send(b"")
        finally:
            out.close(linger=0)

    def submit(self, batch: list[Pending], before: dict[str, int]) -> None:
        assert not self.busy
        self.busy = True
        self.batch = batch
        self._jobs.put((batch, before))

    @property
    def finished(self) -> bool:
        """The commit in progress is done and waits for ``collect`` (a read of the thread's result queue: no
        syscall, cheap enough for every group the main thread reads)."""
        return bool(self._done)

    def wait(self) -> None:
        self.notify.poll()  # blocks until the commit in progress is done

    def collect(self) -> list[Done]:
        """The batches whose transaction finished since the last call (never blocks)."""
        out = []
        while self.notify.poll(0):
            self.notify.recv()
            out.append(self._done.popleft())
            self.busy = False
            self.batch = []
        return out

    def stop(self) -> None:
        if self._thread.is_alive():
            if self.busy:
                self.wait()
                self.collect()
            self._jobs.put(None)
            self._thread.join(timeout=30)
