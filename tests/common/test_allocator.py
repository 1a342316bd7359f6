"""common.allocator: with glibc's default thresholds a process that keeps a commit batch of group-sized buffers
and then frees it faults every page in again for the next batch; after ``keep_freed_memory`` it reuses them."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from common import allocator

ROOT = Path(__file__).resolve().parents[2]

# 64 group frames (137 KB each, a 16 x 1,000-token group) held as a commit batch holds them, then freed together.
CHURN = """
import json, resource, sys
from common.allocator import keep_freed_memory
done = keep_freed_memory() if sys.argv[1] == "keep" else {}
held = []
def one_group():
    held.append(bytearray(137_000))
    if len(held) == 64:
        held.clear()
for _ in range(256):
    one_group()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2048):
    one_group()
print(json.dumps({"faults_per_group": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 2048,
                  "set": done}))
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")


def _churn(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHURN, mode], cwd=ROOT, env={**clean, **env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


@glibc
def test_freed_group_buffers_are_reused_instead_of_faulted_in_again() -> None:
    default, kept = _churn("default"), _churn("keep")
    assert default["faults_per_group"] > 20  # 137 KB is 34 pages: glibc's defaults map and fault nearly all
    assert kept["faults_per_group"] < 1
    assert kept["set"] == {"MALLOC_TRIM_THRESHOLD_": allocator.TRIM_THRESHOLD,
                           "MALLOC_MMAP_THRESHOLD_": allocator.MMAP_THRESHOLD}


@glibc
def test_a_threshold_the_environment_sets_is_left_alone() -> None:
    tiny = _churn("keep", MALLOC_MMAP_THRESHOLD_="65536")  # the user's choice: every group mapped afresh
    assert tiny["set"] == {"MALLOC_TRIM_THRESHOLD_": allocator.TRIM_THRESHOLD}
    assert tiny["faults_per_group"] > 20
