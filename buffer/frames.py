"""What the buffer does with any frame it cannot use, on either socket, and whose key sent a frame.

Not a CLI; used by the buffer's roles (``buffer.ingest``, ``buffer.serving``, ``buffer.admission``) and
``buffer.server``.
"""

from __future__ import annotations

import zmq

from common.metrics import Metrics
from common.protocol import ErrorReply, encode
from common.security import ServerCurve


class FrameRejections:
    """Refused frames by reason: counted for ``StatsReply`` (``rejected_*``) and
    ``vapo_buffer_rejected_frames{reason}``, answered with an ``ErrorReply``."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.by_reason: dict[str, int] = {}

    def reject(self, reason: str, message: str) -> bytes:
        """Count one refused frame; returns the encoded ``ErrorReply`` to send back."""
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        self.metrics.rejected_frames.labels(reason=reason).inc()
        return encode(ErrorReply(reason=reason, message=message[:4000]))

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())


def client_key(curve: ServerCurve, frame: zmq.Frame) -> str | None:
    """The sender's CURVE public key (ZAP User-Id, z85) when CurveZMQ is on, else None."""
    if not curve.enabled:
        return None
    try:
        user = frame.get("User-Id")  # a str for this property (pyzmq types every property's value as int | str)
        return user if isinstance(user, str) and user else None
    except zmq.ZMQError:
        return None
