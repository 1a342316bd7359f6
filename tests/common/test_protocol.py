"""common.protocol: round trips, strict validation, and fuzzing that only ever raises ProtocolError."""

from __future__ import annotations

import dataclasses
import pickle
import random
import time

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import protocol
from common.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    BatchReply,
    BatchRequest,
    CreditGrant,
    CreditRequest,
    ErrorReply,
    IngestAck,
    Message,
    PositivesReply,
    ProtocolError,
    Sample,
    SampleGroup,
    StatsReply,
    StatsRequest,
    WeightQuery,
    WeightUpdate,
    decode,
    decode_as,
    encode,
    encode_batch_reply,
)
from common.splice import encode_positives_reply, sample_frames
from common.wire import WireKind, wire_array, wire_int, wire_message

token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=40)
names = st.text(max_size=40)


@st.composite
def samples(draw) -> Sample:
    out = draw(token_ids)
    lps = draw(st.lists(st.floats(-50, 0, width=32), min_size=len(out), max_size=len(out)))
    return Sample(
        prompt_ids=np.array(draw(token_ids), dtype=np.int32),
        output_ids=np.array(out, dtype=np.int32),
        output_logprobs=np.array(lps, dtype=np.float32),
        reward=draw(st.floats(-10, 10)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        weight_version=draw(st.integers(0, 2**40)),
        response_length=len(out),
    )


@st.composite
def groups(draw) -> SampleGroup:
    return SampleGroup(
        group_id=draw(st.text(min_size=1, max_size=64)),
        prompt_id=draw(names),
        task=draw(names),
        actor_id=draw(st.integers(0, 1000)),
        samples=draw(st.lists(samples(), min_size=1, max_size=5)),
        created_at=draw(st.floats(0, 2e9)),
    )


def make_group(n: int = 3, length: int = 5, version: int = 2, gid: str = "g-1") -> SampleGroup:
    s = [
        Sample(
            prompt_ids=np.arange(4, dtype=np.int32),
            output_ids=np.arange(length, dtype=np.int32) + i,
            output_logprobs=np.full(length, -0.5, dtype=np.float32),
            reward=float(i % 2),
            finish_reason="stop",
            weight_version=version + i,
            response_length=length,
        )
        for i in range(n)
    ]
    return SampleGroup(gid, "p-1", "addition", 0, s, time.time())


@settings(max_examples=150, deadline=None)
@given(groups())
def test_sample_group_round_trip(g: SampleGroup) -> None:
    back = decode(encode(g))
    assert back == g
    assert back.weight_version == min(s.weight_version for s in g.samples)


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(
        st.builds(IngestAck, group_id=names, committed=st.booleans(), duplicate=st.booleans(), error=names),
        st.builds(CreditRequest, actor_id=st.integers(0, 2**31), n=st.integers(0, 2**31)),
        st.builds(CreditGrant, n=st.integers(0, 2**31), learner_version=st.integers(0, 2**40)),
        st.builds(BatchRequest, learner_version=st.integers(0, 2**40), n_groups=st.integers(0, 10**6), timeout_ms=st.integers(0, 10**9)),
        st.builds(WeightUpdate, version=st.integers(0, 2**40), path=names,
                  sha256=st.text("0123456789abcdef", min_size=64, max_size=64), created_at=st.floats(0, 2e9)),
        st.builds(ErrorReply, reason=names, message=names),
        st.builds(StatsReply, stats=st.dictionaries(names, st.floats(-1e9, 1e9), max_size=5)),
        st.builds(PositivesReply, samples=st.lists(samples(), max_size=3)),
        st.just(StatsRequest()),
        st.just(WeightQuery()),
    )
)
def test_message_round_trip(msg) -> None:
    assert decode(encode(msg)) == msg


def test_batch_reply_from_stored_frames_round_trips() -> None:
    gs = [make_group(gid=f"g{i}", version=i) for i in range(3)]
    frame = encode_batch_reply([encode(g) for g in gs], stale_dropped=2, filtered=1)
    reply = decode_as(frame, BatchReply)
    assert reply.groups == gs and reply.stale_dropped == 2 and reply.filtered == 1
    assert decode(encode(reply)) == reply


def _raw(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _group_body(**changes) -> dict:
    body = msgpack.unpackb(encode(make_group()), raw=False)
    body.update(changes)
    return body


def _sample_body(**changes) -> dict:
    body = _group_body()
    body["samples"][0].update(changes)
    return body


@pytest.mark.parametrize(
    "frame, reason",
    [
        (_raw(_group_body(v=PROTOCOL_VERSION + 1)), "version"),
        (_raw({k: v for k, v in _group_body().items() if k != "v"}), "version"),
        (_raw(_group_body(type="Nope")), "unknown_type"),
        (_raw({k: v for k, v in _group_body().items() if k != "task"}), "missing_field"),
        (_raw(_group_body(extra=1)), "extra_field"),
        (_raw(_group_body(actor_id="zero")), "bad_type"),
        (_raw(_group_body(actor_id=True)), "bad_type"),
        (_raw(_group_body(samples=[])), "bad_length"),
        (_raw(_group_body(group_id="")), "bad_value"),
        (_raw(_sample_body(response_length=-1)), "bad_value"),
        (_raw(_sample_body(response_length=4)), "length_mismatch"),
        (_raw(_sample_body(finish_reason="eos")), "bad_value"),
        (_raw(_sample_body(reward=float("nan"))), "not_finite"),
        (_raw(_sample_body(output_logprobs={"dtype": "<f4", "n": 5, "data": np.array([0, 0, np.inf, 0, 0], "<f4").tobytes()})), "not_finite"),
        (_raw(_sample_body(output_logprobs={"dtype": "<f4", "n": 4, "data": np.zeros(4, "<f4").tobytes()})), "length_mismatch"),
        (_raw(_sample_body(output_ids={"dtype": "<i4", "n": -3, "data": b""})), "bad_length"),
        (_raw(_sample_body(output_ids={"dtype": "<i4", "n": 10**9, "data": b""})), "bad_length"),
        (_raw(_sample_body(output_ids={"dtype": "<i4", "n": 5, "data": b"\x00" * 19})), "length_mismatch"),
        (_raw(_sample_body(output_ids={"dtype": "<i8", "n": 5, "data": b"\x00" * 40})), "bad_type"),
        (_raw(_sample_body(output_ids={"dtype": "<i4", "n": 5, "data": np.array([1, 2, -1, 3, 4], "<i4").tobytes()})), "bad_value"),
        (_raw(_sample_body(weight_version=-1)), "bad_value"),
        (_raw({"v": PROTOCOL_VERSION, "type": "WeightUpdate", "version": 1, "path": "/w", "sha256": "xyz", "created_at": 0.0}), "bad_value"),
        (_raw([1, 2, 3]), "malformed"),
        (b"\xc1", "malformed"),
        (encode(make_group())[:-3], "malformed"),
        (encode(make_group()) + b"\x00", "malformed"),
        (pickle.dumps({"v": 1, "type": "StatsRequest"}), "malformed"),
        (msgpack.packb(msgpack.ExtType(1, b"x")), "malformed"),
    ],
)
def test_rejections_name_the_reason(frame: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(frame)
    assert e.value.reason == reason


@pytest.mark.parametrize("field, dtype, bad, reason", [
    ("output_ids", "<i4", np.array([1, 2, -1, 3, 4], "<i4"), "bad_value"),
    ("prompt_ids", "<i4", np.array([0, 1, 2, -7], "<i4"), "bad_value"),
    ("output_logprobs", "<f4", np.array([0, -1, np.nan, 0, 0], "<f4"), "not_finite"),
])
def test_a_bad_value_in_a_later_sample_is_found_and_named(field: str, dtype: str, bad: np.ndarray, reason: str) -> None:
    # The value rules run once over the joined arrays of all samples, then sample by sample to name the culprit.
    body = _group_body()
    body["samples"][2][field] = {"dtype": dtype, "n": len(bad), "data": bad.tobytes()}
    with pytest.raises(ProtocolError) as e:
        decode(_raw(body))
    assert e.value.reason == reason and f"[2].{field}" in str(e.value)


def test_oversized_frames_are_rejected_before_parsing() -> None:
    frame = encode(make_group(length=1000))
    with pytest.raises(ProtocolError) as e:
        decode(frame, max_frame_bytes=len(frame) - 1)
    assert e.value.reason == "oversized"
    assert decode(frame, max_frame_bytes=len(frame)) == decode(frame)


def test_decode_as_checks_type_and_raises_remote_errors() -> None:
    with pytest.raises(ProtocolError) as e:
        decode_as(encode(StatsRequest()), WeightUpdate)
    assert e.value.reason == "unexpected_type"
    with pytest.raises(ProtocolError) as e:
        decode_as(encode(ErrorReply(reason="full", message="buffer full")), BatchReply)
    assert e.value.reason == "remote" and "buffer full" in str(e.value)


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    b = bytearray(frame)
    op = rng.randrange(5)
    if op == 0 and b:  # flip bytes
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 1 and b:  # truncate
        b = b[: rng.randrange(len(b))]
    elif op == 2:  # insert junk
        pos = rng.randrange(len(b) + 1)
        b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif op == 3:  # pure garbage
        b = bytearray(rng.randbytes(rng.randint(0, 64)))
    else:  # duplicate a slice
        if b:
            i = rng.randrange(len(b))
            b = b + b[i : i + rng.randint(1, 32)]
    return bytes(b)


def test_ten_thousand_random_or_mutated_frames_only_raise_protocol_error() -> None:
    rng = random.Random(0)
    seeds = [
        encode(make_group()),
        encode(make_group(n=1, length=0)),
        encode(WeightUpdate(version=3, path="/w", sha256="0" * 64, created_at=1.0)),
        encode(BatchRequest(learner_version=1, n_groups=4, timeout_ms=10)),
        encode_batch_reply([encode(make_group())], 0, 0),
        encode(StatsReply(stats={"a": 1.0})),
    ]
    accepted = rejected = 0
    for _ in range(10_000):
        frame = _mutate(rng.choice(seeds), rng)
        try:
            decode(frame, max_frame_bytes=1 << 16)
            accepted += 1
        except ProtocolError:
            rejected += 1
    assert accepted + rejected == 10_000
    assert rejected > 9_000  # almost every mutation must be caught; the rest decoded into valid messages


@settings(max_examples=60, deadline=None)
@given(groups())
def test_spliced_sample_frames_and_positives_reply_equal_re_encoding(g: SampleGroup) -> None:
    frame = encode(g)
    cut = sample_frames(frame)
    assert cut == [encode(s) for s in g.samples]  # exactly what encoding each sample gives
    reply = encode_positives_reply(cut)
    assert reply == encode(PositivesReply(samples=g.samples))
    assert decode(reply, 1 << 20) == PositivesReply(samples=g.samples)
    assert encode_positives_reply([]) == encode(PositivesReply(samples=[]))


def test_flat_messages_are_frozen() -> None:
    ack = IngestAck(group_id="g", committed=True, duplicate=False, error="")
    with pytest.raises(AttributeError):
        setattr(ack, "committed", False)  # noqa: B010 (`ack.committed = False`, which a type checker refuses)
    assert decode_as(encode(ack), IngestAck).committed is True


def _body(msg: Message, **changes: object) -> bytes:
    body = msgpack.unpackb(encode(msg), raw=False)
    body.update(changes)
    return _raw(body)


_SPANS = {"dtype": "<i8", "n": 2, "data": np.array([2, 4], "<i8").tobytes()}  # version 2 for 4 tokens; the sample has 5


@pytest.mark.parametrize(
    "frame, reason",
    [
        (_body(IngestAck(group_id="g", committed=True, duplicate=False, error=""), committed=1), "bad_type"),
        (_body(IngestAck(group_id="g", committed=True, duplicate=False, error=""), error="e" * 4097), "bad_value"),
        (_body(ErrorReply(reason="r", message="m"), reason="r" * 513), "bad_value"),
        (_body(StatsRequest(), n=1), "extra_field"),
        (_body(StatsReply(), stats=[1.0]), "bad_type"),
        (_body(StatsReply(), stats={"a": float("inf")}), "not_finite"),
        (_body(BatchReply(groups=[], stale_dropped=0, filtered=0), groups=[1]), "bad_type"),
        (_body(BatchReply(groups=[], stale_dropped=0, filtered=0), groups=[encode(StatsRequest())]), "bad_type"),
        (_body(BatchReply(groups=[], stale_dropped=0, filtered=0), filtered=-1), "bad_value"),
        (_body(PositivesReply(samples=[]), samples={}), "bad_type"),
        (_body(CreditGrant(n=1, learner_version=0), learner_version=None), "bad_type"),
        (_raw({k: v for k, v in msgpack.unpackb(encode(CreditGrant(n=1, learner_version=0))).items() if k != "n"}),
         "missing_field"),
        (_raw(_sample_body(version_spans=_SPANS)), "length_mismatch"),
        (_raw(_sample_body(version_spans={**_SPANS, "n": 1, "data": np.array([2], "<i8").tobytes()})), "bad_value"),
        (_raw(_sample_body(version_spans=None)), "bad_type"),
        (_raw(_sample_body(prompt_ids={"dtype": "<i4", "n": 1, "data": np.array([-1], "<i4").tobytes()})), "bad_value"),
    ],
)
def test_declared_bounds_reject_with_their_reason(frame: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(frame)
    assert e.value.reason == reason


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=lambda c: c.__name__)
def test_each_message_declares_its_wire_fields_once(cls: type[Message]) -> None:
    """The wire field set and order are the dataclass fields, and each class has its own codec entries."""
    schema = cls.SCHEMA
    declared = [f.name for f in dataclasses.fields(cls)]
    assert [*schema.names, *(name for name, _ in schema.optional)] == declared
    assert all(isinstance(f.metadata["wire"], WireKind) for f in dataclasses.fields(cls))
    assert "from_wire" in cls.__dict__ and "to_wire" in cls.__dict__


def test_wire_order_is_field_order_and_optional_fields_only_when_set() -> None:
    smp = make_group().samples[0]
    assert list(smp.to_wire()) == [f.name for f in dataclasses.fields(Sample)][:-1]
    spans = dataclasses.replace(smp, version_spans=np.array([smp.weight_version, smp.response_length], np.int64))
    assert list(spans.to_wire()) == [f.name for f in dataclasses.fields(Sample)]
    assert decode_as(encode(spans), Sample) == spans and decode_as(encode(smp), Sample).version_spans is None


def test_an_optional_field_declared_before_a_required_one_is_refused() -> None:
    @dataclasses.dataclass(eq=False, kw_only=True)  # a plain dataclass would refuse this order itself
    class Misordered(Message):
        spans: np.ndarray | None = wire_array("<i8", optional=True)
        n: int = wire_int(lo=0)

    with pytest.raises(TypeError, match="the optional ones last"):
        wire_message(Misordered)


def _variants(value: object) -> list[object]:
    """Values to put where ``value`` was: of every wire type, near the bounds, and, for an array map, the map
    with each key replaced, removed or joined by another."""
    out: list[object] = [None, True, 0, -1, 1 << 63, 2.0, float("inf"), "stop", "eos", b"", [], {}]
    if isinstance(value, dict):
        for key in value:
            out += [{k: v for k, v in value.items() if k != key}, {**value, "extra": 1}]
            out += [{**value, key: other} for other in (None, True, 5, 5.0, "<i4", "<f4", "<i8", b"\x00" * 20, -1)]
    return out


def test_the_one_pass_sample_path_accepts_exactly_what_from_wire_accepts() -> None:
    """``samples_from_wire`` takes the usual sample maps in one pass (``_plain_samples``) instead of field by
    field: on every variant of every field of a sample map (and an added or missing field), that pass either
    defers (None) or builds the very samples ``Sample.from_wire`` builds, and never takes a map from_wire
    refuses."""
    maps = msgpack.unpackb(encode(make_group()), raw=False)["samples"]
    assert protocol._plain_samples(maps) == [Sample.from_wire(m, values=False) for m in maps]  # the usual shape
    tried = accepted_by_both = 0
    for field in [*maps[1], "version_spans", "extra"]:
        present = field in maps[1]
        for variant in [*_variants(maps[1].get(field)), *(["drop"] if present else [])]:
            changed = [dict(m) for m in maps]
            if variant == "drop":
                del changed[1][field]
            else:
                changed[1][field] = variant
            try:
                slow: list[Sample] | None = [Sample.from_wire(m, values=False) for m in changed]
            except (ProtocolError, TypeError, ValueError, KeyError, AttributeError, OverflowError):
                slow = None
            fast = protocol._plain_samples(changed)
            tried += 1
            if slow is None:
                assert fast is None, (field, variant)
            elif fast is not None:
                assert fast == slow, (field, variant)
                accepted_by_both += 1
    assert tried > 200 and accepted_by_both >= 1
    int_reward = [dict(m) for m in maps]
    int_reward[0]["reward"] = 1  # from_wire widens it; the one-pass path leaves that to it
    assert protocol._plain_samples(int_reward) is None
    assert decode(_raw({**_group_body(), "samples": int_reward})).samples[0].reward == 1.0
