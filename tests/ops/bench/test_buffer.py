"""The buffer benchmark (ops/bench/buffer.py) is bounded on any disk: the raw side's LMDB holds one call and keeps
its size, a send the buffer refuses ends the run with the refusal named and exit 1 (it used to be re-sent without
end), and so does ``--max-wall-s``; over dozens of calls of full-size groups the temp dir holds about a call a
store. Its ``--quick`` line: ``test_buffer_quick``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.bench.buffer import RawLMDB, ceiling_rate
from tests.ops.bench.quick_fixtures import check_common, run_quick

ROOT = Path(__file__).resolve().parents[3]


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


def test_both_stores_stay_one_call_deep_over_many_calls() -> None:
    # full-size groups (16 x 1,000 tokens, ~137 KB), calls of 16: three rounds of 0.3 s a side are dozens of calls
    p = subprocess.run([sys.executable, "-m", "ops.bench.buffer", "--groups-per-sender", "8", "--groups-per-call", "8",
                        "--serve-groups", "8", "--rounds", "3", "--min-round-s", "0.3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    line = json.loads(p.stdout)
    call_bytes = line["groups_per_call"] * line["group_bytes"]
    # the capacity is one call, from the run's settings: its groups, its frames with room for the longer ids
    assert line["capacity_groups"] == line["groups_per_call"] == 16
    assert call_bytes < line["capacity_bytes"] < 1.1 * call_bytes
    stored = min(sum(line["ingest_groups_rounds"]), sum(line["raw_groups_rounds"])) * line["group_bytes"]
    assert stored > 10 * call_bytes, line  # enough calls that a store that grew would show it
    # the temp dir at its most: about a call in each store (LMDB's copy-on-write pages), not what passed through
    assert line["disk_peak_mb"] * 1e6 < 6 * call_bytes, (line["disk_peak_mb"], call_bytes, stored)


def test_buffer_quick() -> None:
    line = run_quick(["-m", "ops.bench.buffer"], 180)
    check_common(line, "buffer", "ingest_over_raw_lmdb", ">= 0.6")
    assert line["curve"] is True and line["resent"] == 0
    # every round ingested, put and sank at least one call's groups, and the ratio is their rates'
    assert all(n >= line["groups_per_call"]
               for n in line["ingest_groups_rounds"] + line["raw_groups_rounds"] + line["sink_groups_rounds"])
    assert line["sink_groups_per_s"] > 0 and line["raw_cpu_ms_per_group"] > 0 and line["ceiling_over_raw_lmdb"] > 0
    rates = [(n / s) / (m / t) for n, s, m, t in zip(line["ingest_groups_rounds"], line["ingest_s_rounds"],
                                                      line["raw_groups_rounds"], line["raw_s_rounds"], strict=True)]
    assert line["ratio_rounds"] == pytest.approx(rates, rel=0.05)
    assert line["serve_groups"] > 0 and line["serve_latency_decoded_s"] >= line["serve_latency_bytes_s"] > 0
    # the buffer held one call at most (it refuses more), drained before each call: 2 senders x 8 groups
    assert line["capacity_groups"] == line["groups_per_call"] == 16 and 0 < line["disk_peak_mb"] < 64


def test_the_ceiling_is_the_transport_and_the_lmdb_writes_sharing_the_cores() -> None:
    # a sink at 1,000 groups/s on 2 cores costs 2 ms of CPU a group; 0.5 ms of writes more: 2 / 2.5 ms = 800/s
    assert ceiling_rate(1000.0, 0.0005, 2) == pytest.approx(800.0)
    assert ceiling_rate(1000.0, 0.0, 2) == pytest.approx(1000.0)  # no writes: the sink's own rate
