"""``python -m buffer`` (buffer/__main__.py), in process: its usage on --help (0), a bad config named (2), an
insecure bind refused before anything is opened (2). Serving itself is tests/buffer/test_server.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from buffer.__main__ import USAGE, main


def test_help_prints_the_usage_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert USAGE.splitlines()[0] in capsys.readouterr().out


def test_an_unknown_key_is_named_and_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["buffer.no_such_key=1"]) == 2
    assert "buffer.no_such_key" in capsys.readouterr().err


def test_a_public_bind_without_keys_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([f"run.root={tmp_path}", "run.name=r", f"buffer.path={tmp_path / 'buf'}",
                 "buffer.ingest_addr=tcp://0.0.0.0:0", "buffer.curve.keys_dir="])
    assert code == 2
    assert capsys.readouterr().err.startswith("buffer: refusing to start: ")
