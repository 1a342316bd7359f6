"""ops/bench/memory.py: the padding figure on a hand-checked batch, and (slow) a tiny end-to-end run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ops.bench import memory

ROOT = Path(__file__).resolve().parents[2]
BENCH = ("-m", "ops.bench.memory")


def test_padding_waste_counts_padding_and_fillers() -> None:
    # Rows of 10, 10, 2, 2 tokens (prompt 1 + response): one mini-batch, one rank, 2 rows per micro-batch.
    # Sorted longest first: [10, 10] and [2, 2], no padding.
    p, r = [1, 1, 1, 1], [9, 1, 9, 1]
    assert memory.padding_waste(p, r, 1, 1, 2, 0) == 0.0
    # Two ranks, budget 10 tokens: micro-batches [10], [10], [2, 2] (2 × 10 > 10); dealt by padded tokens:
    # rank 0 [10] then [2, 2], rank 1 [10] and a filler (the shortest row, 2 tokens) to match the count.
    # Processed 26 for 24 real.
    assert memory.padding_waste(p, r, 1, 2, 8, 10) == round(1 - 24 / 26, 4)
    # Three rows [10, 2, 2] on two ranks, rows only (at most ceil(3 / 2) = 2 rows per micro-batch so that
    # both ranks get work): [10, 2] → 2 × 10 = 20 on rank 0, [2] on rank 1. Processed 22 for 14: waste 8 / 22.
    assert memory.padding_waste([1, 1, 1], [9, 1, 1], 1, 2, 8, 0) == round(1 - 14 / 22, 4)


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
