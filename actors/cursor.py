"""A worker's durable prompt cursor: which of its shard's prompts are done, surviving restarts.

Actor ``a`` of ``N`` owns the training prompts ``index = a + k·N`` for ``k = 0, 1, 2, ...``. Many prompts are
in flight at once and they finish out of order, so the cursor is a low watermark plus the set of finished
``k`` above it: ``{"next": w, "done": [k > w, ...]}``, rewritten atomically (tmp + fsync + rename) after
each buffer ack. A restarted worker issues ``w, w+1, ...`` again, skipping ``done``: nothing acknowledged
is skipped-over and nothing unacknowledged is lost. A prompt that was acknowledged by the buffer but not
yet recorded here is generated again under the same deterministic ``group_id`` (``group_id_for``) and the
buffer stores it once, so no prompt is ever duplicated in the buffer.

Not a CLI; used by ``actors.worker``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class CursorError(RuntimeError):
    """The cursor file is unreadable or belongs to another sharding."""


def group_id_for(actor_id: int, index: int) -> str:
    """Deterministic group id of a prompt: re-sends and re-generations after a restart share it."""
    return f"a{actor_id}-p{index}"


class PromptCursor:
    def __init__(self, path: str | Path, actor_id: int, num_actors: int, limit: int = 0) -> None:
        if not 0 <= actor_id < num_actors:
            raise ValueError(f"actor_id {actor_id} outside [0, {num_actors})")
        self.path = Path(path)
        self.actor_id, self.num_actors, self.limit = actor_id, num_actors, limit
        self.next = 0  # every k below this is done
        self.done: set[int] = set()  # done ks >= next
        self._issued: set[int] = set()  # in flight now
        self._issue_from = 0
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            state = json.loads(self.path.read_text())
            nxt, done = int(state["next"]), {int(k) for k in state["done"]}
            actor, n = int(state["actor_id"]), int(state["num_actors"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CursorError(f"cannot read prompt cursor {self.path}: {e}") from None
        if (actor, n) != (self.actor_id, self.num_actors):
            raise CursorError(
                f"prompt cursor {self.path} belongs to actor {actor} of {n}, not {self.actor_id} of "
                f"{self.num_actors}: changing actors.num_actors mid-run would repeat or skip prompts "
                "(start a new run, or delete the cursor files on purpose)")
        self.next = nxt
        self.done = {k for k in done if k >= nxt}
        self._issue_from = nxt

    def index(self, k: int) -> int:
        """The task's training-prompt index of this actor's k-th prompt."""
        return self.actor_id + k * self.num_actors

    @property
    def completed(self) -> int:
        """Prompts done (acknowledged or skipped) over the whole run."""
        return self.next + len(self.done)

    def exhausted(self) -> bool:
        """True when ``limit`` prompts are done or in flight (never with limit 0)."""
        return self.limit > 0 and self._peek() >= self.limit

    def finished(self) -> bool:
        return self.limit > 0 and self.next >= self.limit

    def _peek(self) -> int:
        k = max(self._issue_from, self.next)  # everything below the watermark is done
        while k in self.done or k in self._issued:
            k += 1
        return k

    def take(self) -> int | None:
        """The next k to generate (None when the limit is reached); it is in flight until complete()."""
        k = self._peek()
        if self.limit > 0 and k >= self.limit:
            return None
        self._issued.add(k)
        self._issue_from = k + 1
        return k

    def release(self, k: int) -> None:
        """Give an unfinished k back (it will be issued again, before any newer one)."""
        self._issued.discard(k)
        self._issue_from = min(self._issue_from, k)

    def complete(self, k: int) -> None:
        """Record k as done (acknowledged by the buffer, or skipped) and persist."""
        self._issued.discard(k)
        self.done.add(k)
        while self.next in self.done:
            self.done.remove(self.next)
            self.next += 1
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = json.dumps({"actor_id": self.actor_id, "num_actors": self.num_actors, "next": self.next,
                           "done": sorted(self.done)})
        with open(tmp, "w") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)


__all__ = ["CursorError", "PromptCursor", "group_id_for"]
