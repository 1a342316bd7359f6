"""No test module imports another test module or a conftest: helpers shared between tests live in modules
named for what they are (``*_fixtures.py``, ``tests/buffer/fixtures.py``, ``synth.py``, ``servers.py`` ...),
so a test file can be moved, renamed or deleted without breaking the others, and pytest never collects a
module twice under two names. Code that tests write into subprocess harnesses (strings) is checked too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# An import statement inside a string (a harness a test writes to disk and runs).
_STRING_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\s+([\w\s,()]+)|import\s+([\w., ]+))", re.MULTILINE)


def _is_test_module(dotted: str) -> bool:
    last = dotted.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def _package(path: Path, root: Path) -> list[str]:
    return [root.name, *path.relative_to(root).parent.parts]


def _resolve(module: str | None, level: int, package: list[str]) -> str:
    """The absolute dotted name of ``from <level dots><module> import ...`` in ``package``."""
    if level == 0:
        return module or ""
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def _imported(tree: ast.AST, package: list[str]) -> list[tuple[int, str]]:
    """(line, dotted name) of every module an import in ``tree`` may bind, ``from a import b`` as both
    ``a`` and ``a.b`` (b may be a module)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, package)
            out += [(node.lineno, base), *((node.lineno, f"{base}.{alias.name}") for alias in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            for m in _STRING_IMPORT.finditer(node.value):
                if m.group(1):
                    names = re.findall(r"\w+", m.group(2))
                    out += [(node.lineno, m.group(1)), *((node.lineno, f"{m.group(1)}.{n}") for n in names)]
                else:
                    out += [(node.lineno, name.strip()) for name in m.group(3).split(",")]
    return out


def test_imports_in(root: Path) -> list[str]:
    """``file:line: name`` for each import of a test module or a conftest by any module under ``root``."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue  # its own examples (strings in the negative check) are meant to be caught
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported(tree, _package(path, root)):
            if name.split(".")[0] == root.name and _is_test_module(name):
                problems.append(f"{path.relative_to(root.parent)}:{line}: imports {name}")
    return sorted(set(problems))


test_imports_in.__test__ = False  # a helper with a test-like name: not collected


def test_no_test_module_imports_another_or_a_conftest() -> None:
    problems = test_imports_in(TESTS)
    assert problems == [], "move what these share into a fixtures module:\n" + "\n".join(problems)


def test_the_check_finds_each_form_of_such_an_import(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "pkg").mkdir(parents=True)
    (tests / "pkg" / "test_a.py").write_text("X = 1\n")
    (tests / "pkg" / "helpers_fixtures.py").write_text("from tests.pkg.test_a import X\n")
    (tests / "pkg" / "test_b.py").write_text(
        "import os\nfrom tests.pkg import helpers_fixtures, test_a\nfrom . import conftest\n"
        "from .test_a import X\nimport tests.pkg.test_a as a\nfrom tests.polling import wait_for\n"
        "HARNESS = '''\n    import sys\n    from tests.pkg.test_a import X\n'''\n")
    (tests / "pkg" / "test_c.py").write_text("from tests.pkg.helpers_fixtures import X\nfrom tests.pkg.synth import y\n")
    assert test_imports_in(tests) == [
        "tests/pkg/helpers_fixtures.py:1: imports tests.pkg.test_a",
        "tests/pkg/test_b.py:2: imports tests.pkg.test_a",
        "tests/pkg/test_b.py:3: imports tests.pkg.conftest",
        "tests/pkg/test_b.py:4: imports tests.pkg.test_a",
        "tests/pkg/test_b.py:5: imports tests.pkg.test_a",
        "tests/pkg/test_b.py:7: imports tests.pkg.test_a",
    ]
