"""FrameRejections counts each refused frame by reason (stats and metric) and answers an ErrorReply."""

from __future__ import annotations

import zmq

from buffer.frames import FrameRejections, client_key
from common.metrics import Metrics
from common.protocol import ErrorReply, decode
from common.security import ServerCurve


def test_rejections_are_counted_by_reason_and_answered_with_a_bounded_error() -> None:
    metrics = Metrics("buffer")
    rejections = FrameRejections(metrics)
    reply = decode(rejections.reject("multipart", "x" * 5000))
    assert isinstance(reply, ErrorReply) and reply.reason == "multipart" and len(reply.message) == 4000
    rejections.reject("multipart", "again")
    rejections.reject("role", "no")
    assert rejections.by_reason == {"multipart": 2, "role": 1} and rejections.total == 3
    value = metrics.registry.get_sample_value("vapo_buffer_rejected_frames_total", {"reason": "multipart"})
    assert value == 2.0


def test_without_curve_no_frame_has_a_client_key() -> None:
    assert client_key(ServerCurve(None, None), zmq.Frame(b"anything")) is None
