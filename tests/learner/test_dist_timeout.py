"""Rank 0 may wait far longer than the process group's timeout (a batch from the buffer, up to
learner.batch_timeout_s) without the other ranks dying in their collective, and a failure of that wait
reaches them at once.

Two real CPU ranks (torchrun, gloo) with learner.dist_timeout_s=2 and a rank-0 source that takes 8 s: before
rank 0 sent heartbeats, rank 1 sat in one broadcast and gloo killed it after 2 s.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.learner.synth import child_env
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2.0
WAIT_S = 4 * TIMEOUT_S

HARNESS = textwrap.dedent("""
    import sys, time
    import learner.dist as dist
    from common.config import load_config
    from learner.data import ListSource, fetch
    from learner.synthetic import synth_groups

    mode = sys.argv[1]
    cfg = load_config(None, ["learner.dist_timeout_s={timeout}"])
    dist.setup_distributed(cfg)

    class SlowSource(ListSource):
        # Stands in for a buffer that has no groups yet: the wait under test, not synchronisation.
        def get_batch(self, learner_version, n_groups, timeout_s=0.0):
            time.sleep({wait})
            if mode == "fail":
                raise TimeoutError("no batch (the buffer stands in)")
            return super().get_batch(learner_version, n_groups, timeout_s)

    src = SlowSource(synth_groups(3, 2, 20, seed=1)) if dist.rank() == 0 else None
    groups, _ = fetch(src, 0, 3, 600.0)
    sys.stdout.write(f"RESULT {{dist.rank()}} {{[g.group_id for g in groups]}}\\n")
    sys.stdout.flush()
    dist.exit_process(0)  # no interpreter finalisation: gloo's threads can abort it
""")


def _run(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], float]:
    h = tmp_path / "h.py"
    h.write_text(HARNESS.format(timeout=TIMEOUT_S, wait=WAIT_S))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(h), mode]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1", VAPO_DS_SHM="0"), capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    return p, time.monotonic() - t0


def test_other_ranks_outlive_a_rank0_wait_longer_than_the_timeout(tmp_path: Path) -> None:
    p, _ = _run(tmp_path, "ok")
    assert p.returncode == 0, p.stderr[-3000:]
    results = sorted(line for line in p.stdout.splitlines() if line.startswith("RESULT"))
    assert len(results) == 2
    assert results[0].split(" ", 2)[2] == results[1].split(" ", 2)[2]  # the same groups on both ranks


def test_a_failed_rank0_wait_stops_the_other_ranks_with_its_reason(tmp_path: Path) -> None:
    p, _ = _run(tmp_path, "fail")
    assert p.returncode != 0
    assert "TimeoutError: no batch" in p.stderr
    assert "learner rank 0 failed while waiting for a batch" in p.stderr  # rank 1 names the cause, no gloo timeout
    assert "RESULT" not in p.stdout
