"""The tests' temporary files stay out of /tmp: ipc socket directories under one per-session directory that
the session removes (``tests/sockdirs.py``), torchrun's log directories in the session's temporary files
(``PET_LOG_DIR``, ``tests/conftest.py``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from tests import sockdirs

TESTS = Path(__file__).resolve().parent


def test_socket_dirs_share_one_short_session_directory_that_remove_all_removes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sockdirs, "_root", [])  # a session of its own: the real one's sockets stay
    a, b = sockdirs.socket_dir("vx"), sockdirs.socket_dir("vx")
    assert a != b and a.parent == b.parent and a.parent.parent == Path("/tmp")
    assert a.parent.name.startswith(sockdirs.ROOT_PREFIX) and a.name.startswith("vx")
    assert len(f"ipc://{a}/ingest") < 80  # far inside the 107-byte limit of a socket path
    root = a.parent
    sockdirs.remove_all()
    assert not root.exists()


def test_no_test_makes_its_own_directory_in_tmp() -> None:
    """A directory a test makes in /tmp itself outlives it whenever its teardown does not run."""
    pattern = re.compile(r"mkdtemp\([^)]*dir=\"/tmp\"")
    offenders = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py")
                 if p.name != "sockdirs.py" and pattern.search(p.read_text())]
    assert offenders == []


def test_torchrun_writes_its_logs_where_the_session_says() -> None:
    log_dir = os.environ["PET_LOG_DIR"]
    assert Path(log_dir).is_dir() and not log_dir.startswith("/tmp/torchelastic_")
    assert get_args_parser().parse_args(["script.py"]).log_dir == log_dir
