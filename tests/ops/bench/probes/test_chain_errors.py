"""ops/bench/probes/chain_errors.py: the kind of a chain response's first mistake."""

from __future__ import annotations

from pathlib import Path

from ops.bench.probes import chain_errors

ROOT = Path(__file__).resolve().parents[4]


def test_chain_error_kinds() -> None:
    want = "02:3+7=0\n01:0+7=7\n00:7+7=4\nA:4"
    cases = {
        want: "ok",
        "02:3+7=1\n01:1+7=8\n00:8+7=5\nA:5": "slip",          # one too high: the teacher's mistake
        "02:3+7=9\n01:9+7=6\n00:6+7=3\nA:3": "wrong sum",
        "02:3+7=0\n11:0+7=7": "counter",
        "02:3+7=0\n01:1+7=8\n00:8+7=5\nA:5": "copy",
        "02:3+7=0\n01:0+7=7": "stopped early",
        want + "\n": "did not stop",
        "02:3+7=0\n01:0+7=7\n00:7+7=4\nA:5": "answer line",
        "02:3*7=0": "format",
    }
    for response, kind in cases.items():
        assert chain_errors.first_mistake_kind(response, want) == kind, response
