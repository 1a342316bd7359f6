"""The wire's building blocks, under the messages of ``common.protocol``: the limits, ``ProtocolError``, the
checks of single values, the field kinds a message declares (``wire_int``, ``wire_array``, ...), the schema
they build, and ``Message``, whose ``to_wire``/``from_wire`` that schema drives. Nothing here names a message;
``common.protocol`` defines them (and re-exports what its users import from here).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Sequence
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


# ------------------------------------------------------------------------------------------ packing

KEEP_PACKER_BYTES = 8 << 20  # a thread keeps its packer while frames stay under this (its buffer grows to fit)
_packers = threading.local()


def pack(body: dict[str, Any]) -> bytes:
    """``body`` as msgpack (``use_bin_type``), bytes equal to ``msgpack.packb``'s, through this thread's packer:
    ``packb`` makes a packer, and with it a 1 MiB buffer, per call, which costs a group frame more than packing
    it does (pages faulted in, then unmapped: 158 us against 20 for a 137 KB group on an EPYC). A frame over
    ``KEEP_PACKER_BYTES`` retires the thread's packer, so a thread holds no more than that after a large one."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    try:
        out = packer.pack(body)
    except BaseException:
        _packers.packer = None  # whatever it holds half-packed goes with it
        raise
    if len(out) > KEEP_PACKER_BYTES:
        _packers.packer = None
    return out


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

    np_dtype = np.dtype(dtype)
    itemsize = np_dtype.itemsize

    def check(name: str, value: Any) -> np.ndarray:
        # The usual array map inline (the samples outside protocol's one-pass path decode 3 or 4 each); anything
        # unusual gets the full checks, and their message, from _unpack_array.
        if type(value) is dict and len(value) == 3:
            data, n = value.get("data"), value.get("n")
            if (type(data) is bytes and type(n) is int and 0 <= n <= MAX_ARRAY_LEN and len(data) == n * itemsize
                    and value.get("dtype") == dtype):
                return np.frombuffer(data, dtype=np_dtype)
        return _unpack_array(name, value, dtype)

    def values(name: str, array: np.ndarray) -> None:
        if nonneg and array.size and int(array.min()) < 0:
            raise _err("bad_value", f"{name} has negative token ids")
        if finite and array.size and not bool(np.isfinite(array).all()):
            raise _err("not_finite", f"{name} has non-finite values")

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
    """Base of every top-level frame: ``TYPE`` (the class's name, set by ``@wire_message``) names it on the
    wire; its ``SCHEMA`` (built by ``@wire_message`` from the dataclass fields) drives ``to_wire``/``from_wire``.

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


def check_values(msgs: Sequence[Message]) -> None:
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
    """Class decorator after ``@dataclass``: name the type on the wire after the class (``TYPE``), build the
    schema, and give the class its own ``to_wire`` and ``from_wire`` entries (so one message type's codec can
    be wrapped without touching the others')."""
    cls.TYPE = cls.__name__
    cls.SCHEMA = Schema.of(cls)
    # Rebinding a method on purpose (a per-class entry to wrap), which mypy forbids for methods.
    cls.to_wire = Message.to_wire  # type: ignore[method-assign]
    # The same for the classmethod: re-wrap its function; typeshed has no __func__ on a bound classmethod.
    cls.from_wire = classmethod(Message.from_wire.__func__)  # type: ignore[assignment, attr-defined]
    return cls
