"""Fixtures of the tests/common tests."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture
def pdsh_on_path(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Multi-host ssh plans need pdsh at plan time; where it is not installed a stand-in satisfies the check.
    Not autouse: only the modules that plan across hosts ask for it (``pytestmark``)."""
    if shutil.which("pdsh") is None:
        d = tmp_path_factory.mktemp("bin")
        (d / "pdsh").write_text("#!/bin/sh\nexit 1\n")
        (d / "pdsh").chmod(0o755)
        monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ.get('PATH', '')}")
