"""ops/launch.sh on the smoke config with ``learner.weight_transport=distributed``: the learner's rank 0
builds the weight-update group with the actor's rollout_server and pushes every version over it; the
durable versions land on disk behind it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from common.checksum import weights_sha256
from tests.ports import port_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_with_distributed_push(tmp_path: Path) -> None:
    proc = subprocess.run([str(ROOT / "ops" / "launch.sh"), "ops/configs/smoke.yaml", f"run.root={tmp_path}",
                           "run.name=push", *port_overrides(), "learner.weight_transport=distributed"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = tmp_path / "push"
    learner_log = (run / "logs" / "learner.log").read_text()
    assert "weight-update group 1: learner + 1 engines" in learner_log, learner_log[-3000:]
    actor_log = (run / "logs" / "actor-0.log").read_text()
    done = json.loads(next(x for x in actor_log.splitlines() if x.startswith("ACTOR DONE ")).split(" ", 2)[2])
    assert done["weight_version"] == 3, done
    assert done["weight_pushes"] >= 1 and done["weight_sync_failures"] == 0, done  # versions came by broadcast
    for v in (1, 2, 3):  # each pushed version was also written, in the background, and checks out
        stable = json.loads((run / "weights" / f"v{v}" / "STABLE").read_text())
        assert stable["sha256"] == weights_sha256(run / "weights" / f"v{v}")


# slow: the kill and rejoin are also tested against the real server (test_sglang_live_push) and mid-broadcast
# (tests/actors/test_weight_push.py); this one adds the launched run around them.
@pytest.mark.slow
def test_engine_killed_during_a_run_with_the_push_rejoins(tmp_path: Path) -> None:
    """The actor's engine is killed mid-run: the learner goes on (pushes to it fail or skip it, bounded),
    the restarted engine comes back on the newest durable version from disk, joins the weight push again,
    and the run ends with the actor on the last version."""
    import os
    import signal

    from tests.ops.process_fixtures import processes_mentioning

    ports = port_overrides()
    base_port = next(p.split("=")[1] for p in ports if p.startswith("engine.base_port="))
    proc = subprocess.Popen([str(ROOT / "ops" / "launch.sh"), "ops/configs/smoke.yaml", f"run.root={tmp_path}",
                             "run.name=kill", *ports, "learner.weight_transport=distributed", "learner.total_steps=20",
                             "learner.push_timeout_s=10"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, killed = [], False
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if not killed and "step 2/" in line:
            for entry in processes_mentioning("-m actors.rollout_server"):
                if f"--port {base_port} " in entry:
                    os.kill(int(entry.split(":")[0]), signal.SIGKILL)
                    killed = True
    assert proc.wait(timeout=400) == 0, "".join(lines)[-4000:]
    assert killed, "the test did not find the engine to kill"
    run = tmp_path / "kill"
    learner_log = (run / "logs" / "learner.log").read_text()
    assert "actor 0 joins the weight push (engine start 2)" in learner_log, learner_log[-3000:]
    assert "weight-update group 2: learner + 1 engines" in learner_log, learner_log[-3000:]  # rebuilt with it
    actor_log = (run / "logs" / "actor-0.log").read_text()
    done = json.loads(next(x for x in actor_log.splitlines() if x.startswith("ACTOR DONE ")).split(" ", 2)[2])
    assert done["engine_restarts"] >= 1 and done["weight_version"] == 20, done
