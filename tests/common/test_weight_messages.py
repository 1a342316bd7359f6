"""common.weight_messages: the weight path's messages on the wire (through ``common.protocol``, which encodes,
decodes and re-exports them): their type names, round trips, and the bounds each field declares."""

from __future__ import annotations

import msgpack
import pytest

from common import protocol, weight_messages
from common.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, Message, ProtocolError, decode, decode_as, encode
from common.weight_messages import (
    PushDone,
    PushGo,
    PushGroup,
    PushJoin,
    PushReady,
    PushVersion,
    WeightQuery,
    WeightUpdate,
)

_PUSH_GROUP = PushGroup(epoch=1, master_address="h", master_port=29500, rank_offset=1, world_size=2, group_name="g",
                        backend="nccl", buckets=[{"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]}])

ONE_OF_EACH: list[Message] = [
    WeightUpdate(version=5, path="/w/v5", sha256="ab" * 32, created_at=2.25),
    WeightQuery(),
    PushJoin(actor_id=3, engine_start=17),
    _PUSH_GROUP,
    PushVersion(epoch=1, version=6),
    PushReady(actor_id=3, epoch=1, version=6, ok=False, message="not paused"),
    PushGo(epoch=1, version=6, go=True),
    PushDone(actor_id=3, epoch=1, version=-1, ok=True, pause_s=0.25, message=""),
]


def _body(msg: Message, **changes: object) -> bytes:
    body = msgpack.unpackb(encode(msg), raw=False)
    body.update(changes)
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize("msg", ONE_OF_EACH, ids=lambda m: type(m).__name__)
def test_each_travels_under_its_class_name_and_round_trips(msg: Message) -> None:
    name = type(msg).__name__
    assert msg.TYPE == name and MESSAGE_TYPES[name] is type(msg)
    assert getattr(protocol, name) is getattr(weight_messages, name)  # one class, re-exported
    frame = encode(msg)
    body = msgpack.unpackb(frame, raw=False)
    assert body["type"] == name and body["v"] == PROTOCOL_VERSION
    assert decode_as(frame, type(msg)) == msg


def test_the_push_join_frame_is_exactly_its_fields_version_and_type() -> None:
    """Hand-written msgpack: a fixmap of 4 entries, each key a fixstr, the two small ints positive fixints."""
    want = (b"\x84" + b"\xa8actor_id" + b"\x03" + b"\xacengine_start" + b"\x11"
            + b"\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa4type" + b"\xa8PushJoin")
    assert encode(PushJoin(actor_id=3, engine_start=17)) == want


@pytest.mark.parametrize(
    "frame, reason",
    [
        (_body(_PUSH_GROUP, master_port=0), "bad_value"),
        (_body(_PUSH_GROUP, master_port=65536), "bad_value"),
        (_body(_PUSH_GROUP, world_size=1), "bad_value"),
        (_body(_PUSH_GROUP, rank_offset=0), "bad_value"),
        (_body(_PUSH_GROUP, buckets=[{"names": ["w"], "dtypes": [], "shapes": [[2]]}]), "bad_value"),
        (_body(_PUSH_GROUP, buckets=[{"names": ["w"], "dtypes": ["f"], "shapes": [[-1]]}]), "bad_value"),
        (_body(PushDone(actor_id=0, epoch=0, version=-1, ok=True, pause_s=0.0, message=""), version=-2), "bad_value"),
        (_body(PushJoin(actor_id=0, engine_start=1), engine_start=1.5), "bad_type"),
        (_body(PushJoin(actor_id=0, engine_start=1), actor_id=-1), "bad_value"),
        (_body(PushReady(actor_id=0, epoch=1, version=2, ok=True, message=""), version=-1), "bad_value"),
        (_body(PushReady(actor_id=0, epoch=1, version=2, ok=True, message=""), message="m" * 4097), "bad_value"),
        (_body(PushGo(epoch=1, version=2, go=True), go=1), "bad_type"),
        (_body(PushGo(epoch=1, version=2, go=False), epoch=-1), "bad_value"),
        (_body(PushVersion(epoch=1, version=2), extra=0), "extra_field"),
        (_body(WeightUpdate(version=5, path="/w", sha256="ab" * 32, created_at=0.0), sha256="AB" * 32), "bad_value"),
        (_body(WeightUpdate(version=5, path="/w", sha256="ab" * 32, created_at=0.0), version=-1), "bad_value"),
        (_body(WeightQuery(), version=1), "extra_field"),
    ],
)
def test_declared_bounds_reject_with_their_reason(frame: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(frame)
    assert e.value.reason == reason


def test_they_are_frozen() -> None:
    msg = PushGo(epoch=1, version=2, go=True)
    with pytest.raises(AttributeError):
        setattr(msg, "go", False)  # noqa: B010 (`msg.go = False`, which a type checker refuses)
