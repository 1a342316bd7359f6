"""The tests mirror the tree: every product module has its test file, or the map lists it as an exception
naming the file that tests it.

    python -m pytest -q tests/test_mirror.py

The rule, for a module ``<pkg>/<dirs>/<m>.py`` of ``actors/``, ``buffer/``, ``common/``, ``learner/`` (any depth)
and ``ops/`` (its top-level files, and ``ops/bench/`` at any depth):

- ``tests/<pkg>/<dirs>/test_<m>.py`` (mirrored) or ``tests/<pkg>/test_<m>.py`` (flat, for a subpackage's module);
- for ``ops/bench/``, a ``test_<m>.py`` anywhere under ``tests/ops/`` (the benchmarks are grouped by kind);
- ``__init__.py`` and ``__main__.py`` only when they define a function or class: a package's ``__init__.py``
  is the module named for the package (``common/tasks/__init__.py`` -> ``tests/common/test_tasks.py``), a
  ``__main__.py`` is ``main``, mirrored only (``actors/__main__.py`` -> ``tests/actors/test_main.py``);
- or an exception: a ``module -> test file`` entry in the map's *Tests that cover another module* paragraph
  (docs/ARCHITECTURE.md), whose module exists without a mirrored test and whose test file exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
ROLES = ("actors", "buffer", "common", "learner")
EXCEPTIONS_HEADING = "Tests that cover another module"
ENTRY = re.compile(r"`([\w/]+\.py)` → `(tests/[\w/]+\.py)`")


def _holds_logic(path: Path) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for n in ast.parse(path.read_text()).body)


def product_modules() -> list[Path]:
    """Every module under the rule, relative to the repository root."""
    files = [p for pkg in ROLES for p in sorted((ROOT / pkg).rglob("*.py"))]
    files += sorted((ROOT / "ops").glob("*.py")) + sorted((ROOT / "ops" / "bench").rglob("*.py"))
    return [p.relative_to(ROOT) for p in files
            if p.name not in ("__init__.py", "__main__.py") or _holds_logic(p)]


def _stem(module: Path) -> str:
    if module.name == "__init__.py":
        return module.parent.name
    return "main" if module.name == "__main__.py" else module.stem


def mirrored_tests(module: Path) -> list[Path]:
    """The test files that mirror ``module`` (existing ones only), relative to the repository root."""
    name = f"test_{_stem(module)}.py"
    parent = module.parent.parent if module.name == "__init__.py" else module.parent
    candidates = {ROOT / "tests" / parent / name}
    if module.name != "__main__.py":  # a subpackage's test_main.py flat would be its package's
        candidates.add(ROOT / "tests" / module.parts[0] / name)
    if module.parts[:2] == ("ops", "bench"):
        candidates |= set((ROOT / "tests" / "ops").rglob(name))
    return sorted(p.relative_to(ROOT) for p in candidates if p.is_file())


def exceptions() -> dict[str, str]:
    """The map's ``module -> test file`` entries: the paragraph after its heading line, up to the next blank line."""
    text = MAP.read_text()
    start = text.index(EXCEPTIONS_HEADING)
    end = text.find("\n\n", start)
    block = text[start:end if end != -1 else len(text)]
    entries = ENTRY.findall(block)
    out = dict(entries)
    assert len(out) == len(entries), "a module is listed twice among the map's test exceptions"
    return out


def test_every_module_has_its_test_file_or_an_exception_naming_the_file_that_tests_it() -> None:
    listed = exceptions()
    missing = [str(m) for m in product_modules() if not mirrored_tests(m) and str(m) not in listed]
    assert not missing, (f"{len(missing)} module(s) without tests/<pkg>/test_<module>.py: add one, or list the "
                         f"module with the test file that covers it under '{EXCEPTIONS_HEADING}' in "
                         f"docs/ARCHITECTURE.md:\n  " + "\n  ".join(missing))


def test_each_exception_names_a_module_without_a_mirror_and_a_test_file_that_exists() -> None:
    modules = {str(m) for m in product_modules()}
    wrong = []
    for module, test in exceptions().items():
        if module not in modules:
            wrong.append(f"{module}: not a module under the rule (moved or removed?)")
        elif mirrored := mirrored_tests(Path(module)):
            wrong.append(f"{module}: has {mirrored[0]} now; drop the exception")
        if not (ROOT / test).is_file() or not Path(test).name.startswith("test_"):
            wrong.append(f"{module} → {test}: no such test file")
    assert not wrong, "the map's test exceptions are out of date:\n  " + "\n  ".join(wrong)


def test_the_rule_finds_mirrored_flat_and_benchmark_tests() -> None:
    """The rule itself, on modules whose tests are known: a mirrored file, a subpackage's flat file, a package's
    ``__init__``, a ``__main__``, and a module that has none."""
    assert mirrored_tests(Path("buffer/store.py")) == [Path("tests/buffer/test_store.py")]
    assert mirrored_tests(Path("common/tasks/chain.py")) == [Path("tests/common/tasks/test_chain.py")]
    assert mirrored_tests(Path("common/tasks/__init__.py")) == [Path("tests/common/test_tasks.py")]
    assert mirrored_tests(Path("actors/__main__.py")) == [Path("tests/actors/test_main.py")]
    assert mirrored_tests(Path("actors/rollout_server/__main__.py")) == []  # not actors/__main__.py's test
    assert mirrored_tests(Path("common/no_such_module.py")) == []
    assert Path("learner/__init__.py") not in product_modules()  # an empty package file is out of the rule
    assert Path("ops/launch.py") in product_modules() and Path("ops/rehearsal/main.py") not in product_modules()
