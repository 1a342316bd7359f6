"""Wire protocol shared by actors, buffer and learner: the messages (the weight path's in ``common.weight_messages``,
re-exported here), ``encode`` and ``decode``.

Every frame is one msgpack map ``{"v": PROTOCOL_VERSION, "type": <message name>, ...fields}``. Arrays
travel as ``{"dtype": "<i4", "n": N, "data": <N * itemsize raw little-endian bytes>}``; nothing is ever
pickled. ``decode`` validates everything it reads (version, message type, exact field set, types, bounds,
array lengths, finiteness, frame size) and raises :class:`ProtocolError` — and only ``ProtocolError`` —
on any bad input, with a short ``reason`` suitable as a metric label.

Groups inside a :class:`BatchReply` travel as nested, already-encoded ``SampleGroup`` frames so the
buffer can serve what it stored without re-encoding (``encode_batch_reply``; positives likewise,
``common.splice``): after the actor's one encode, each hop decodes a group or sample once.

Messages are declared dataclasses; the flat ones (requests, acks, grants, errors) are frozen. Each field's
kind and bounds are declared once, on the field (``wire_int(lo=0)``, ``wire_array("<i4", nonneg=True)``, ...:
``common.wire``), and that declaration alone drives encode, decode and the checks (``Message.to_wire``/
``from_wire``); rules across fields are a class's ``_check``. ``tests/common/test_protocol_golden.py`` pins
the bytes.
``decode`` returns the union ``AnyMessage``; ``decode_as(frame, Cls)`` returns a ``Cls``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, get_args

import msgpack
import numpy as np

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
from common.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    FINISH_REASONS,
    MAX_ARRAY_LEN,
    MAX_GROUP_SIZE,
    MAX_LIST_LEN,
    MAX_LONG_STR_LEN,
    MAX_STATS,
    PROTOCOL_VERSION,
    M,
    Message,
    ProtocolError,
    _check_list,
    _err,
    _kind,
    check_values,
    pack,
    wire_array,
    wire_bool,
    wire_float,
    wire_int,
    wire_message,
    wire_stats,
    wire_str,
)


def _pack_samples(samples: list[Sample]) -> list[dict[str, Any]]:
    return [s.to_wire() for s in samples]


def wire_samples(lo: int, hi: int) -> Any:
    """``lo`` to ``hi`` ``Sample`` messages nested as maps (their fields without version and type)."""

    def check(name: str, value: Any) -> list[Sample]:
        # Looked up on each call, not bound once: wrapping it (codec counts) sees every call.
        samples = samples_from_wire(_check_list(name, value, lo, hi))
        check_values(samples)
        return samples

    return _kind(_pack_samples, check)


def samples_from_wire(maps: list[Any]) -> list[Sample]:
    """Samples from their wire maps, their structure checked (the value rules are ``check_values``'): the usual
    maps in one pass (``_plain_samples``), and when any map is unusual, each through ``Sample.from_wire``,
    which names what is wrong."""
    plain = _plain_samples(maps)
    return plain if plain is not None else [Sample.from_wire(m, values=False) for m in maps]


_I4, _F4 = np.dtype("<i4"), np.dtype("<f4")
_REASONS = frozenset(FINISH_REASONS)
_INT64_MAX = (1 << 63) - 1


def _plain_samples(maps: list[Any]) -> list[Sample] | None:
    """The samples of maps in the shape actors send, or None at the first map that is not: ``Sample.from_wire``'s
    checks inlined for that shape (run per field and array, they cost ingest more than msgpack's parse). Accepts
    exactly what ``from_wire(values=False)`` accepts of maps without ``version_spans`` and with a float reward
    (an int one, which it widens, goes the slow way), and builds the same samples."""
    keys = Sample.SCHEMA.required_set
    out = []
    for d in maps:
        if type(d) is not dict or d.keys() != keys:
            return None
        p, o, lp = d["prompt_ids"], d["output_ids"], d["output_logprobs"]
        n, r, fr, wv = d["response_length"], d["reward"], d["finish_reason"], d["weight_version"]
        if not (type(p) is dict and type(o) is dict and type(lp) is dict and len(p) == len(o) == len(lp) == 3
                and type(n) is int and 0 <= n <= MAX_ARRAY_LEN and type(r) is float and math.isfinite(r)
                and type(fr) is str and fr in _REASONS and type(wv) is int and 0 <= wv <= _INT64_MAX):
            return None
        pd, pn, od, on, ld, ln = p.get("data"), p.get("n"), o.get("data"), o.get("n"), lp.get("data"), lp.get("n")
        if not (p.get("dtype") == o.get("dtype") == "<i4" and lp.get("dtype") == "<f4"
                and type(pn) is int and 0 <= pn <= MAX_ARRAY_LEN and type(pd) is bytes and len(pd) == 4 * pn
                and type(on) is int and type(ln) is int and on == ln == n
                and type(od) is bytes and type(ld) is bytes and len(od) == len(ld) == 4 * n):
            return None
        out.append(Sample(np.frombuffer(pd, _I4), np.frombuffer(od, _I4), np.frombuffer(ld, _F4), r, fr, wv, n))
    return out


def _pack_group_frames(groups: list[SampleGroup]) -> list[bytes]:
    return [encode(g) for g in groups]


def _check_group_frames(name: str, value: Any) -> list[SampleGroup]:
    groups = []
    for frame in _check_list(name, value, 0, MAX_LIST_LEN):
        if not isinstance(frame, bytes):
            raise _err("bad_type", f"{name} must hold encoded SampleGroup frames")
        group = decode(frame, max_frame_bytes=len(frame))
        if not isinstance(group, SampleGroup):
            raise _err("bad_type", f"{name} must hold SampleGroup frames")
        groups.append(group)
    return groups


def wire_group_frames() -> Any:
    """``SampleGroup`` messages nested as whole encoded frames (what the buffer stores and serves as is)."""
    return _kind(_pack_group_frames, _check_group_frames)


@wire_message
@dataclass(eq=False)
class Sample(Message):
    """One response to a prompt. ``output_logprobs`` are the behaviour policy's logprobs (engine)."""

    prompt_ids: np.ndarray = wire_array("<i4", nonneg=True)  # [P]
    output_ids: np.ndarray = wire_array("<i4", nonneg=True)  # [L]
    output_logprobs: np.ndarray = wire_array("<f4", finite=True)  # [L]
    reward: float = wire_float()
    finish_reason: str = wire_str(choices=FINISH_REASONS)
    weight_version: int = wire_int(lo=0)
    response_length: int = wire_int(0, MAX_ARRAY_LEN)
    # Optional: [v0, n0, v1, n1, ...], the weight version of each run of output tokens in order (an update in
    # place mid-generation gives several). min(v) == weight_version.
    version_spans: np.ndarray | None = wire_array("<i8", optional=True)

    def _check(self) -> None:
        n_tokens = self.output_ids.shape[0]
        if self.output_logprobs.shape != self.output_ids.shape:
            raise _err("length_mismatch", f"{self.output_logprobs.shape[0]} logprobs for {n_tokens} tokens")
        if self.response_length != n_tokens:
            raise _err("length_mismatch", f"response_length {self.response_length} != {n_tokens} output tokens")
        spans = self.version_spans
        if spans is not None:
            versions, counts = spans[0::2], spans[1::2]
            if spans.size % 2 or not spans.size or bool((counts < 1).any()) or bool((versions < 0).any()):
                raise _err("bad_value", "version_spans must be [version >= 0, n_tokens >= 1] pairs")
            if int(counts.sum()) != n_tokens or int(versions.min()) != self.weight_version:
                raise _err("length_mismatch", f"version_spans cover {int(counts.sum())} tokens from version "
                           f"{int(versions.min())}; the sample has {n_tokens} from {self.weight_version}")

    def token_versions(self) -> np.ndarray:
        """[L] int64: the weight version of each output token (``weight_version`` everywhere without spans)."""
        if self.version_spans is None:
            return np.full(self.response_length, self.weight_version, dtype=np.int64)
        return np.repeat(self.version_spans[0::2], self.version_spans[1::2])

    @property
    def nbytes(self) -> int:
        return 4 * (self.prompt_ids.size + 2 * self.output_ids.size) + 64


@wire_message
@dataclass(eq=False)
class SampleGroup(Message):
    """G samples of one prompt. ``group_id`` is unique and makes re-sends idempotent."""

    group_id: str = wire_str(nonempty=True)
    prompt_id: str = wire_str()
    task: str = wire_str()
    actor_id: int = wire_int(0, 1 << 20)
    samples: list[Sample] = wire_samples(1, MAX_GROUP_SIZE)
    created_at: float = wire_float()

    @property
    def weight_version(self) -> int:
        """The group's version: the oldest weights any of its samples was generated with."""
        return min(s.weight_version for s in self.samples)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.samples)


@wire_message
@dataclass(frozen=True, eq=False)
class IngestAck(Message):
    """Buffer -> actor: the fate of one group (see ``buffer.server``)."""

    group_id: str = wire_str()
    committed: bool = wire_bool()
    duplicate: bool = wire_bool()
    error: str = wire_str(MAX_LONG_STR_LEN)


@wire_message
@dataclass(frozen=True, eq=False)
class CreditRequest(Message):
    """Actor -> buffer: "I want ``n`` more groups' worth of credit" (``n = 0`` withdraws the request)."""

    actor_id: int = wire_int(lo=0)
    n: int = wire_int(lo=0)


@wire_message
@dataclass(frozen=True, eq=False)
class CreditGrant(Message):
    """Buffer -> actor: ``n`` groups may be generated, with weights at least ``learner_version``."""

    n: int = wire_int(lo=0)
    learner_version: int = wire_int(lo=0)


@wire_message
@dataclass(frozen=True, eq=False)
class BatchRequest(Message):
    """Learner -> buffer: ``n_groups`` groups for ``learner_version``, waiting at most ``timeout_ms``."""

    learner_version: int = wire_int(lo=0)
    n_groups: int = wire_int(lo=0)
    timeout_ms: int = wire_int(lo=0)


@wire_message
@dataclass(frozen=True, eq=False)
class PositivesRequest(Message):
    """Learner -> buffer: up to ``n`` stored positives."""

    n: int = wire_int(lo=0)


@wire_message
@dataclass(frozen=True, eq=False)
class StatsRequest(Message):
    """Anyone -> buffer: its counters, answered by ``StatsReply``."""


@wire_message
@dataclass(frozen=True, eq=False)
class ErrorReply(Message):
    """Any server -> client when a request cannot be served; ``reason`` is a short label."""

    reason: str = wire_str()
    message: str = wire_str(MAX_LONG_STR_LEN)


@wire_message
@dataclass(eq=False)
class BatchReply(Message):
    """Groups for one learner step, oldest weight version first, plus what was dropped on the way."""

    groups: list[SampleGroup] = wire_group_frames()
    stale_dropped: int = wire_int(lo=0)
    filtered: int = wire_int(lo=0)


@wire_message
@dataclass(eq=False)
class PositivesReply(Message):
    """Stored verified-correct samples for NLL replay."""

    samples: list[Sample] = wire_samples(0, MAX_LIST_LEN)


@wire_message
@dataclass(eq=False)
class StatsReply(Message):
    """Named numeric counters of a server (buffer depth, drops, ...)."""

    stats: dict[str, float] = wire_stats()


AnyMessage = (
    Sample | SampleGroup | IngestAck | CreditRequest | CreditGrant | BatchRequest | BatchReply | PositivesRequest
    | PositivesReply | StatsRequest | StatsReply | WeightUpdate | WeightQuery | ErrorReply | PushJoin | PushGroup
    | PushVersion | PushReady | PushGo | PushDone
)
MESSAGE_TYPES: dict[str, type[AnyMessage]] = {cls.TYPE: cls for cls in get_args(AnyMessage)}


# ------------------------------------------------------------------------------------ encode / decode


def _no_ext(code: int, data: bytes) -> Any:
    raise _err("malformed", f"msgpack ext type {code} not allowed")


def encode(msg: Message) -> bytes:
    """One frame: the message's fields plus version and type."""
    body = msg.to_wire()
    body["v"] = PROTOCOL_VERSION
    body["type"] = msg.TYPE
    return pack(body)


def encode_batch_reply(group_frames: list[bytes], stale_dropped: int, filtered: int) -> bytes:
    """A BatchReply from already-encoded SampleGroup frames (what the buffer stores)."""
    body = {"groups": list(group_frames), "stale_dropped": int(stale_dropped), "filtered": int(filtered)}
    body["v"] = PROTOCOL_VERSION
    body["type"] = BatchReply.TYPE
    return pack(body)


def decode(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> AnyMessage:
    """Parse and validate one frame; raises ProtocolError on anything else."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise _err("bad_type", "frame must be bytes")
    if len(frame) > max_frame_bytes:
        raise _err("oversized", f"frame of {len(frame)} bytes exceeds {max_frame_bytes}")
    try:
        body = msgpack.unpackb(
            frame, raw=False, use_list=True, strict_map_key=True, ext_hook=_no_ext, max_bin_len=max_frame_bytes,
            max_str_len=1 << 20, max_array_len=max(MAX_LIST_LEN, MAX_GROUP_SIZE), max_map_len=MAX_STATS + 16,
            max_ext_len=0)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises many types (ExtraData, ValueError, UnicodeDecodeError, ...)
        raise _err("malformed", f"not a msgpack frame ({type(e).__name__})") from None
    if not isinstance(body, dict):
        raise _err("malformed", "frame is not a map")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise _err("version", f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    type_name = body.pop("type", None)
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise _err("unknown_type", f"unknown message type {type_name!r}")
    try:
        return cls.from_wire(body)
    except ProtocolError:
        raise
    except RecursionError:
        raise _err("malformed", "nesting too deep") from None
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise _err("bad_value", f"{type_name}: {type(e).__name__}: {e}") from None


def decode_as(frame: bytes, cls: type[M], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> M:
    """Decode and require a given message type (an ErrorReply is raised as ProtocolError('remote'))."""
    msg = decode(frame, max_frame_bytes)
    if isinstance(msg, cls):
        return msg
    if isinstance(msg, ErrorReply):
        raise _err("remote", f"{msg.reason}: {msg.message}")
    raise _err("unexpected_type", f"expected {cls.TYPE}, got {msg.TYPE}")

