"""A launched smoke run (on the shipped addition base) scored by a user's reward file
(``task.reward=file:<path>:compute_score``) that re-implements the addition check and, once in each scoring
process, sleeps forever, raises, and allocates without bound: the run finishes its steps, each costs one reward of
0, counted (``timeout``, ``exception``, ``memory``) in the actor's log and its ACTOR DONE line, and the learner's
evaluation scores through the same file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.ports import port_overrides

ROOT = Path(__file__).resolve().parents[2]
REWARD = textwrap.dedent('''
    import os
    import time

    def _first(what):
        # True once per scoring process (the actor's pool, the learner evaluation's): the call that creates its marker.
        try:
            os.close(os.open(os.path.join(os.path.dirname(__file__), f"{what}-{os.getppid()}"), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if _first("hung"):
            while True:
                time.sleep(1)
        if _first("raised"):
            raise RuntimeError("a bug in the user's reward")
        if _first("ate"):
            hoard = []
            while True:
                hoard.append(bytearray(16 * 2**20))
        lines = solution_str.rstrip().split("\\n")
        last = lines[-1] if lines else ""
        right = last.startswith("A:") and last[2:].strip() == ground_truth
        return {"score": 1.0 if right else 0.0, "lines": len(lines)}
''')


# A whole launched run, about 45 s on 2 cores (not slow: under 90 s); the pool's guards are tested in
# tests/common/test_reward_pool.py, the wrapper in tests/common/tasks/test_rewarded.py.
def test_a_smoke_run_survives_a_users_reward_that_hangs_raises_and_eats_memory(tmp_path: Path) -> None:
    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    overrides = [f"run.root={tmp_path}", "run.name=reward", "model.path=ops/bases/addition-tiny",
                 f"task.reward=file:{reward}:compute_score", "task.reward_timeout_s=2", "task.reward_workers=1",
                 "task.reward_memory_mb=256",
                 "metrics.prometheus=false", *port_overrides()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "OMP_WAIT_POLICY": "PASSIVE"}
    run = subprocess.run([sys.executable, "-m", "ops.launch", "ops/configs/smoke.yaml", *overrides], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_dir = tmp_path / "reward"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] >= 3
    for what in ("hung", "raised", "ate"):
        assert len(list(tmp_path.glob(f"{what}-*"))) == 2, what  # the actor's and the learner's evaluation's
    actor_log = (run_dir / "logs" / "actor-0.log").read_text()
    done = json.loads(next(ln for ln in actor_log.splitlines() if ln.startswith("ACTOR DONE "))[len("ACTOR DONE "):])
    # Three calls scored 0 and counted, one of each kind; the actor went on (the shipped base is right ~46% of the time).
    assert done["reward_errors"] == 3 and done["positives"] > 0, done
    assert "reward timeout" in actor_log and "no result within 2 s" in actor_log
    assert "reward exception" in actor_log and "a bug in the user's reward" in actor_log
    assert "reward memory" in actor_log
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "learner_step"]
    assert any(r.get("reward_mean", 0) > 0 for r in steps), "the file's check gives right answers their 1"
    evals = [r for r in records if r.get("kind") == "eval"]
    assert evals and all(r["avg_at_k"] > 0 for r in evals), "the learner evaluated through the same reward file"
    assert "reward timeout" in (run_dir / "logs" / "learner.log").read_text()
