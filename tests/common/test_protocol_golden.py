"""common.protocol: golden frames pin the wire bytes of every message and of the frame-splicing encoders.

How the golden file was made: ``golden_cases()`` below builds each instance, and
``.venv/bin/python -m tests.common.test_protocol_golden --write`` encoded them with the protocol code of
commit 1f13805 (before the message schemas were declared as dataclass field metadata) and wrote
``fixtures/golden_frames.json`` (name -> hex). Never regenerate it to make a test pass: a frame that changes is a
wire-format change (bump PROTOCOL_VERSION); only add new names for new messages or fields.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from common.protocol import (
    MESSAGE_TYPES,
    BatchReply,
    BatchRequest,
    CreditGrant,
    CreditRequest,
    ErrorReply,
    IngestAck,
    Message,
    PositivesReply,
    PositivesRequest,
    PushDone,
    PushGo,
    PushGroup,
    PushJoin,
    PushReady,
    PushVersion,
    Sample,
    SampleGroup,
    StatsReply,
    StatsRequest,
    WeightQuery,
    WeightUpdate,
    decode,
    encode,
    encode_batch_reply,
)
from common.splice import encode_positives_reply, sample_frames

GOLDEN = Path(__file__).parent / "fixtures" / "golden_frames.json"
INT64_MAX = (1 << 63) - 1


def _sample(n_out: int, version: int = 2, spans: list[int] | None = None, **changes: object) -> Sample:
    kw: dict[str, object] = {
        "prompt_ids": np.array([0, 7, 2**31 - 1], np.int32), "output_ids": np.arange(n_out, dtype=np.int32) * 1000,
        "output_logprobs": -np.linspace(0.0, 3.5, n_out, dtype=np.float32), "reward": 1.0, "finish_reason": "stop",
        "weight_version": version, "response_length": n_out,
        "version_spans": None if spans is None else np.array(spans, np.int64),
    }
    kw.update(changes)
    return Sample(**kw)  # type: ignore[arg-type]


def _samples() -> dict[str, Sample]:
    return {
        "Sample.plain": _sample(3),
        "Sample.empty": _sample(0, version=0, prompt_ids=np.zeros(0, np.int32), reward=0.0, finish_reason="abort"),
        "Sample.spans": _sample(4, version=5, spans=[5, 1, 6, 3], reward=-0.25, finish_reason="length"),
        "Sample.large": _sample(2, version=INT64_MAX, spans=[INT64_MAX, 2], reward=1e-300,
                                output_ids=np.array([0, 2**31 - 1], np.int32),
                                output_logprobs=np.array([-1e-38, -88.5], np.float32)),
        "Sample.int_reward": _sample(1, reward=3),
    }


def _groups() -> dict[str, SampleGroup]:
    s = _samples()
    return {
        "SampleGroup.one": SampleGroup(group_id="g1", prompt_id="p", task="t", actor_id=3, samples=[s["Sample.plain"]],
                                       created_at=1.5),
        "SampleGroup.mixed": SampleGroup(group_id="gé-ü/∞" + "x" * 490, prompt_id="", task="", actor_id=1 << 20,
                                         samples=list(s.values()), created_at=1_764_547_200.123456),
    }


def _messages() -> dict[str, Message]:
    s, g = _samples(), _groups()
    msgs: dict[str, Message] = {**s, **g}
    msgs.update({
        "IngestAck.committed": IngestAck(group_id="g1", committed=True, duplicate=False, error=""),
        "IngestAck.refused": IngestAck(group_id="", committed=False, duplicate=True, error="e" * 4096),
        "CreditRequest.zero": CreditRequest(actor_id=0, n=0),
        "CreditRequest.large": CreditRequest(actor_id=INT64_MAX, n=1 << 40),
        "CreditGrant": CreditGrant(n=2, learner_version=1 << 33),
        "BatchRequest": BatchRequest(learner_version=7, n_groups=512, timeout_ms=70_000),
        "PositivesRequest": PositivesRequest(n=8),
        "StatsRequest": StatsRequest(),
        "StatsReply.empty": StatsReply(),
        "StatsReply.some": StatsReply(stats={"depth": 3, "drops/stale": -1.5e12, "ü": 0.1}),
        "WeightUpdate": WeightUpdate(version=5, path="/w/v5 ü", sha256="0123456789abcdef" * 4, created_at=2.25),
        "WeightQuery": WeightQuery(),
        "ErrorReply.empty": ErrorReply(reason="", message=""),
        "ErrorReply.timeout": ErrorReply(reason="timeout", message="no groups within 5000 ms"),
        "PushJoin": PushJoin(actor_id=4, engine_start=-(1 << 63)),
        "PushGroup.no_buckets": PushGroup(epoch=0, master_address="127.0.0.1", master_port=1, rank_offset=1,
                                          world_size=2, group_name="g", backend="nccl", buckets=[]),
        "PushGroup.buckets": PushGroup(
            epoch=3, master_address="10.0.0.2", master_port=65535, rank_offset=1, world_size=9, group_name="vapo-3",
            backend="nccl", buckets=[{"names": ["a.weight", "b"], "dtypes": ["bfloat16", "float32"],
                                      "shapes": [[4096, 128], []]}, {"names": [], "dtypes": [], "shapes": []}]),
        "PushVersion": PushVersion(epoch=3, version=12),
        "PushReady.ok": PushReady(actor_id=1, epoch=3, version=12, ok=True, message=""),
        "PushReady.refused": PushReady(actor_id=2, epoch=3, version=12, ok=False,
                                       message="a weight-update session is already open"),
        "PushGo.go": PushGo(epoch=3, version=12, go=True),
        "PushGo.abandoned": PushGo(epoch=3, version=1 << 40, go=False),
        "PushDone.joined": PushDone(actor_id=1, epoch=3, version=-1, ok=True, pause_s=0.0, message=""),
        "PushDone.failed": PushDone(actor_id=2, epoch=3, version=12, ok=False, pause_s=1.25, message="NCCL timeout"),
        "BatchReply.empty": BatchReply(groups=[], stale_dropped=0, filtered=0),
        "BatchReply.two": BatchReply(groups=list(g.values()), stale_dropped=3, filtered=1 << 40),
        "PositivesReply.empty": PositivesReply(samples=[]),
        "PositivesReply.some": PositivesReply(samples=[s["Sample.spans"], s["Sample.plain"]]),
    })
    return msgs


def golden_cases() -> dict[str, Callable[[], bytes]]:
    """name -> a function giving that frame (a message's ``encode`` or one of the splicing encoders)."""
    s, g = _samples(), _groups()
    cases: dict[str, Callable[[], bytes]] = {k: (lambda m=m: encode(m)) for k, m in _messages().items()}
    frames = [encode(x) for x in g.values()]
    cases["encode_batch_reply.two"] = lambda: encode_batch_reply(frames, 3, 1 << 40)
    cases["encode_batch_reply.empty"] = lambda: encode_batch_reply([], 0, 0)
    for i in range(len(s)):
        cases[f"sample_frames.mixed.{i}"] = lambda i=i: sample_frames(frames[1])[i]
    cases["encode_positives_reply.mixed"] = lambda: encode_positives_reply(sample_frames(frames[1]))
    cases["encode_positives_reply.empty"] = lambda: encode_positives_reply([])
    return cases


def expected_messages() -> dict[str, Message]:
    """What each golden frame decodes to."""
    s, g = _samples(), _groups()
    out = _messages()
    out["encode_batch_reply.two"] = BatchReply(groups=list(g.values()), stale_dropped=3, filtered=1 << 40)
    out["encode_batch_reply.empty"] = BatchReply(groups=[], stale_dropped=0, filtered=0)
    for i, smp in enumerate(s.values()):
        out[f"sample_frames.mixed.{i}"] = smp
    out["encode_positives_reply.mixed"] = PositivesReply(samples=list(s.values()))
    out["encode_positives_reply.empty"] = PositivesReply(samples=[])
    return out


def _golden() -> dict[str, str]:
    return json.loads(GOLDEN.read_text())


def test_every_message_type_has_a_golden_frame() -> None:
    names = {k.split(".")[0] for k in _golden()}
    assert set(MESSAGE_TYPES) <= names
    assert {"encode_batch_reply", "encode_positives_reply", "sample_frames"} <= names
    assert set(_golden()) == set(golden_cases())


@pytest.mark.parametrize("name", sorted(golden_cases()))
def test_golden_frame_decodes_and_re_encodes_byte_for_byte(name: str) -> None:
    frame = bytes.fromhex(_golden()[name])
    msg = decode(frame, 1 << 20)
    want = expected_messages()[name]
    assert type(msg) is type(want) and msg == want
    if name.split(".")[0] in MESSAGE_TYPES:  # a plain message's name starts with its type
        assert type(msg).__name__ == name.split(".")[0]
    assert encode(msg) == frame


@pytest.mark.parametrize("name", sorted(golden_cases()))
def test_building_the_same_instance_today_gives_the_golden_bytes(name: str) -> None:
    assert golden_cases()[name]().hex() == _golden()[name]


def _write() -> None:
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps({k: f().hex() for k, f in golden_cases().items()}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    _write()
