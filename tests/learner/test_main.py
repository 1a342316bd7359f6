"""``python -m learner``: the process's exit status is the outcome (usage: 0; a config error or a missing model:
non-zero, with the reason on stderr), whatever path it leaves by."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.learner.synth import child_env

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "learner", *args], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=120)


def test_help_exits_zero_and_errors_exit_non_zero_with_the_reason(tmp_path: Path) -> None:
    ok = _run("--help")
    assert ok.returncode == 0 and "usage: python -m learner" in ok.stdout + ok.stderr
    bad_key = _run("learner.no_such_key=1")
    assert bad_key.returncode != 0 and "no_such_key" in bad_key.stderr
    no_model = _run(f"model.path={tmp_path / 'absent'}", f"run.root={tmp_path}")
    assert no_model.returncode == 2 and "does not exist" in no_model.stderr
