"""ops/bench/memory.py: the padding figure on a hand-checked batch, and (slow) a tiny end-to-end run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ops.bench import memory

ROOT = Path(__file__).resolve().parents[3]
BENCH = ("-m", "ops.bench.memory")


def test_padding_waste_counts_padding_and_fillers() -> None:
    # Rows of 10, 10, 2, 2 tokens (prompt 1 + response): one mini-batch, one rank, 2 rows per micro-batch (budget
    # 2 x 10): sorted longest first, [10, 10] and [2, 2], no padding.
    p, r = [1, 1, 1, 1], [9, 1, 9, 1]
    assert memory.padding_waste(p, r, 1, 1, 2, 0) == 0.0
    # Two ranks, budget 10 tokens: the deal gives each rank a 10 and a 2 (longest first to the least loaded), each
    # cut into [10] and [2]: the same count on both ranks, no filler, no padding.
    assert memory.padding_waste(p, r, 1, 2, 8, 10) == 0.0
    # Three rows [10, 2, 2] on two ranks, rows only (budget 8 x 10): rank 0 gets the 10, rank 1 both 2s, one
    # micro-batch each: [10] and [2, 2], no padding.
    assert memory.padding_waste([1, 1, 1], [9, 1, 1], 1, 2, 8, 0) == 0.0
    # A 10 and a 2 on one rank in one micro-batch: padded to 2 x 10 = 20 for 12 real tokens.
    assert memory.padding_waste([1, 1], [9, 1], 1, 1, 8, 0) == round(1 - 12 / 20, 4)


@pytest.mark.slow
def test_tiny_run_reports_every_field() -> None:
    p = subprocess.run([sys.executable, *BENCH, "--t", "32,64", "--vocab", "2048,256", "--hidden", "32",
                        "--layers", "1", "--threads", "1", "--old-max-elements", "70000"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("peak_16k_over_1k", "vocab_152k_over_4k_at_16k", "new_over_old_at_16k", "padding_waste_default",
                "padding_waste_long_tail"):
        assert isinstance(out[key], float) and out[key] >= 0, key
    assert all(r["peak_mib"] >= 0 for r in out["runs"].values()) and "old/v2048/t64" not in out["runs"]
