"""common.wire.pack: the bytes of ``msgpack.packb``, from one packer per thread that a large frame or a
failed pack retires."""

from __future__ import annotations

import dataclasses
import threading

import msgpack
import numpy as np
import pytest

from common import wire


def _bodies() -> list[dict[str, object]]:
    data = np.arange(1000, dtype="<i4").tobytes()
    return [{}, {"a": 1, "b": -1, "c": 2**40, "d": 1.5, "e": "x" * 300, "f": True, "g": None, "h": b"\x00" * 70_000},
            {"samples": [{"ids": {"dtype": "<i4", "n": 1000, "data": data}, "r": 0.0}] * 16, "v": 1, "type": "T"}]


def test_pack_gives_packbs_bytes_again_and_again() -> None:
    for _ in range(3):  # the same packer, reused
        for body in _bodies():
            assert wire.pack(body) == msgpack.packb(body, use_bin_type=True)


def test_a_large_frame_retires_the_threads_packer_and_a_failed_pack_leaves_none_half_full(
        monkeypatch: pytest.MonkeyPatch) -> None:
    wire.pack({"a": 1})
    kept = wire._packers.packer
    wire.pack({"a": b"\x00" * 100})
    assert wire._packers.packer is kept  # small frames: one packer
    monkeypatch.setattr(wire, "KEEP_PACKER_BYTES", 1000)
    assert wire.pack({"a": b"\x01" * 2000}) == msgpack.packb({"a": b"\x01" * 2000}, use_bin_type=True)
    assert wire._packers.packer is None  # its buffer grew to 2 KB: retired
    with pytest.raises(TypeError):
        wire.pack({"a": 1, "b": object()})  # "a" was packed before the failure
    assert wire._packers.packer is None
    assert wire.pack({"c": 2}) == msgpack.packb({"c": 2}, use_bin_type=True)  # nothing of the failed frame


def test_each_thread_packs_with_its_own_packer() -> None:
    seen: list[object] = []

    def work() -> None:
        assert wire.pack({"t": 1}) == msgpack.packb({"t": 1}, use_bin_type=True)
        seen.append(wire._packers.packer)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(p) for p in seen}) == 3


def test_a_message_travels_under_its_class_name() -> None:
    """``@wire_message`` names the type on the wire after the class: nothing to spell by hand or keep in step."""

    @wire.wire_message
    @dataclasses.dataclass(frozen=True, eq=False)
    class Probe(wire.Message):
        n: int = wire.wire_int(lo=0)

    assert Probe.TYPE == "Probe" and wire.Message.TYPE == ""
    assert Probe(n=3).to_wire() == {"n": 3}  # the type and version are the frame's, added by encode
