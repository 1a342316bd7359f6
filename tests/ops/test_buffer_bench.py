"""The buffer benchmark (ops/bench/buffer.py) is bounded on any disk: the raw side's LMDB holds one call and keeps
its size, a send the buffer refuses ends the run with the refusal named and exit 1 (it used to be re-sent without
end), and so does ``--max-wall-s``. Its ``--quick`` line is checked in test_bench_quick.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ops.bench.buffer import RawLMDB

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m ops.bench.buffer --quick *args``; a hang fails the test at 60 s (a quick run takes ~2 s)."""
    return subprocess.run([sys.executable, "-m", "ops.bench.buffer", "--quick", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_a_refused_send_ends_the_benchmark_with_the_refusal() -> None:
    # 10,000 bytes hold 2 of the quick groups (~4 KB each); the warm-up call sends 16: the buffer answers "full"
    p = run_bench("--capacity-bytes", "10000")
    assert p.returncode == 1, p.stderr[-3000:]
    assert p.stdout.strip() == ""  # no figures from a run that could not store its groups
    assert "the buffer refused a group: full:" in p.stderr, p.stderr[-3000:]
    assert "10000 bytes" in p.stderr  # the capacity it ran with, beside the refusal


def test_the_wall_time_cap_ends_the_benchmark() -> None:
    p = run_bench("--max-wall-s", "0.01")  # past it before the first call ends
    assert p.returncode == 1, p.stderr[-3000:]
    assert "past --max-wall-s 0.01 s" in p.stderr and p.stdout.strip() == ""


def test_the_raw_side_holds_one_call_and_keeps_its_size(tmp_path: Path) -> None:
    frames = [os.urandom(20_000) for _ in range(5)]  # 5 overflow pages each
    call = [frames[i % 5] for i in range(100)]
    raw = RawLMDB(call, 16, tmp_path / "raw")
    sizes = []
    for r in range(8):
        t = raw.put_all(r)
        assert t.work == 100 and t.seconds > 0
        with raw.env.begin() as txn:
            assert txn.stat(raw.db)["entries"] == 100  # the last call's groups, not every call's
        sizes.append((tmp_path / "raw" / "data.mdb").stat().st_size)
    raw.close()
    # growing, the file would end ~8 x its first size (8 calls of ~2 MB); reusing its freed pages, it keeps it
    assert sizes[-1] <= 1.5 * sizes[1], sizes
    assert not (tmp_path / "raw").exists()
