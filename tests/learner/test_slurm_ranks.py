"""Tasks of one ``srun ... python -m learner`` step carry only Slurm's variables (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, SLURM_TASKS_PER_NODE, ...); the learner derives RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_SIZE from
them. Before, every task became rank 0 of a world of 1 (each one its own learner talking to the buffer)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from learner.dist import adopt_slurm_env
from tests.learner.synth import child_env
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def test_rank_variables_come_from_slurm() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "2(x2),3"}
    adopt_slurm_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_SIZE"]) == ("5", "7", "1", "3")
    step = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_NODEID": "0"}
    adopt_slurm_env(step)  # the step's own task count, not the allocation's
    assert (step["WORLD_SIZE"], step["LOCAL_SIZE"], step["LOCAL_RANK"]) == ("4", "2", "0")


def test_a_launchers_rank_wins_and_no_slurm_changes_nothing() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    adopt_slurm_env(env)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
    plain: dict[str, str] = {}
    adopt_slurm_env(plain)
    assert plain == {}


HARNESS = textwrap.dedent("""
    import sys
    import torch
    import learner.dist as dist
    from common.config import load_config

    before = dist.rank()  # what runner.main asks before the process group exists
    dist.setup_distributed(load_config(None, []))
    total = dist.all_reduce_sum(torch.tensor([dist.rank() + 1.0]))
    sys.stdout.write(f"RESULT {{before}} {{dist.rank()}} {{dist.world_size()}} {{float(total[0])}}\\n")
    sys.stdout.flush()
    dist.exit_process(0)  # no interpreter finalisation: gloo's threads can abort it
""")


def test_two_srun_style_tasks_form_one_learner(tmp_path: Path) -> None:
    h = tmp_path / "h.py"
    h.write_text(HARNESS.format())
    port = str(free_port())
    procs = []
    for task in range(2):
        env = child_env(OMP_NUM_THREADS="1", VAPO_DS_SHM="0", SLURM_PROCID=str(task), SLURM_NTASKS="2",
                        SLURM_LOCALID=str(task), SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "VAPO_STORE_FILE"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, str(h)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    assert sorted(o.strip() for o, _ in outs) == ["RESULT 0 0 2 3.0", "RESULT 1 1 2 3.0"]


def test_a_multi_rank_srun_task_without_master_addr_says_so(tmp_path: Path) -> None:
    h = tmp_path / "h.py"
    h.write_text(HARNESS.format())
    env = child_env(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", SLURM_TASKS_PER_NODE="2")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "VAPO_STORE_FILE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, str(h)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "MASTER_ADDR and MASTER_PORT not set" in p.stderr, p.stderr[-2000:]


@pytest.fixture(autouse=True)
def _keep_environ() -> Iterator[None]:  # adopt_slurm_env writes os.environ by default; these tests pass their own dicts
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
