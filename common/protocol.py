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

Messages are declared dataclasses; the flat ones (requests, acks, grants, errors) are frozen.
``decode`` returns the union ``AnyMessage``; ``decode_as(frame, Cls)`` returns a ``Cls``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
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


# ------------------------------------------------------------------------------------------ field kinds


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


def _check_nonneg(name: str, v: Any) -> int:
    return _check_int(name, v, 0)


def _check_long_str(name: str, v: Any) -> str:
    return _check_str(name, v, MAX_LONG_STR_LEN)


def _check_sha256(name: str, v: Any) -> str:
    s = _check_str(name, v)
    if not _SHA256.match(s):
        raise _err("bad_value", f"{name} is not a lowercase hex sha256")
    return s


def _check_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _err("bad_type", f"{name} must be a bool, got {type(v).__name__}")
    return v


def _pack_array(a: np.ndarray, dtype: str) -> dict[str, Any]:
    a = np.ascontiguousarray(a, dtype=np.dtype(dtype))
    return {"dtype": dtype, "n": int(a.shape[0]), "data": a.tobytes()}


def _unpack_array(name: str, v: Any, dtype: str) -> np.ndarray:
    if not isinstance(v, dict):
        raise _err("bad_type", f"{name} must be an array map")
    if set(v) != {"dtype", "n", "data"}:
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
    dt = np.dtype(dtype)
    if len(data) != n * dt.itemsize:
        raise _err("length_mismatch", f"{name}: {len(data)} bytes for {n} x {dt.itemsize}")
    return np.frombuffer(data, dtype=dt)


# ------------------------------------------------------------------------------------------- messages


class Message:
    """Base of every top-level frame: ``TYPE`` names it on the wire, ``to_wire``/``from_wire`` map its fields.

    Equality compares wire values (arrays by content), so a decoded message equals the one encoded.
    """

    TYPE: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:  # pragma: no cover - overridden
        raise NotImplementedError

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Self:  # pragma: no cover - overridden
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and isinstance(other, Message) and _wire_equal(self.to_wire(), other.to_wire())


def _wire_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_wire_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_wire_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _expect_fields(name: str, d: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise _err("bad_type", f"{name} must be a map")
    keys = set(d)
    missing = [k for k in names if k not in keys]
    if missing:
        raise _err("missing_field", f"{name}: missing {', '.join(missing)}")
    extra = keys - set(names)
    if extra:
        raise _err("extra_field", f"{name}: unexpected {', '.join(sorted(map(str, extra)))}")
    return d


@dataclass(eq=False)
class Sample(Message):
    """One response to a prompt. ``output_logprobs`` are the behaviour policy's logprobs (engine)."""

    prompt_ids: np.ndarray  # [P] int32
    output_ids: np.ndarray  # [L] int32
    output_logprobs: np.ndarray  # [L] float32
    reward: float
    finish_reason: str
    weight_version: int
    response_length: int
    # Optional: [v0, n0, v1, n1, ...] int64, the weight version of each run of output tokens in order (an
    # update in place mid-generation gives several); absent on the wire when not given. min(v) == weight_version.
    version_spans: np.ndarray | None = None

    TYPE: ClassVar[str] = "Sample"
    _FIELDS: ClassVar[tuple[str, ...]] = (
        "prompt_ids", "output_ids", "output_logprobs", "reward", "finish_reason", "weight_version",
        "response_length",
    )

    def to_wire(self) -> dict[str, Any]:
        return {
            "prompt_ids": _pack_array(self.prompt_ids, "<i4"),
            "output_ids": _pack_array(self.output_ids, "<i4"),
            "output_logprobs": _pack_array(self.output_logprobs, "<f4"),
            "reward": float(self.reward),
            "finish_reason": self.finish_reason,
            "weight_version": int(self.weight_version),
            "response_length": int(self.response_length),
            **({} if self.version_spans is None else {"version_spans": _pack_array(self.version_spans, "<i8")}),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Sample:
        d = _expect_fields("Sample", d, cls._FIELDS + (("version_spans",) if isinstance(d, dict) and "version_spans" in d else ()))
        prompt_ids = _unpack_array("prompt_ids", d["prompt_ids"], "<i4")
        output_ids = _unpack_array("output_ids", d["output_ids"], "<i4")
        logprobs = _unpack_array("output_logprobs", d["output_logprobs"], "<f4")
        if prompt_ids.size and int(prompt_ids.min()) < 0:
            raise _err("bad_value", "prompt_ids has negative token ids")
        if output_ids.size and int(output_ids.min()) < 0:
            raise _err("bad_value", "output_ids has negative token ids")
        if logprobs.shape != output_ids.shape:
            raise _err("length_mismatch", f"{logprobs.shape[0]} logprobs for {output_ids.shape[0]} tokens")
        if logprobs.size and not bool(np.isfinite(logprobs).all()):
            raise _err("not_finite", "output_logprobs has non-finite values")
        length = _check_int("response_length", d["response_length"], 0, MAX_ARRAY_LEN)
        if length != output_ids.shape[0]:
            raise _err("length_mismatch", f"response_length {length} != {output_ids.shape[0]} output tokens")
        reason = _check_str("finish_reason", d["finish_reason"])
        if reason not in FINISH_REASONS:
            raise _err("bad_value", f"finish_reason {reason!r} not in {FINISH_REASONS}")
        version = _check_int("weight_version", d["weight_version"], 0)
        spans = None
        if "version_spans" in d:
            spans = _unpack_array("version_spans", d["version_spans"], "<i8")
            vs, ns = spans[0::2], spans[1::2]
            if spans.size % 2 or not spans.size or bool((ns < 1).any()) or bool((vs < 0).any()):
                raise _err("bad_value", "version_spans must be [version >= 0, n_tokens >= 1] pairs")
            if int(ns.sum()) != length or int(vs.min()) != version:
                raise _err("length_mismatch", f"version_spans cover {int(ns.sum())} tokens from version "
                           f"{int(vs.min())}; the sample has {length} from {version}")
        return cls(
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            output_logprobs=logprobs,
            reward=_check_float("reward", d["reward"]),
            finish_reason=reason,
            weight_version=version,
            response_length=length,
            version_spans=spans,
        )

    def token_versions(self) -> np.ndarray:
        """[L] int64: the weight version of each output token (``weight_version`` everywhere without spans)."""
        if self.version_spans is None:
            return np.full(self.response_length, self.weight_version, dtype=np.int64)
        return np.repeat(self.version_spans[0::2], self.version_spans[1::2])

    @property
    def nbytes(self) -> int:
        return 4 * (self.prompt_ids.size + 2 * self.output_ids.size) + 64


@dataclass(eq=False)
class SampleGroup(Message):
    """G samples of one prompt. ``group_id`` is unique and makes re-sends idempotent."""

    group_id: str
    prompt_id: str
    task: str
    actor_id: int
    samples: list[Sample]
    created_at: float

    TYPE: ClassVar[str] = "SampleGroup"
    _FIELDS: ClassVar[tuple[str, ...]] = ("group_id", "prompt_id", "task", "actor_id", "samples", "created_at")

    def to_wire(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt_id": self.prompt_id,
            "task": self.task,
            "actor_id": int(self.actor_id),
            "samples": [s.to_wire() for s in self.samples],
            "created_at": float(self.created_at),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SampleGroup:
        d = _expect_fields("SampleGroup", d, cls._FIELDS)
        group_id = _check_str("group_id", d["group_id"])
        if not group_id:
            raise _err("bad_value", "group_id is empty")
        samples = d["samples"]
        if not isinstance(samples, list):
            raise _err("bad_type", "samples must be a list")
        if not 1 <= len(samples) <= MAX_GROUP_SIZE:
            raise _err("bad_length", f"group of {len(samples)} samples outside [1, {MAX_GROUP_SIZE}]")
        return cls(
            group_id=group_id,
            prompt_id=_check_str("prompt_id", d["prompt_id"]),
            task=_check_str("task", d["task"]),
            actor_id=_check_int("actor_id", d["actor_id"], 0, 1 << 20),
            samples=[Sample.from_wire(s) for s in samples],
            created_at=_check_float("created_at", d["created_at"]),
        )

    @property
    def weight_version(self) -> int:
        """The group's version: the oldest weights any of its samples was generated with."""
        return min(s.weight_version for s in self.samples)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.samples)


# Flat messages: declared fields, wire order = field order; ``from_wire`` checks each field's kind.


@dataclass(frozen=True, eq=False)
class IngestAck(Message):
    """Buffer -> actor: the fate of one group (see ``buffer.server``)."""

    group_id: str
    committed: bool
    duplicate: bool
    error: str

    TYPE: ClassVar[str] = "IngestAck"
    _FIELDS: ClassVar[tuple[str, ...]] = ("group_id", "committed", "duplicate", "error")

    def to_wire(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "committed": self.committed, "duplicate": self.duplicate,
                "error": self.error}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> IngestAck:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(group_id=_check_str("group_id", d["group_id"]), committed=_check_bool("committed", d["committed"]),
                   duplicate=_check_bool("duplicate", d["duplicate"]), error=_check_long_str("error", d["error"]))


@dataclass(frozen=True, eq=False)
class CreditRequest(Message):
    """Actor -> buffer: "I want ``n`` more groups' worth of credit" (``n = 0`` withdraws the request)."""

    actor_id: int
    n: int

    TYPE: ClassVar[str] = "CreditRequest"
    _FIELDS: ClassVar[tuple[str, ...]] = ("actor_id", "n")

    def to_wire(self) -> dict[str, Any]:
        return {"actor_id": int(self.actor_id), "n": int(self.n)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> CreditRequest:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(actor_id=_check_nonneg("actor_id", d["actor_id"]), n=_check_nonneg("n", d["n"]))


@dataclass(frozen=True, eq=False)
class CreditGrant(Message):
    """Buffer -> actor: ``n`` groups may be generated, with weights at least ``learner_version``."""

    n: int
    learner_version: int

    TYPE: ClassVar[str] = "CreditGrant"
    _FIELDS: ClassVar[tuple[str, ...]] = ("n", "learner_version")

    def to_wire(self) -> dict[str, Any]:
        return {"n": int(self.n), "learner_version": int(self.learner_version)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> CreditGrant:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(n=_check_nonneg("n", d["n"]), learner_version=_check_nonneg("learner_version", d["learner_version"]))


@dataclass(frozen=True, eq=False)
class BatchRequest(Message):
    """Learner -> buffer: ``n_groups`` groups for ``learner_version``, waiting at most ``timeout_ms``."""

    learner_version: int
    n_groups: int
    timeout_ms: int

    TYPE: ClassVar[str] = "BatchRequest"
    _FIELDS: ClassVar[tuple[str, ...]] = ("learner_version", "n_groups", "timeout_ms")

    def to_wire(self) -> dict[str, Any]:
        return {"learner_version": int(self.learner_version), "n_groups": int(self.n_groups),
                "timeout_ms": int(self.timeout_ms)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> BatchRequest:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(learner_version=_check_nonneg("learner_version", d["learner_version"]),
                   n_groups=_check_nonneg("n_groups", d["n_groups"]),
                   timeout_ms=_check_nonneg("timeout_ms", d["timeout_ms"]))


@dataclass(frozen=True, eq=False)
class PositivesRequest(Message):
    """Learner -> buffer: up to ``n`` stored positives."""

    n: int

    TYPE: ClassVar[str] = "PositivesRequest"
    _FIELDS: ClassVar[tuple[str, ...]] = ("n",)

    def to_wire(self) -> dict[str, Any]:
        return {"n": int(self.n)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PositivesRequest:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(n=_check_nonneg("n", d["n"]))


@dataclass(frozen=True, eq=False)
class StatsRequest(Message):
    """Anyone -> buffer: its counters, answered by ``StatsReply``."""

    TYPE: ClassVar[str] = "StatsRequest"

    def to_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> StatsRequest:
        _expect_fields(cls.TYPE, d, ())
        return cls()


@dataclass(frozen=True, eq=False)
class WeightUpdate(Message):
    """Learner -> actors: weights ``version`` are at ``path`` (digest ``sha256``), written at ``created_at``."""

    version: int
    path: str
    sha256: str
    created_at: float

    TYPE: ClassVar[str] = "WeightUpdate"
    _FIELDS: ClassVar[tuple[str, ...]] = ("version", "path", "sha256", "created_at")

    def to_wire(self) -> dict[str, Any]:
        return {"version": int(self.version), "path": self.path, "sha256": self.sha256,
                "created_at": float(self.created_at)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> WeightUpdate:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(version=_check_nonneg("version", d["version"]), path=_check_long_str("path", d["path"]),
                   sha256=_check_sha256("sha256", d["sha256"]), created_at=_check_float("created_at", d["created_at"]))


@dataclass(frozen=True, eq=False)
class WeightQuery(Message):
    """Actor -> learner: the latest ``WeightUpdate`` please (late subscribers, missed publications)."""

    TYPE: ClassVar[str] = "WeightQuery"

    def to_wire(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> WeightQuery:
        _expect_fields(cls.TYPE, d, ())
        return cls()


def _check_buckets(v: Any) -> list[dict[str, Any]]:
    """``PushGroup.buckets``: each ``{"names": [str], "dtypes": [str], "shapes": [[int]]}``, one length."""
    if not isinstance(v, list) or len(v) > MAX_LIST_LEN:
        raise _err("bad_type", f"buckets must be a list of at most {MAX_LIST_LEN}")
    out = []
    for b in v:
        b = _expect_fields("bucket", b, ("names", "dtypes", "shapes"))
        names, dtypes, shapes = b["names"], b["dtypes"], b["shapes"]
        if not all(isinstance(x, list) for x in (names, dtypes, shapes)) or not len(names) == len(dtypes) == len(shapes):
            raise _err("bad_value", "bucket: names, dtypes and shapes must be lists of one length")
        out.append({"names": [_check_str("name", n) for n in names], "dtypes": [_check_str("dtype", d) for d in dtypes],
                    "shapes": [[_check_nonneg("dim", x) for x in (sh if isinstance(sh, list) else [None])] for sh in shapes]})
    return out


@dataclass(frozen=True, eq=False)
class PushJoin(Message):
    """Actor -> learner (push socket): engine ``actor_id`` is up, started at ``engine_start`` (a new value
    after each restart); include it in the next weight-update group."""

    actor_id: int
    engine_start: int

    TYPE: ClassVar[str] = "PushJoin"
    _FIELDS: ClassVar[tuple[str, ...]] = ("actor_id", "engine_start")

    def to_wire(self) -> dict[str, Any]:
        return {"actor_id": int(self.actor_id), "engine_start": int(self.engine_start)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PushJoin:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(actor_id=_check_nonneg("actor_id", d["actor_id"]), engine_start=_check_int("engine_start", d["engine_start"]))


@dataclass(frozen=True, eq=False)
class PushGroup(Message):
    """Learner -> actor: join group ``epoch`` (SGLang's ``/init_weights_update_group`` fields) and expect
    every pushed version as ``buckets`` (each one ``/update_weights_from_distributed``'s names, dtypes, shapes)."""

    epoch: int
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    buckets: list[dict[str, Any]]

    TYPE: ClassVar[str] = "PushGroup"
    _FIELDS: ClassVar[tuple[str, ...]] = ("epoch", "master_address", "master_port", "rank_offset", "world_size",
                                          "group_name", "backend", "buckets")

    def to_wire(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._FIELDS}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PushGroup:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(epoch=_check_nonneg("epoch", d["epoch"]), master_address=_check_str("master_address", d["master_address"]),
                   master_port=_check_int("master_port", d["master_port"], 1, 65535),
                   rank_offset=_check_int("rank_offset", d["rank_offset"], 1), world_size=_check_int("world_size", d["world_size"], 2),
                   group_name=_check_str("group_name", d["group_name"]), backend=_check_str("backend", d["backend"]),
                   buckets=_check_buckets(d["buckets"]))


@dataclass(frozen=True, eq=False)
class PushVersion(Message):
    """Learner -> actor: version ``version`` is being broadcast on group ``epoch`` now: post its buckets."""

    epoch: int
    version: int

    TYPE: ClassVar[str] = "PushVersion"
    _FIELDS: ClassVar[tuple[str, ...]] = ("epoch", "version")

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": int(self.epoch), "version": int(self.version)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PushVersion:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(epoch=_check_nonneg("epoch", d["epoch"]), version=_check_nonneg("version", d["version"]))


@dataclass(frozen=True, eq=False)
class PushDone(Message):
    """Actor -> learner: its engine joined group ``epoch`` (``version`` -1) or loaded ``version`` (``ok``),
    with generation paused ``pause_s``; ``message`` says why not."""

    actor_id: int
    epoch: int
    version: int
    ok: bool
    pause_s: float
    message: str

    TYPE: ClassVar[str] = "PushDone"
    _FIELDS: ClassVar[tuple[str, ...]] = ("actor_id", "epoch", "version", "ok", "pause_s", "message")

    def to_wire(self) -> dict[str, Any]:
        return {"actor_id": int(self.actor_id), "epoch": int(self.epoch), "version": int(self.version), "ok": bool(self.ok),
                "pause_s": float(self.pause_s), "message": self.message}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PushDone:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(actor_id=_check_nonneg("actor_id", d["actor_id"]), epoch=_check_nonneg("epoch", d["epoch"]),
                   version=_check_int("version", d["version"], -1), ok=_check_bool("ok", d["ok"]),
                   pause_s=_check_float("pause_s", d["pause_s"]), message=_check_long_str("message", d["message"]))


@dataclass(frozen=True, eq=False)
class ErrorReply(Message):
    """Any server -> client when a request cannot be served; ``reason`` is a short label."""

    reason: str
    message: str

    TYPE: ClassVar[str] = "ErrorReply"
    _FIELDS: ClassVar[tuple[str, ...]] = ("reason", "message")

    def to_wire(self) -> dict[str, Any]:
        return {"reason": self.reason, "message": self.message}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ErrorReply:
        d = _expect_fields(cls.TYPE, d, cls._FIELDS)
        return cls(reason=_check_str("reason", d["reason"]), message=_check_long_str("message", d["message"]))


@dataclass(eq=False)
class BatchReply(Message):
    """Groups for one learner step, oldest weight version first, plus what was dropped on the way."""

    groups: list[SampleGroup]
    stale_dropped: int
    filtered: int

    TYPE: ClassVar[str] = "BatchReply"
    _FIELDS: ClassVar[tuple[str, ...]] = ("groups", "stale_dropped", "filtered")

    def to_wire(self) -> dict[str, Any]:
        return {
            "groups": [encode(g) for g in self.groups],
            "stale_dropped": int(self.stale_dropped),
            "filtered": int(self.filtered),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> BatchReply:
        d = _expect_fields("BatchReply", d, cls._FIELDS)
        frames = d["groups"]
        if not isinstance(frames, list) or len(frames) > MAX_LIST_LEN:
            raise _err("bad_type", f"groups must be a list of at most {MAX_LIST_LEN} frames")
        groups = []
        for fr in frames:
            if not isinstance(fr, bytes):
                raise _err("bad_type", "groups must hold encoded SampleGroup frames")
            g = decode(fr, max_frame_bytes=len(fr))
            if not isinstance(g, SampleGroup):
                raise _err("bad_type", "groups must hold SampleGroup frames")
            groups.append(g)
        return cls(
            groups=groups,
            stale_dropped=_check_int("stale_dropped", d["stale_dropped"], 0),
            filtered=_check_int("filtered", d["filtered"], 0),
        )


@dataclass(eq=False)
class PositivesReply(Message):
    """Stored verified-correct samples for NLL replay."""

    samples: list[Sample]

    TYPE: ClassVar[str] = "PositivesReply"

    def to_wire(self) -> dict[str, Any]:
        return {"samples": [s.to_wire() for s in self.samples]}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PositivesReply:
        d = _expect_fields("PositivesReply", d, ("samples",))
        if not isinstance(d["samples"], list) or len(d["samples"]) > MAX_LIST_LEN:
            raise _err("bad_type", "samples must be a list")
        return cls(samples=[Sample.from_wire(s) for s in d["samples"]])


@dataclass(eq=False)
class StatsReply(Message):
    """Named numeric counters of a server (buffer depth, drops, ...)."""

    stats: dict[str, float] = field(default_factory=dict)

    TYPE: ClassVar[str] = "StatsReply"

    def to_wire(self) -> dict[str, Any]:
        return {"stats": {k: float(v) for k, v in self.stats.items()}}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> StatsReply:
        d = _expect_fields("StatsReply", d, ("stats",))
        st = d["stats"]
        if not isinstance(st, dict) or len(st) > MAX_STATS:
            raise _err("bad_type", "stats must be a map")
        return cls(stats={_check_str("stats key", k): _check_float(f"stats[{k}]", v) for k, v in st.items()})


AnyMessage = (
    Sample | SampleGroup | IngestAck | CreditRequest | CreditGrant | BatchRequest | BatchReply | PositivesRequest
    | PositivesReply | StatsRequest | StatsReply | WeightUpdate | WeightQuery | ErrorReply | PushJoin | PushGroup
    | PushVersion | PushDone
)
_ALL: tuple[type[AnyMessage], ...] = (
    Sample, SampleGroup, IngestAck, CreditRequest, CreditGrant, BatchRequest, BatchReply,
    PositivesRequest, PositivesReply, StatsRequest, StatsReply, WeightUpdate, WeightQuery, ErrorReply,
    PushJoin, PushGroup, PushVersion, PushDone,
)
MESSAGE_TYPES: dict[str, type[AnyMessage]] = {cls.TYPE: cls for cls in _ALL}
M = TypeVar("M", bound=Message)


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
    "PushJoin", "PushGroup", "PushVersion", "PushDone",
    "encode", "encode_batch_reply", "encode_positives_reply", "sample_frames", "decode", "decode_as",
    "FINISH_REASONS",
]
