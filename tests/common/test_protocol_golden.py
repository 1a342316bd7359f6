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


def _pinned_messages() -> dict[str, Message]:
    """One message of each type with fixed contents (what ``PINNED_HEX`` was recorded from)."""
    s = Sample(prompt_ids=np.array([1, 2], np.int32), output_ids=np.array([3], np.int32),
               output_logprobs=np.array([-0.5], np.float32), reward=1.0, finish_reason="stop", weight_version=2,
               response_length=1)
    g = SampleGroup(group_id="g1", prompt_id="p", task="t", actor_id=3, samples=[s], created_at=1.5)
    return {
        "Sample": s, "SampleGroup": g,
        "IngestAck": IngestAck(group_id="g1", committed=True, duplicate=False, error="stale"),
        "CreditRequest": CreditRequest(actor_id=3, n=2),
        "CreditGrant": CreditGrant(n=2, learner_version=7),
        "BatchRequest": BatchRequest(learner_version=7, n_groups=4, timeout_ms=5000),
        "BatchReply": BatchReply(groups=[g], stale_dropped=1, filtered=2),
        "PositivesRequest": PositivesRequest(n=8),
        "PositivesReply": PositivesReply(samples=[s]),
        "StatsRequest": StatsRequest(),
        "StatsReply": StatsReply(stats={"depth": 3.0}),
        "WeightUpdate": WeightUpdate(version=5, path="/w/v5", sha256="ab" * 32, created_at=2.25),
        "WeightQuery": WeightQuery(),
        "ErrorReply": ErrorReply(reason="timeout", message="no groups"),
    }


# The exact frames of protocol version 1, recorded from the encoder before the message classes were
# rewritten as declared dataclasses: a change here is a wire-format change (bump PROTOCOL_VERSION).
PINNED_HEX = {
    "Sample": (
        "89aa70726f6d70745f69647383a56474797065a33c6934a16e02a464617461c4080100000002000000aa6f7574707574"
        "5f69647383a56474797065a33c6934a16e01a464617461c40403000000af6f75747075745f6c6f6770726f627383a564"
        "74797065a33c6634a16e01a464617461c404000000bfa6726577617264cb3ff0000000000000ad66696e6973685f7265"
        "61736f6ea473746f70ae7765696768745f76657273696f6e02af726573706f6e73655f6c656e67746801a17601a47479"
        "7065a653616d706c65"
    ),
    "SampleGroup": (
        "88a867726f75705f6964a26731a970726f6d70745f6964a170a47461736ba174a86163746f725f696403a773616d706c"
        "65739187aa70726f6d70745f69647383a56474797065a33c6934a16e02a464617461c4080100000002000000aa6f7574"
        "7075745f69647383a56474797065a33c6934a16e01a464617461c40403000000af6f75747075745f6c6f6770726f6273"
        "83a56474797065a33c6634a16e01a464617461c404000000bfa6726577617264cb3ff0000000000000ad66696e697368"
        "5f726561736f6ea473746f70ae7765696768745f76657273696f6e02af726573706f6e73655f6c656e67746801aa6372"
        "65617465645f6174cb3ff8000000000000a17601a474797065ab53616d706c6547726f7570"
    ),
    "IngestAck": (
        "86a867726f75705f6964a26731a9636f6d6d6974746564c3a96475706c6963617465c2a56572726f72a57374616c65a1"
        "7601a474797065a9496e6765737441636b"
    ),
    "CreditRequest": "84a86163746f725f696403a16e02a17601a474797065ad43726564697452657175657374",
    "CreditGrant": "84a16e02af6c6561726e65725f76657273696f6e07a17601a474797065ab4372656469744772616e74",
    "BatchRequest": (
        "85af6c6561726e65725f76657273696f6e07a86e5f67726f75707304aa74696d656f75745f6d73cd1388a17601a47479"
        "7065ac426174636852657175657374"
    ),
    "BatchReply": (
        "85a667726f75707391c5011588a867726f75705f6964a26731a970726f6d70745f6964a170a47461736ba174a8616374"
        "6f725f696403a773616d706c65739187aa70726f6d70745f69647383a56474797065a33c6934a16e02a464617461c408"
        "0100000002000000aa6f75747075745f69647383a56474797065a33c6934a16e01a464617461c40403000000af6f7574"
        "7075745f6c6f6770726f627383a56474797065a33c6634a16e01a464617461c404000000bfa6726577617264cb3ff000"
        "0000000000ad66696e6973685f726561736f6ea473746f70ae7765696768745f76657273696f6e02af726573706f6e73"
        "655f6c656e67746801aa637265617465645f6174cb3ff8000000000000a17601a474797065ab53616d706c6547726f75"
        "70ad7374616c655f64726f7070656401a866696c746572656402a17601a474797065aa42617463685265706c79"
    ),
    "PositivesRequest": "83a16e08a17601a474797065b0506f7369746976657352657175657374",
    "PositivesReply": (
        "83a773616d706c65739187aa70726f6d70745f69647383a56474797065a33c6934a16e02a464617461c4080100000002"
        "000000aa6f75747075745f69647383a56474797065a33c6934a16e01a464617461c40403000000af6f75747075745f6c"
        "6f6770726f627383a56474797065a33c6634a16e01a464617461c404000000bfa6726577617264cb3ff0000000000000"
        "ad66696e6973685f726561736f6ea473746f70ae7765696768745f76657273696f6e02af726573706f6e73655f6c656e"
        "67746801a17601a474797065ae506f736974697665735265706c79"
    ),
    "StatsRequest": "82a17601a474797065ac537461747352657175657374",
    "StatsReply": "83a5737461747381a56465707468cb4008000000000000a17601a474797065aa53746174735265706c79",
    "WeightUpdate": (
        "86a776657273696f6e05a470617468a52f772f7635a6736861323536d940616261626162616261626162616261626162"
        "61626162616261626162616261626162616261626162616261626162616261626162616261626162616261626162aa63"
        "7265617465645f6174cb4002000000000000a17601a474797065ac576569676874557064617465"
    ),
    "WeightQuery": "82a17601a474797065ab5765696768745175657279",
    "ErrorReply": (
        "84a6726561736f6ea774696d656f7574a76d657373616765a96e6f2067726f757073a17601a474797065aa4572726f72"
        "5265706c79"
    ),
}


@pytest.mark.parametrize("name", sorted(PINNED_HEX))
def test_wire_bytes_are_pinned(name: str) -> None:
    msg = _pinned_messages()[name]
    frame = encode(msg)
    assert frame.hex() == PINNED_HEX[name]
    assert decode(frame, 1 << 20) == msg and type(decode(frame, 1 << 20)).__name__ == name


def _write() -> None:
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps({k: f().hex() for k, f in golden_cases().items()}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    _write()
