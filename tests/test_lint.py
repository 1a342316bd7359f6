"""The linter as a test: ruff passes on the whole tree, and each import left inside a function says why.

The ruff rules themselves live in pyproject.toml (PLC0415 import-outside-top-level, RUF100 unused noqa).
This test adds what ruff cannot check: that a `# noqa: PLC0415` carries a reason after the code, and
it prints the count of function-level imports per package so that CI's output shows the trend.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("actors", "buffer", "learner", "common", "ops")
NOQA_IMPORT = re.compile(r"#\s*noqa:\s*[A-Z0-9, ]*PLC0415(?P<rest>.*)$")


def _ruff() -> str:
    venv = Path(sys.executable).parent / "ruff"
    found = str(venv) if venv.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed; ops/setup.sh installs the dev extras that carry it")
    return found


def test_ruff_passes_on_the_tree() -> None:
    done = subprocess.run([_ruff(), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _reasonless(path: Path) -> list[str]:
    bad = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = NOQA_IMPORT.search(line)
        if match and len(match.group("rest").strip(" -—:()")) < 8:
            bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return bad


def test_each_function_level_import_says_why() -> None:
    bad = [hit for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py")) for hit in _reasonless(path)]
    assert not bad, "a `# noqa: PLC0415` needs a reason after it:\n" + "\n".join(bad)


def test_function_level_imports_are_counted() -> None:
    done = subprocess.run(
        [_ruff(), "check", "--no-cache", "--isolated", "--ignore-noqa", "--select", "PLC0415", "--output-format", "concise",
         *PRODUCT, "tests"],
        cwd=ROOT, capture_output=True, text=True)
    per_package: dict[str, int] = {}
    for line in done.stdout.splitlines():
        if "PLC0415" in line:
            per_package[line.split("/", 1)[0]] = per_package.get(line.split("/", 1)[0], 0) + 1
    product = sum(per_package.get(p, 0) for p in PRODUCT)
    print(f"function-level imports: product {product} (each with a reason), tests {per_package.get('tests', 0)}; {per_package}")
    assert set(per_package) <= {*PRODUCT, "tests"}
