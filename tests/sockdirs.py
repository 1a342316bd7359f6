"""Short directories for ``ipc://`` sockets. A socket's path must fit in 107 bytes, which pytest's
``tmp_path`` can exceed, so they live in /tmp: all of one test session's under one directory there, which
the session removes at its end (``tests/conftest.py``) instead of leaving one directory per test behind."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

ROOT_PREFIX = "vapo-tests-"
_root: list[Path] = []  # this session's directory, made on first use


def socket_dir(prefix: str) -> Path:
    """A fresh directory ``prefix*`` for one test's sockets, inside this session's directory in /tmp."""
    if not _root:
        _root.append(Path(tempfile.mkdtemp(prefix=ROOT_PREFIX, dir="/tmp")))
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_root[0]))


def remove_all() -> None:
    """Remove this session's directory (every socket directory made in it)."""
    while _root:
        shutil.rmtree(_root.pop(), ignore_errors=True)
