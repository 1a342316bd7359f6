"""A second ``ops/rehearse.sh`` on a machine where one is running is refused at the machine's lock and
touches nothing of the first: not its namespaces (not counted as its own either) and not the rehearsal runs'
CurveZMQ keys, which ``prepare`` rewrites (before this test's fix it ran before the lock, and the running
rehearsal's next launch could no longer authenticate to its buffer)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from ops.rehearsal import main as rehearsal_main
from ops.rehearsal.cluster import LOCK_FILE, missing_prerequisites

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(os.geteuid() != 0 or bool(missing_prerequisites()), reason="needs root and the rehearsal's packages")
def test_a_second_rehearsal_is_refused_before_it_prepares_anything(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    prepared: list[bool] = []
    monkeypatch.setattr(rehearsal_main, "prepare", lambda: prepared.append(True))
    monkeypatch.setattr(rehearsal_main.signal, "signal", lambda *_: None)  # leave pytest's handlers alone
    fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "the first rehearsal"
        except BlockingIOError:
            pass  # a real rehearsal holds the machine right now: the same situation
        rc = rehearsal_main.main(["--keep-logs", str(Path(os.environ.get("TMPDIR", "/tmp")) / "vapo-lock-test-logs")])
    finally:
        os.close(fd)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and "another rehearsal holds" in out["error"]
    assert prepared == []  # the running rehearsal's keys were not rewritten
    assert out["namespaces_left"] == 0 and out["procs_left_at_teardown"] == 0
