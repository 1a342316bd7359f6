"""The weight path's messages: the learner's ``WeightUpdate`` announcements (and the actors' ``WeightQuery``)
and the push handshake between learner and actors (``PushJoin`` ... ``PushDone``; the sequence is in
docs/WIRE.md). ``common.protocol`` encodes and decodes them with the others and re-exports them; import them
from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.wire import (
    _SHA256,
    MAX_LONG_STR_LEN,
    Message,
    wire_bool,
    wire_buckets,
    wire_float,
    wire_int,
    wire_message,
    wire_str,
)


@wire_message
@dataclass(frozen=True, eq=False)
class WeightUpdate(Message):
    """Learner -> actors: weights ``version`` are at ``path`` (digest ``sha256``), written at ``created_at``."""

    version: int = wire_int(lo=0)
    path: str = wire_str(MAX_LONG_STR_LEN)
    sha256: str = wire_str(pattern=_SHA256, pattern_text="a lowercase hex sha256")
    created_at: float = wire_float()


@wire_message
@dataclass(frozen=True, eq=False)
class WeightQuery(Message):
    """Actor -> learner: the latest ``WeightUpdate`` please (late subscribers, missed publications)."""


@wire_message
@dataclass(frozen=True, eq=False)
class PushJoin(Message):
    """Actor -> learner (push socket): engine ``actor_id`` is up; include it in the next weight-update group.
    ``engine_start`` takes a new value at each announcement (every engine (re)start, every rejoin after a
    failure), so the learner tells a new announcement from a repeated one."""

    actor_id: int = wire_int(lo=0)
    engine_start: int = wire_int()


@wire_message
@dataclass(frozen=True, eq=False)
class PushGroup(Message):
    """Learner -> actor: join group ``epoch`` (SGLang's ``/init_weights_update_group`` fields) and expect
    every pushed version as ``buckets`` (each one ``/update_weights_from_distributed``'s names, dtypes, shapes)."""

    epoch: int = wire_int(lo=0)
    master_address: str = wire_str()
    master_port: int = wire_int(1, 65535)
    rank_offset: int = wire_int(lo=1)
    world_size: int = wire_int(lo=2)
    group_name: str = wire_str()
    backend: str = wire_str()
    buckets: list[dict[str, Any]] = wire_buckets()


@wire_message
@dataclass(frozen=True, eq=False)
class PushVersion(Message):
    """Learner -> actor: version ``version`` is next on group ``epoch``: pause generation, open the engine's
    weight-update session and answer ``PushReady``; nothing is broadcast before ``PushGo``."""

    epoch: int = wire_int(lo=0)
    version: int = wire_int(lo=0)


@wire_message
@dataclass(frozen=True, eq=False)
class PushReady(Message):
    """Actor -> learner: for ``version`` on group ``epoch`` its engine is paused with its weight-update
    session open (``ok``), so it can post the buckets' receives; or why not (``message``)."""

    actor_id: int = wire_int(lo=0)
    epoch: int = wire_int(lo=0)
    version: int = wire_int(lo=0)
    ok: bool = wire_bool()
    message: str = wire_str(MAX_LONG_STR_LEN)


@wire_message
@dataclass(frozen=True, eq=False)
class PushGo(Message):
    """Learner -> actor: ``go``: every member is ready, ``version`` is broadcast on group ``epoch`` now, post
    its buckets; not ``go``: nothing is broadcast for it (a member was not ready), end the session and
    continue (the version comes from disk; the group is rebuilt at the next version)."""

    epoch: int = wire_int(lo=0)
    version: int = wire_int(lo=0)
    go: bool = wire_bool()


@wire_message
@dataclass(frozen=True, eq=False)
class PushDone(Message):
    """Actor -> learner: its engine joined group ``epoch`` (``version`` -1) or loaded ``version`` (``ok``),
    with generation paused ``pause_s``; ``message`` says why not."""

    actor_id: int = wire_int(lo=0)
    epoch: int = wire_int(lo=0)
    version: int = wire_int(lo=-1)
    ok: bool = wire_bool()
    pause_s: float = wire_float()
    message: str = wire_str(MAX_LONG_STR_LEN)
