"""Checkpoint/resume: a SIGKILLed learner continues at the right version with the same next update."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.config import load_config
from learner.data import ListSource
from learner.runner import Runner
from learner.synthetic import synth_groups
from learner.weights import complete_versions
from tests.learner.synth import child_env

REPO = Path(__file__).resolve().parents[2]

HARNESS = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    from common.config import load_config
    from learner.data import ListSource
    from learner.runner import Runner
    from learner.synthetic import synth_groups
    from tests.learner.synth import child_env

    root, model, name, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    class KillingSource(ListSource):
        def get_batch(self, version, n, timeout_s=0.0):
            if version == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-run, after v<kill_at> was checkpointed and published
            return super().get_batch(version, n, timeout_s)

    cfg = load_config(None, [f"run.root={{root}}", f"run.name={{name}}", f"model.path={{model}}",
                             "learner.total_steps=3", "learner.batch_groups=4", "learner.micro_batch_size=8",
                             "learner.checkpoint_every=1", "learner.eval_every=0", "metrics.prometheus=false",
                             "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0"])
    Runner(cfg, KillingSource(synth_groups(16, 4, 60, seed=11))).run()
""")


def _run(harness: Path, root: Path, model: Path, name: str, kill_at: int) -> int:
    env = child_env()
    p = subprocess.run([sys.executable, str(harness), str(root), str(model), name, str(kill_at)], env=env,
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode in (0, -9), p.stderr[-3000:]
    return p.returncode


def _weights(root: Path, name: str, v: int) -> dict[str, torch.Tensor]:
    return load_file(str(root / name / "weights" / f"v{v}" / "model.safetensors"))


def test_sigkill_and_resume_matches_uninterrupted_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS.format(repo=str(REPO)))
    assert _run(harness, tmp_path, tiny_model_dir, "straight", -1) == 0
    assert _run(harness, tmp_path, tiny_model_dir, "killed", 2) == -9
    killed = tmp_path / "killed"
    assert complete_versions(killed / "weights")[-1] == 2
    stable_v2 = (killed / "weights" / "v2" / "STABLE").read_text()
    assert _run(harness, tmp_path, tiny_model_dir, "killed", -1) == 0
    # v2 was not published a second time; v3 exists and equals the uninterrupted run's v3.
    assert (killed / "weights" / "v2" / "STABLE").read_text() == stable_v2
    a, b = _weights(tmp_path, "straight", 3), _weights(tmp_path, "killed", 3)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    a2 = _weights(tmp_path, "straight", 2)
    assert max(float((a[k] - a2[k]).abs().max()) for k in a) > 1e-5  # the resumed step did update
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_versions_published_past_the_checkpoint_are_skipped(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
                             "learner.total_steps=3", "learner.batch_groups=2", "learner.checkpoint_every=2",
                             "learner.eval_every=0", "metrics.prometheus=false",
                             "learner.publish_addr=tcp://127.0.0.1:0", "learner.query_addr=tcp://127.0.0.1:0"])
    groups = synth_groups(8, 2, 60, seed=4)
    Runner(cfg, ListSource(groups)).run()  # checkpoints v2 and (final) v3, publishes v1..v3
    # Simulate a crash after v3 was published but before its checkpoint became visible.
    ck = tmp_path / "r" / "checkpoints"
    (ck / "v3" / "COMPLETE").unlink()
    cfg.learner.total_steps = 4
    r = Runner(cfg, ListSource(groups))
    # Restored v2's state; v3 (published, lost with its checkpoint) is not reused: v2's weights become v4.
    assert r.learner.version == 4
    r.run()
    assert complete_versions(tmp_path / "r" / "weights") == [2, 3, 4]
