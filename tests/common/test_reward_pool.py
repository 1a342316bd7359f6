"""common.reward_pool: real worker processes running a user's reward file: float and dict results, and a
reward that hangs, raises, runs away with memory, dies or returns garbage costs one reward of 0 and one
error of its kind, within its timeout, and the pool goes on scoring."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.reward_pool import RewardCall, RewardPool, RewardPoolError
from tests.polling import wait_for

REWARDS = textwrap.dedent('''
    import os
    import time

    HOARD = []

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "hang":
            if extra_info:  # tells the test it is in flight
                open(extra_info["mark"], "w").close()
            while True:
                time.sleep(1)
        if solution_str == "raise":
            raise ValueError("no answer here")
        if solution_str == "hog":
            while True:
                HOARD.append(bytearray(16 * 2**20))
        if solution_str == "die":
            os._exit(3)
        if solution_str == "nan":
            return float("nan")
        if solution_str == "text":
            return "1.0"
        if solution_str == "source":
            return 1.0 if data_source == "src" and extra_info == {"k": 2} else 0.0
        return float(solution_str.strip() == ground_truth)

    def with_extras(data_source, solution_str, ground_truth, extra_info):
        right = solution_str.strip() == ground_truth
        return {"score": 1.0 if right else 0.25, "acc": float(right), "length": len(solution_str), "pred": solution_str}
''')
TIMEOUT_S = 1.5


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


@pytest.fixture
def pool(rewards_file: Path) -> Iterator[RewardPool]:
    p = RewardPool([f"file:{rewards_file}:compute_score", f"file:{rewards_file}:with_extras"], workers=2,
                   timeout_s=TIMEOUT_S, memory_mb=256, log_every_s=0.0)
    yield p
    p.close()


def _calls(path: Path, texts: list[str], fn: str = "compute_score") -> list[RewardCall]:
    return [RewardCall(f"file:{path}:{fn}", "src", t, "42", "") for t in texts]


def test_float_and_dict_functions_score_a_batch_in_order(pool: RewardPool, rewards_file: Path) -> None:
    got = pool.score(_calls(rewards_file, ["42", "41", " 42\n"]))
    assert [r.score for r in got] == [1.0, 0.0, 1.0] and not any(r.error for r in got)
    extras = pool.score(_calls(rewards_file, ["42", "7"], "with_extras"))
    assert [r.score for r in extras] == [1.0, 0.25]
    assert extras[0].extra == {"acc": 1.0, "length": 2.0} and extras[1].extra == {"acc": 0.0, "length": 1.0}
    # data_source and extra_info (JSON text, handed over parsed) reach the function
    both = pool.score([RewardCall(f"file:{rewards_file}:compute_score", "src", "source", "", '{"k": 2}')])
    assert both[0].score == 1.0


@pytest.mark.parametrize(("text", "kind"), [("hang", "timeout"), ("raise", "exception"), ("hog", "memory"),
                                            ("die", "crash"), ("nan", "bad_value"), ("text", "bad_value")])
def test_a_bad_reward_costs_one_zero_and_the_pool_goes_on(pool: RewardPool, rewards_file: Path, text: str,
                                                          kind: str) -> None:
    pool.score(_calls(rewards_file, ["42"]))  # started: what follows times the bad call alone
    t0 = time.monotonic()
    got = pool.score(_calls(rewards_file, ["42", text, "42", "0"]))
    took = time.monotonic() - t0
    assert [r.score for r in got] == [1.0, 0.0, 1.0, 0.0]
    assert [r.error for r in got] == ["", kind, "", ""], got
    assert pool.error_counts[kind] == 1 and sum(pool.error_counts.values()) == 1
    # The timeout, plus a worker's restart (spawn + import) for the items after a lost worker.
    assert took < TIMEOUT_S + 10.0, took
    assert [r.score for r in pool.score(_calls(rewards_file, ["42"] * 4))] == [1.0] * 4
    assert len(pool.pids()) == 2


def test_a_hung_worker_is_killed_not_left_behind(pool: RewardPool, rewards_file: Path) -> None:
    pool.score(_calls(rewards_file, ["42"]))
    before = set(pool.pids())
    pool.score(_calls(rewards_file, ["hang"]))
    gone = before - set(pool.pids())
    assert len(gone) == 1  # the hung worker was killed and replaced by a fresh process
    (pid,) = gone
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


def test_concurrent_batches_use_both_workers(pool: RewardPool, rewards_file: Path, tmp_path: Path) -> None:
    """A hanging batch on one worker does not hold up a batch on the other."""
    pool.score(_calls(rewards_file, ["42"]))
    mark = tmp_path / "hanging"
    hang = RewardCall(f"file:{rewards_file}:compute_score", "src", "hang", "42", json.dumps({"mark": str(mark)}))
    slow = threading.Thread(target=pool.score, args=([hang],))
    slow.start()
    wait_for(mark.exists, timeout_s=TIMEOUT_S, what="the hanging call to start")
    t0 = time.monotonic()
    fast = pool.score(_calls(rewards_file, ["42", "1"]))
    assert [r.score for r in fast] == [1.0, 0.0] and time.monotonic() - t0 < TIMEOUT_S / 2
    slow.join(TIMEOUT_S + 10)
    assert pool.error_counts["timeout"] == 1


def test_a_file_that_does_not_load_is_an_error_at_the_first_call(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_anywhere\n")
    pool = RewardPool([f"file:{broken}:compute_score"], workers=1)
    with pytest.raises(RewardPoolError, match="no_such_module_anywhere"):
        pool.score([RewardCall(f"file:{broken}:compute_score", "", "x", "x")])
    pool.close()
    nofn = tmp_path / "nofn.py"
    nofn.write_text("x = 1\n")
    pool = RewardPool([f"file:{nofn}:compute_score"], workers=1)
    with pytest.raises(RewardPoolError, match="no function 'compute_score'"):
        pool.score([RewardCall(f"file:{nofn}:compute_score", "", "x", "x")])
    pool.close()
    with pytest.raises(ValueError, match="not found"):
        RewardPool([f"file:{tmp_path / 'missing.py'}:f"])


def test_close_kills_the_workers_and_refuses_more(pool: RewardPool, rewards_file: Path) -> None:
    pool.score(_calls(rewards_file, ["42"]))
    pids = pool.pids()
    assert len(pids) == 2
    pool.close()
    for pid in pids:
        wait_for(lambda pid=pid: not _running(pid), timeout_s=10, what=f"worker {pid} to exit")
    with pytest.raises(RewardPoolError, match="closed"):
        pool.score(_calls(rewards_file, ["42"]))


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_workers_die_with_the_process_that_started_them(tmp_path: Path, rewards_file: Path) -> None:
    """A parent killed with SIGKILL (no close, no atexit) takes its reward workers with it."""
    pids_file = tmp_path / "pids"
    script = textwrap.dedent(f'''
        import os, sys, time
        from common.reward_pool import RewardCall, RewardPool
        pool = RewardPool(["file:{rewards_file}:compute_score"], workers=2)
        pool.score([RewardCall("file:{rewards_file}:compute_score", "", "1", "1")])
        open({str(pids_file)!r}, "w").write(" ".join(map(str, pool.pids())))
        time.sleep(600)
    ''')
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    pid = os.spawnve(os.P_NOWAIT, sys.executable, [sys.executable, "-c", script], env)
    try:
        text = wait_for(lambda: pids_file.exists() and pids_file.read_text(), timeout_s=60, what="the pool's pids")
        workers = [int(x) for x in text.split()]
        assert len(workers) == 2 and all(_running(w) for w in workers)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    for w in workers:
        wait_for(lambda w=w: not _running(w), timeout_s=10, what=f"worker {w} to die with its parent")
