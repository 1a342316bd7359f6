"""Stored frames cut and joined without a decode: the buffer stores each group frame as it arrived and serves
it, and the positives it harvests from it, without decoding them again (``sample_frames`` cuts a group's
samples out as frames; ``encode_positives_reply`` joins sample frames into a ``PositivesReply``). They cut at
msgpack entry boundaries and assume frames that ``common.protocol.decode`` accepted (or ``encode`` wrote); for
those, the result is byte for byte what encoding the decoded messages again would give.
"""

from __future__ import annotations

from typing import Any

import msgpack

from common.protocol import PROTOCOL_VERSION, PositivesReply, Sample


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
