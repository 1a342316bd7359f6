"""common.cli: every command's config parsing (its exit codes) and one log line format, in a fresh process
for the logging (basicConfig holds once per process)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from common.cli import config_from_argv
from common.config import Config

USAGE = "usage: python -m probe [config.yaml] [key=value ...]"


def test_help_is_zero_a_bad_key_two_and_good_overrides_a_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_from_argv("probe", USAGE, ["--help"]) == 0
    assert USAGE in capsys.readouterr().out
    assert config_from_argv("probe", USAGE, ["buffer.no_such_key=1"]) == 2
    assert "buffer.no_such_key" in capsys.readouterr().err
    cfg = config_from_argv("probe", USAGE, ["actors.group_size=4"])
    assert isinstance(cfg, Config) and cfg.actors.group_size == 4


def test_every_process_logs_time_name_level_message_on_stderr() -> None:
    code = ("import logging; from common.cli import setup_logging; setup_logging('info', 'buffer'); "
            "logging.getLogger('x').debug('hidden'); logging.getLogger('x').info('ready')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == ""
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} buffer INFO ready\n", done.stderr), done.stderr
