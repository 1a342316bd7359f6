"""Wire protocol shared by actors, buffer and learner (the one place messages are defined).

Every frame is one msgpack map ``{"v": PROTOCOL_VERSION, "type": <message name>, ...fields}``. Arrays
travel as ``{"dtype": "<i4", "n": N, "data": <N * itemsize raw little-endian bytes>}``; nothing is ever
pickled. ``decode`` validates everything it reads (version, message type, exact field set, types, bounds,
array lengths, finiteness, frame size) and raises :class:`ProtocolError` — and only ``ProtocolError`` —
on any bad input, with a short ``reason`` suitable as a metric label.

Groups inside a :class:`BatchReply` travel as nested, already-encoded ``SampleGroup`` frames so the
buffer can serve what it stored without re-encoding (``encode_batch_reply``). The buffer also stores the
positives it harvests as the exact bytes they arrived in (``sample_frames`` cuts them out of a group frame)
and serves them spliced into a ``PositivesReply`` (``encode_positives_reply``): after the actor's one
encode, each hop decodes a group or sample once.

Messages are declared dataclasses; the flat ones (requests, acks, grants, errors) are frozen. Each field's
kind and bounds are declared once, on the field (``wire_int(lo=0)``, ``wire_array("<i4", nonneg=True)``, ...),
and that declaration alone drives encode, decode and the checks (``Message.to_wire``/``from_wire``); rules
across fields are a class's ``_check``. ``tests/common/test_protocol_golden.py`` pins the bytes.
``decode`` returns the union ``AnyMessage``; ``decode_as(frame, Cls)`` returns a ``Cls``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self, TypeVar

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 64 << 20
MAX_ARRAY_LEN = 1 << 20  # tokens in one prompt or response
MAX_GROUP_SIZE = 4096  # samples per group
MAX_LIST_LEN = 1 << 16  # groups per batch, samples per positives reply
MAX_STR_LEN = 512
MAX_LONG_STR_LEN = 4096  # error texts, paths
MAX_STATS = 1024
FINISH_REASONS = ("stop", "length", "abort")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_INT64 = (-(1 << 63), (1 << 63) - 1)


class ProtocolError(ValueError):
    """A frame that does not follow the protocol. ``reason`` is a short metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


# ------------------------------------------------------------------------------ wire value checks


def _err(reason: str, msg: str) -> ProtocolError:
    return ProtocolError(reason, msg)


def _check_int(name: str, v: Any, lo: int = _INT64[0], hi: int = _INT64[1]) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise _err("bad_type", f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise _err("bad_value", f"{name}={v} out of range [{lo}, {hi}]")
    return v


def _check_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _err("bad_type", f"{name} must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise _err("not_finite", f"{name} is not finite")
    return v


def _check_str(name: str, v: Any, max_len: int = MAX_STR_LEN) -> str:
    if not isinstance(v, str):
        raise _err("bad_type", f"{name} must be a string, got {type(v).__name__}")
    if len(v) > max_len:
        raise _err("bad_value", f"{name} longer than {max_len}")
    return v


def _check_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _err("bad_type", f"{name} must be a bool, got {type(v).__name__}")
    return v


_ARRAY_KEYS = frozenset(("dtype", "n", "data"))
_DTYPES = {d: np.dtype(d) for d in ("<i4", "<f4", "<i8")}


def _unpack_array(name: str, v: Any, dtype: str) -> np.ndarray:
    if not isinstance(v, dict):
        raise _err("bad_type", f"{name} must be an array map")
    if v.keys() != _ARRAY_KEYS:
        raise _err("bad_type", f"{name}: array map needs exactly dtype, n, data")
    if v["dtype"] != dtype:
        raise _err("bad_type", f"{name}: dtype {v['dtype']!r}, expected {dtype!r}")
    n = v["n"]
    if not isinstance(n, int) or isinstance(n, bool):
        raise _err("bad_type", f"{name}: n must be an int")
    if n < 0 or n > MAX_ARRAY_LEN:
        raise _err("bad_length", f"{name}: length {n} outside [0, {MAX_ARRAY_LEN}]")
    data = v["data"]
    if not isinstance(data, bytes):
        raise _err("bad_type", f"{name}: data must be bytes")
    dt = _DTYPES.get(dtype) or np.dtype(dtype)
    if len(data) != n * dt.itemsize:
        raise _err("length_mismatch", f"{name}: {len(data)} bytes for {n} x {dt.itemsize}")
    return np.frombuffer(data, dtype=dt)


# ------------------------------------------------------------------------------------------ the schema
#
# Each message declares its fields once, as dataclass fields whose metadata holds a ``WireKind``: how the
# attribute becomes its wire value (``pack``) and how a decoded wire value is checked and turned back into
# the attribute (``check``, raising ProtocolError). ``Message.to_wire``/``from_wire`` are driven by that
# metadata alone; wire order is field order. Rules that involve several fields stay in a per-class ``_check``.


@dataclass(frozen=True, slots=True)
class WireKind:
    """How one field travels; ``optional`` fields (always declared last) are absent on the wire when None."""

    pack: Callable[[Any], Any]
    check: Callable[[str, Any], Any]
    optional: bool = False
    # An array field's rule on its values, kept apart from ``check`` (the structure) so that a list of
    # messages can run it once over all their arrays (``check_values``): a reduction per array costs more
    # than the reduction itself at ingest's rate.
    values: Callable[[str, np.ndarray], None] | None = None


def _kind(pack: Callable[[Any], Any], check: Callable[[str, Any], Any], optional: bool = False,
          values: Callable[[str, np.ndarray], None] | None = None) -> Any:
    # ``Any`` as dataclasses.field itself returns: the declaration reads `name: int = wire_int(...)`.
    kind = WireKind(pack, check, optional, values)
    if optional:
        return field(default=None, metadata={"wire": kind})
    return field(metadata={"wire": kind})


def _as_is(value: Any) -> Any:
    return value


def wire_int(lo: int = _INT64[0], hi: int = _INT64[1]) -> Any:
    """An int in ``[lo, hi]`` (a bool is not an int here)."""

    def check(name: str, value: Any) -> int:
        return _check_int(name, value, lo, hi)

    return _kind(int, check)


def wire_float() -> Any:
    """A finite float (an int on the wire is accepted and widened)."""
    return _kind(float, _check_float)


def wire_bool() -> Any:
    """A bool (not 0 or 1)."""
    return _kind(bool, _check_bool)


def wire_str(max_len: int = MAX_STR_LEN, nonempty: bool = False, choices: tuple[str, ...] = (),
             pattern: re.Pattern[str] | None = None, pattern_text: str = "") -> Any:
    """A string of at most ``max_len`` characters; ``choices``/``pattern`` restrict its values."""

    def check(name: str, value: Any) -> str:
        text = _check_str(name, value, max_len)
        if nonempty and not text:
            raise _err("bad_value", f"{name} is empty")
        if choices and text not in choices:
            raise _err("bad_value", f"{name} {text!r} not in {choices}")
        if pattern is not None and not pattern.match(text):
            raise _err("bad_value", f"{name} is not {pattern_text}")
        return text

    def check_length(name: str, value: Any) -> str:
        return _check_str(name, value, max_len)

    return _kind(_as_is, check if nonempty or choices or pattern is not None else check_length)


def wire_array(dtype: str, nonneg: bool = False, finite: bool = False, optional: bool = False) -> Any:
    """A 1-d array of ``dtype`` (at most MAX_ARRAY_LEN); ``nonneg`` token ids, ``finite`` values."""

    def check(name: str, value: Any) -> np.ndarray:
        return _unpack_array(name, value, dtype)

    def values(name: str, array: np.ndarray) -> None:
        if nonneg and array.size and int(array.min()) < 0:
            raise _err("bad_value", f"{name} has negative token ids")
        if finite and array.size and not bool(np.isfinite(array).all()):
            raise _err("not_finite", f"{name} has non-finite values")

    np_dtype = np.dtype(dtype)

    def pack(array: np.ndarray) -> dict[str, Any]:
        array = np.ascontiguousarray(array, dtype=np_dtype)
        return {"dtype": dtype, "n": int(array.shape[0]), "data": array.tobytes()}

    return _kind(pack, check, optional, values if nonneg or finite else None)


def _check_list(name: str, value: Any, lo: int, hi: int) -> list[Any]:
    if not isinstance(value, list):
        raise _err("bad_type", f"{name} must be a list")
    if not lo <= len(value) <= hi:
        raise _err("bad_length", f"{len(value)} {name} outside [{lo}, {hi}]")
    return value


def _pack_samples(samples: list[Sample]) -> list[dict[str, Any]]:
    return [s.to_wire() for s in samples]


def wire_samples(lo: int, hi: int) -> Any:
    """``lo`` to ``hi`` ``Sample`` messages nested as maps (their fields without version and type)."""

    def check(name: str, value: Any) -> list[Sample]:
        # Sample.from_wire is looked up on each call, not bound once: wrapping it (codec counts) sees every call.
        samples = [Sample.from_wire(s, values=False) for s in _check_list(name, value, lo, hi)]
        check_values(samples)
        return samples

    return _kind(_pack_samples, check)


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


def _check_stats(name: str, value: Any) -> dict[str, float]:
    if not isinstance(value, dict) or len(value) > MAX_STATS:
        raise _err("bad_type", f"{name} must be a map")
    return {_check_str(f"{name} key", k): _check_float(f"{name}[{k}]", v) for k, v in value.items()}


def _pack_stats(stats: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in stats.items()}


def wire_stats() -> Any:
    """A map of at most MAX_STATS names to finite floats (empty by default)."""
    return field(default_factory=dict, metadata={"wire": WireKind(_pack_stats, _check_stats)})


def _check_buckets(name: str, value: Any) -> list[dict[str, Any]]:
    """``PushGroup.buckets``: each ``{"names": [str], "dtypes": [str], "shapes": [[int]]}``, one length."""
    if not isinstance(value, list) or len(value) > MAX_LIST_LEN:
        raise _err("bad_type", f"{name} must be a list of at most {MAX_LIST_LEN}")
    out = []
    for bucket in value:
        bucket = _expect_fields("bucket", bucket, ("names", "dtypes", "shapes"), frozenset(("names", "dtypes", "shapes")))
        names, dtypes, shapes = bucket["names"], bucket["dtypes"], bucket["shapes"]
        if not all(isinstance(x, list) for x in (names, dtypes, shapes)) or not len(names) == len(dtypes) == len(shapes):
            raise _err("bad_value", "bucket: names, dtypes and shapes must be lists of one length")
        out.append({"names": [_check_str("name", n) for n in names], "dtypes": [_check_str("dtype", d) for d in dtypes],
                    "shapes": [[_check_int("dim", x, 0) for x in (sh if isinstance(sh, list) else [None])]
                               for sh in shapes]})
    return out


def wire_buckets() -> Any:
    """SGLang's bucket descriptions (``PushGroup``), passed through as read."""
    return _kind(_as_is, _check_buckets)


@dataclass(frozen=True)
class Schema:
    """A message's wire fields in order: the required ones, then the optional ones."""

    packs: tuple[tuple[str, Callable[[Any], Any]], ...]  # the required fields'
    checks: tuple[tuple[str, Callable[[str, Any], Any]], ...]  # the required fields'
    optional: tuple[tuple[str, WireKind], ...]
    names: tuple[str, ...]  # the required ones
    required_set: frozenset[str]
    allowed: frozenset[str]
    cross_field: bool  # the class has rules across fields (``_check``)
    values: tuple[tuple[str, Callable[[str, np.ndarray], None]], ...]  # the array fields' value rules

    @staticmethod
    def of(cls: type) -> Schema:
        kinds = [(f.name, f.metadata["wire"]) for f in fields(cls)]
        required = tuple((n, k) for n, k in kinds if not k.optional)
        optional = tuple((n, k) for n, k in kinds if k.optional)
        # from_wire passes the required fields positionally, and to_wire appends the optional ones
        if kinds != [*required, *optional] or any(f.kw_only for f in fields(cls)):
            raise TypeError(f"{cls.__name__}: wire fields must be positional, the optional ones last")
        names = tuple(n for n, _ in required)
        return Schema(tuple((n, k.pack) for n, k in required), tuple((n, k.check) for n, k in required), optional,
                      names, frozenset(names), frozenset(n for n, _ in kinds), "_check" in cls.__dict__,
                      tuple((n, k.values) for n, k in kinds if k.values is not None))


def _expect_fields(name: str, d: Any, required: tuple[str, ...], allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise _err("bad_type", f"{name} must be a map")
    missing = [k for k in required if k not in d]
    if missing:
        raise _err("missing_field", f"{name}: missing {', '.join(missing)}")
    if len(d) > len(required):
        extra = d.keys() - allowed
        if extra:
            raise _err("extra_field", f"{name}: unexpected {', '.join(sorted(map(str, extra)))}")
    return d


# ------------------------------------------------------------------------------------------- messages


class Message:
    """Base of every top-level frame: ``TYPE`` names it on the wire; its ``SCHEMA`` (built by ``@wire_message``
    from the dataclass fields) drives ``to_wire``/``from_wire``.

    Equality compares wire values (arrays by content), so a decoded message equals the one encoded.
    """

    TYPE: ClassVar[str] = ""
    SCHEMA: ClassVar[Schema]

    def to_wire(self) -> dict[str, Any]:
        """The message's fields as msgpack values, in field order (optional ones only when set)."""
        schema = self.SCHEMA
        out = {name: pack(getattr(self, name)) for name, pack in schema.packs}
        for name, kind in schema.optional:
            value = getattr(self, name)
            if value is not None:
                out[name] = kind.pack(value)
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any], values: bool = True) -> Self:
        """Check a decoded map field by field (exact field set, kinds, bounds), then the cross-field rules.

        ``values=False`` leaves the array fields' value rules to the caller, who must run ``check_values``
        on the message (with the others of its list) before anyone uses it."""
        schema = cls.SCHEMA
        if not (type(d) is dict and d.keys() == schema.required_set):  # else optional fields or a bad field set
            _expect_fields(cls.TYPE, d, schema.names, schema.allowed)
        msg = cls(*[check(name, d[name]) for name, check in schema.checks])
        for name, kind in schema.optional:
            if name in d:  # set on the fresh instance, frozen or not, before anyone else sees it
                object.__setattr__(msg, name, kind.check(name, d[name]))
        if values:
            check_values([msg])
        if schema.cross_field:
            msg._check()
        return msg

    def _check(self) -> None:
        """Rules across fields, run after every field passed its own checks; raises ProtocolError."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and isinstance(other, Message) and _wire_equal(self.to_wire(), other.to_wire())


def _wire_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_wire_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_wire_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


M = TypeVar("M", bound=Message)


def check_values(msgs: list[Message]) -> None:
    """Run the array fields' value rules (``wire_array``'s ``nonneg``, ``finite``) over a list of messages of
    one type: once over each field's arrays joined, and only when that fails, message by message to name
    the first bad one (a group's ``[3].output_ids has negative token ids``)."""
    if not msgs:
        return
    for name, rule in msgs[0].SCHEMA.values:
        arrays = [a for a in (getattr(m, name) for m in msgs) if a is not None]
        if not arrays:
            continue
        try:
            rule(name, arrays[0] if len(arrays) == 1 else np.concatenate(arrays))
        except ProtocolError:
            if len(msgs) == 1:
                raise
            for i, m in enumerate(msgs):
                array = getattr(m, name)
                if array is not None:
                    rule(f"[{i}].{name}", array)
            raise


def wire_message(cls: type[M]) -> type[M]:
    """Class decorator after ``@dataclass``: build the schema, and give the class its own ``to_wire`` and
    ``from_wire`` entries (so one message type's codec can be wrapped without touching the others')."""
    cls.SCHEMA = Schema.of(cls)
    cls.to_wire = Message.to_wire  # type: ignore[method-assign]
    cls.from_wire = classmethod(Message.from_wire.__func__)  # type: ignore[assignment, attr-defined]
    return cls


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

    TYPE: ClassVar[str] = "Sample"

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

    TYPE: ClassVar[str] = "SampleGroup"

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

    TYPE: ClassVar[str] = "IngestAck"


@wire_message
@dataclass(frozen=True, eq=False)
class CreditRequest(Message):
    """Actor -> buffer: "I want ``n`` more groups' worth of credit" (``n = 0`` withdraws the request)."""

    actor_id: int = wire_int(lo=0)
    n: int = wire_int(lo=0)

    TYPE: ClassVar[str] = "CreditRequest"


@wire_message
@dataclass(frozen=True, eq=False)
class CreditGrant(Message):
    """Buffer -> actor: ``n`` groups may be generated, with weights at least ``learner_version``."""

    n: int = wire_int(lo=0)
    learner_version: int = wire_int(lo=0)

    TYPE: ClassVar[str] = "CreditGrant"


@wire_message
@dataclass(frozen=True, eq=False)
class BatchRequest(Message):
    """Learner -> buffer: ``n_groups`` groups for ``learner_version``, waiting at most ``timeout_ms``."""

    learner_version: int = wire_int(lo=0)
    n_groups: int = wire_int(lo=0)
    timeout_ms: int = wire_int(lo=0)

    TYPE: ClassVar[str] = "BatchRequest"


@wire_message
@dataclass(frozen=True, eq=False)
class PositivesRequest(Message):
    """Learner -> buffer: up to ``n`` stored positives."""

    n: int = wire_int(lo=0)

    TYPE: ClassVar[str] = "PositivesRequest"


@wire_message
@dataclass(frozen=True, eq=False)
class StatsRequest(Message):
    """Anyone -> buffer: its counters, answered by ``StatsReply``."""

    TYPE: ClassVar[str] = "StatsRequest"


@wire_message
@dataclass(frozen=True, eq=False)
class WeightUpdate(Message):
    """Learner -> actors: weights ``version`` are at ``path`` (digest ``sha256``), written at ``created_at``."""

    version: int = wire_int(lo=0)
    path: str = wire_str(MAX_LONG_STR_LEN)
    sha256: str = wire_str(pattern=_SHA256, pattern_text="a lowercase hex sha256")
    created_at: float = wire_float()

    TYPE: ClassVar[str] = "WeightUpdate"


@wire_message
@dataclass(frozen=True, eq=False)
class WeightQuery(Message):
    """Actor -> learner: the latest ``WeightUpdate`` please (late subscribers, missed publications)."""

    TYPE: ClassVar[str] = "WeightQuery"


@wire_message
@dataclass(frozen=True, eq=False)
class PushJoin(Message):
    """Actor -> learner (push socket): engine ``actor_id`` is up; include it in the next weight-update group.
    ``engine_start`` takes a new value at each announcement (every engine (re)start, every rejoin after a
    failure), so the learner tells a new announcement from a repeated one."""

    actor_id: int = wire_int(lo=0)
    engine_start: int = wire_int()

    TYPE: ClassVar[str] = "PushJoin"


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

    TYPE: ClassVar[str] = "PushGroup"


@wire_message
@dataclass(frozen=True, eq=False)
class PushVersion(Message):
    """Learner -> actor: version ``version`` is next on group ``epoch``: pause generation, open the engine's
    weight-update session and answer ``PushReady``; nothing is broadcast before ``PushGo``."""

    epoch: int = wire_int(lo=0)
    version: int = wire_int(lo=0)

    TYPE: ClassVar[str] = "PushVersion"


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

    TYPE: ClassVar[str] = "PushReady"


@wire_message
@dataclass(frozen=True, eq=False)
class PushGo(Message):
    """Learner -> actor: ``go``: every member is ready, ``version`` is broadcast on group ``epoch`` now, post
    its buckets; not ``go``: nothing is broadcast for it (a member was not ready), end the session and
    continue (the version comes from disk; the group is rebuilt at the next version)."""

    epoch: int = wire_int(lo=0)
    version: int = wire_int(lo=0)
    go: bool = wire_bool()

    TYPE: ClassVar[str] = "PushGo"


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

    TYPE: ClassVar[str] = "PushDone"


@wire_message
@dataclass(frozen=True, eq=False)
class ErrorReply(Message):
    """Any server -> client when a request cannot be served; ``reason`` is a short label."""

    reason: str = wire_str()
    message: str = wire_str(MAX_LONG_STR_LEN)

    TYPE: ClassVar[str] = "ErrorReply"


@wire_message
@dataclass(eq=False)
class BatchReply(Message):
    """Groups for one learner step, oldest weight version first, plus what was dropped on the way."""

    groups: list[SampleGroup] = wire_group_frames()
    stale_dropped: int = wire_int(lo=0)
    filtered: int = wire_int(lo=0)

    TYPE: ClassVar[str] = "BatchReply"


@wire_message
@dataclass(eq=False)
class PositivesReply(Message):
    """Stored verified-correct samples for NLL replay."""

    samples: list[Sample] = wire_samples(0, MAX_LIST_LEN)

    TYPE: ClassVar[str] = "PositivesReply"


@wire_message
@dataclass(eq=False)
class StatsReply(Message):
    """Named numeric counters of a server (buffer depth, drops, ...)."""

    stats: dict[str, float] = wire_stats()

    TYPE: ClassVar[str] = "StatsReply"


AnyMessage = (
    Sample | SampleGroup | IngestAck | CreditRequest | CreditGrant | BatchRequest | BatchReply | PositivesRequest
    | PositivesReply | StatsRequest | StatsReply | WeightUpdate | WeightQuery | ErrorReply | PushJoin | PushGroup
    | PushVersion | PushReady | PushGo | PushDone
)
_ALL: tuple[type[AnyMessage], ...] = (
    Sample, SampleGroup, IngestAck, CreditRequest, CreditGrant, BatchRequest, BatchReply,
    PositivesRequest, PositivesReply, StatsRequest, StatsReply, WeightUpdate, WeightQuery, ErrorReply,
    PushJoin, PushGroup, PushVersion, PushReady, PushGo, PushDone,
)
MESSAGE_TYPES: dict[str, type[AnyMessage]] = {cls.TYPE: cls for cls in _ALL}


# ------------------------------------------------------------------------------------ encode / decode


def _no_ext(code: int, data: bytes) -> Any:
    raise _err("malformed", f"msgpack ext type {code} not allowed")


def encode(msg: Message) -> bytes:
    """One frame: the message's fields plus version and type."""
    body = msg.to_wire()
    body["v"] = PROTOCOL_VERSION
    body["type"] = msg.TYPE
    return msgpack.packb(body, use_bin_type=True)


def encode_batch_reply(group_frames: list[bytes], stale_dropped: int, filtered: int) -> bytes:
    """A BatchReply from already-encoded SampleGroup frames (what the buffer stores)."""
    body = {"groups": list(group_frames), "stale_dropped": int(stale_dropped), "filtered": int(filtered)}
    body["v"] = PROTOCOL_VERSION
    body["type"] = BatchReply.TYPE
    return msgpack.packb(body, use_bin_type=True)


def decode(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> AnyMessage:
    """Parse and validate one frame; raises ProtocolError on anything else."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise _err("bad_type", "frame must be bytes")
    if len(frame) > max_frame_bytes:
        raise _err("oversized", f"frame of {len(frame)} bytes exceeds {max_frame_bytes}")
    try:
        body = msgpack.unpackb(
            frame,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_no_ext,
            max_bin_len=max_frame_bytes,
            max_str_len=1 << 20,
            max_array_len=max(MAX_LIST_LEN, MAX_GROUP_SIZE),
            max_map_len=MAX_STATS + 16,
            max_ext_len=0,
        )
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


# ------------------------------------------------------------------- splicing stored frames (no decode)
#
# The buffer stores frames as received and serves them without decoding them again: these cut and join
# frames at msgpack entry boundaries. They assume frames that ``decode`` accepted (or that ``encode`` wrote);
# for those, the result is byte for byte what encoding the decoded messages again would give.

def _entries(u: msgpack.Unpacker, n: int) -> list[tuple[Any, int, int]]:
    """(key, start, end) of the next ``n`` map entries in ``u``: byte offsets of key + value."""
    out = []
    for _ in range(n):
        start = u.tell()
        key = u.unpack()
        u.skip()
        out.append((key, start, u.tell()))
    return out


def _unpacker(buf: bytes) -> msgpack.Unpacker:
    u = msgpack.Unpacker(raw=False, max_buffer_size=max(len(buf), 1), strict_map_key=False)
    u.feed(buf)
    return u


def _map_header(n: int) -> bytes:
    return msgpack.Packer().pack_map_header(n)  # a Packer holds a buffer: one per call, never shared


def _envelope(msg_type: str) -> bytes:
    """The ``v`` and ``type`` entries ``encode`` appends to every frame."""
    return b"".join(msgpack.packb(x) for x in ("v", PROTOCOL_VERSION, "type", msg_type))


_SAMPLE_ENVELOPE = _envelope(Sample.TYPE)
_POSITIVES_REPLY_ENVELOPE = _envelope(PositivesReply.TYPE)


def sample_frames(group_frame: bytes) -> list[bytes]:
    """The ``Sample`` frame of each sample of a ``SampleGroup`` frame, cut out of it (``encode(sample)``)."""
    u = _unpacker(group_frame)
    out: list[bytes] = []
    for _ in range(u.read_map_header()):
        if u.unpack() != "samples":
            u.skip()
            continue
        out = []  # a repeated key: the last one counts, as in decode
        for _ in range(u.read_array_header()):
            n = u.read_map_header()
            body = u.tell()
            for _ in range(2 * n):
                u.skip()
            out.append(_map_header(n + 2) + group_frame[body:u.tell()] + _SAMPLE_ENVELOPE)
    return out


def encode_positives_reply(frames: list[bytes]) -> bytes:
    """A PositivesReply from stored ``Sample`` frames (their fields copied, not decoded and encoded again)."""
    parts = [_map_header(3), msgpack.packb("samples"), msgpack.Packer().pack_array_header(len(frames))]
    for f in frames:
        u = _unpacker(f)
        kept = [(s, e) for k, s, e in _entries(u, u.read_map_header()) if k not in ("v", "type")]
        parts.append(_map_header(len(kept)))
        parts.extend(f[s:e] for s, e in kept)
    parts.append(_POSITIVES_REPLY_ENVELOPE)
    return b"".join(parts)


__all__ = [
    "PROTOCOL_VERSION", "DEFAULT_MAX_FRAME_BYTES", "ProtocolError", "Message", "AnyMessage", "Sample",
    "SampleGroup", "IngestAck", "CreditRequest", "CreditGrant", "BatchRequest", "BatchReply", "PositivesRequest",
    "PositivesReply", "StatsRequest", "StatsReply", "WeightUpdate", "WeightQuery", "ErrorReply",
    "PushJoin", "PushGroup", "PushVersion", "PushReady", "PushGo", "PushDone",
    "encode", "encode_batch_reply", "encode_positives_reply", "sample_frames", "decode", "decode_as",
    "FINISH_REASONS",
]
