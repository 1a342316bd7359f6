"""common.splice: sample frames cut out of a stored group frame and joined into a PositivesReply are byte for
byte what encoding the decoded messages gives (random groups in tests/common/test_protocol.py)."""

from __future__ import annotations

import numpy as np

from common.protocol import PROTOCOL_VERSION, PositivesReply, Sample, SampleGroup, decode, encode
from common.splice import encode_positives_reply, sample_frames


def _sample(i: int) -> Sample:
    return Sample(prompt_ids=np.array([1, 2], np.int32), output_ids=np.array([3 + i], np.int32),
                  output_logprobs=np.array([-0.5], np.float32), reward=float(i), finish_reason="stop",
                  weight_version=i, response_length=1)


def test_cut_samples_and_a_joined_reply_equal_encoding_again() -> None:
    samples = [_sample(0), _sample(1)]
    group = encode(SampleGroup(group_id="g", prompt_id="p", task="t", actor_id=0, samples=samples, created_at=1.0))
    cut = sample_frames(group)
    assert cut == [encode(s) for s in samples]
    reply = encode_positives_reply(cut[1:])
    assert reply == encode(PositivesReply(samples=samples[1:]))
    assert decode(reply) == PositivesReply(samples=[samples[1]])


def test_an_empty_reply_is_three_entries_by_hand() -> None:
    """fixmap(3) {"samples": [], "v": PROTOCOL_VERSION, "type": "PositivesReply"} in msgpack, written out."""
    want = b"\x83" + b"\xa7samples" + b"\x90" + b"\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa4type" + b"\xaePositivesReply"
    assert encode_positives_reply([]) == want == encode(PositivesReply(samples=[]))
