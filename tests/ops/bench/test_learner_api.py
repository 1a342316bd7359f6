"""ops/ reaches the learner only through its public names: a name a learner module lists in its ``__all__``
(none with a leading underscore, in no ``_private`` module). The learner's modules use each other freely;
``__all__`` is what other packages (the benchmarks, probes and reports above all) may build on, so a learner
refactor knows what it must keep."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _learner_module(root: Path, dotted: str) -> Path | None:
    base = root.joinpath(*dotted.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def learner_names_used(root: Path, path: Path) -> list[tuple[int, str, str]]:
    """(line, learner module, name) for each learner name ``path`` takes: ``from learner.m import name``, and
    ``m.name`` / ``learner.m.name`` on a learner module it imported whole."""
    tree = ast.parse(path.read_text())
    used: list[tuple[int, str, str]] = []
    modules: dict[str, str] = {}  # the name a module object is bound to in this file -> its dotted name
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "learner":
            for a in node.names:
                whole = f"{node.module}.{a.name}"
                if _learner_module(root, whole) is not None:
                    modules[a.asname or a.name] = whole
                else:
                    used.append((node.lineno, node.module or "", a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "learner" and a.name != "learner":
                    modules[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (owner := _dotted(node.value)) in modules:
            used.append((node.lineno, modules[owner], node.attr))
    return sorted(used)


def _public(module_file: Path) -> set[str]:
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)}
    return set()


def private_uses(root: Path, files: list[Path]) -> list[str]:
    """Every learner name ``files`` use that is not public, as ``file:line: module.name (why)``."""
    bad: list[str] = []
    for path in files:
        for line, module, name in learner_names_used(root, path):
            where = f"{path.relative_to(root)}:{line}: {module}.{name}"
            module_file = _learner_module(root, module)
            if any(part.startswith("_") for part in module.split(".")) or name.startswith("_"):
                bad.append(f"{where} (a private name)")
            elif module_file is None:
                bad.append(f"{where} (no such learner module)")
            elif name not in _public(module_file):
                bad.append(f"{where} (not in {module_file.relative_to(root)}'s __all__)")
    return bad


def test_ops_uses_only_the_learners_public_names() -> None:
    files = sorted(ROOT.glob("ops/**/*.py"))
    uses = [u for f in files for u in learner_names_used(ROOT, f)]
    # a scan that silently lost its imports would pass vacuously: the benchmarks take ~50 learner names
    assert len(uses) > 40 and ("learner.train", "Learner") in {(m, n) for _, m, n in uses}
    assert private_uses(ROOT, files) == []


def test_the_scan_catches_each_way_of_reaching_past_all(tmp_path: Path) -> None:
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "__init__.py").write_text("")
    (tmp_path / "learner" / "train.py").write_text('__all__ = ["Learner"]\n\nclass Learner: ...\n\ndef _step(): ...\n'
                                                    "def helper(): ...\n")
    (tmp_path / "learner" / "models.py").write_text("def build(): ...\n")  # no __all__: nothing public
    (tmp_path / "learner" / "_hidden.py").write_text('__all__ = ["x"]\nx = 1\n')
    bench = tmp_path / "bench.py"
    bench.write_text("import learner.train\n"
                     "from learner import models\n"
                     "from learner import train as t\n"
                     "from learner._hidden import x\n"
                     "from learner.train import Learner, _step, helper\n\n"
                     "learner.train.Learner()\n"
                     "learner.train.helper()\n"
                     "models.build()\n"
                     "t._step()\n")
    assert private_uses(tmp_path, [bench]) == [
        "bench.py:4: learner._hidden.x (a private name)",
        "bench.py:5: learner.train._step (a private name)",
        "bench.py:5: learner.train.helper (not in learner/train.py's __all__)",
        "bench.py:8: learner.train.helper (not in learner/train.py's __all__)",
        "bench.py:9: learner.models.build (not in learner/models.py's __all__)",
        "bench.py:10: learner.train._step (a private name)",
    ]
