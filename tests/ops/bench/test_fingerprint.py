"""ops/bench/fingerprint.py: its digests repeat on the same code and inputs, and move when the inputs do."""

from __future__ import annotations

from pathlib import Path

from ops.bench import fingerprint

ROOT = Path(__file__).resolve().parents[3]


def test_learner_step_fingerprint_repeats_and_follows_the_data(tiny_model_dir: Path) -> None:
    first = fingerprint.learner_fingerprint(tiny_model_dir)
    second = fingerprint.learner_fingerprint(tiny_model_dir)
    assert first == second
    assert first["grad_events"] > 0
    other = fingerprint.learner_fingerprint(tiny_model_dir, data_seed=4)
    for key in ("policy", "critic", "stats", "grads"):
        assert len(first[key]) == 64 and other[key] != first[key], key
    grpo = fingerprint.learner_fingerprint(tiny_model_dir, extra=fingerprint.LEARNER_VARIANTS["grpo_decoupled"])
    assert grpo["critic"] == "none" and grpo["policy"] != first["policy"]


def test_wire_fingerprint_repeats_and_frames_decode_back() -> None:
    first = fingerprint.wire_fingerprint()
    assert first == fingerprint.wire_fingerprint()
    assert first["decode_reencodes_equal"] is True
    assert len(first["parts"]) == len(fingerprint.wire_messages()) + 1


def test_only_timing_values_are_blanked() -> None:
    raw = b'{"meta_info":{"id":"a","cached_tokens":0,"e2e_latency":0.0123,"x":1.5e-05},"e2e_latency": 2}'
    assert fingerprint.blank_volatile(raw) == b'{"meta_info":{"id":"a","cached_tokens":0,"e2e_latency":null,"x":1.5e-05},"e2e_latency": null}'
