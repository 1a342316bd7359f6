"""ops/bench/value_curve.py: locating the first mistake of a response, picking the newest version, CLI errors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from common.config import TaskConfig
from common.tasks import Prompt, get_task

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("value_curve_mod", ROOT / "ops" / "bench" / "value_curve.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_first_mistake_is_the_first_token_off_the_correct_trace(vc: ModuleType) -> None:
    task = get_task(TaskConfig(name="chain"))
    p = Prompt("x", "Q:3+7x03\n", "4")  # correct: "02:3+7=0\n01:0+7=7\n00:7+7=4\nA:4"
    assert vc.first_mistake(task, p, list("02:3+7=0\n01:0+7=7\n00:7+7=4\nA:4")) is None
    # A slip in the second line's result: token 16 ('8' for '7'); everything after follows from it.
    assert vc.first_mistake(task, p, list("02:3+7=0\n01:0+7=8\n00:8+7=5\nA:5")) == 16
    assert vc.first_mistake(task, p, list("02:3+7=1\n01:1+7=8\n00:8+7=5\nA:5")) == 7
    # The index is the token's, whatever its width; a wrong last token is not a step mistake (only the answer).
    assert vc.first_mistake(task, p, ["02:3", "+7=0\n", "01:0+7=8", "\n00:8+7=5"]) == 2
    assert vc.first_mistake(task, p, ["02:3", "+7=0\n", "01:0+7=8"]) is None
    assert vc.first_mistake(task, p, list("02:3+7=0\n01:0+7=7\n00:7+7=4\nA:5")) is None


def test_newest_version_is_numeric_not_lexical(vc: ModuleType, tmp_path: Path) -> None:
    for v in ("v9", "v10", "v2", "vx", "latest"):
        (tmp_path / v).mkdir()
    assert vc.newest(tmp_path).name == "v10"
    with pytest.raises(FileNotFoundError):
        vc.newest(tmp_path / "v2")


def test_cli_refuses_what_it_cannot_probe(tmp_path: Path) -> None:
    bad = subprocess.run([sys.executable, str(ROOT / "ops/bench/value_curve.py"), str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "has no config.yaml" in bad.stderr
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"algo": {"advantage": "grpo"}}))
    bad = subprocess.run([sys.executable, str(ROOT / "ops/bench/value_curve.py"), str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "without a critic" in bad.stderr

