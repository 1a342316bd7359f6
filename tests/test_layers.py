"""The layer contract of docs/ARCHITECTURE.md ("Arrows"), checked on every import of the product
code (actors, learner, buffer, common and ops): module-level and function-level, ``import x`` and
``from x import y``, relative ones resolved, and the dynamic ones whose module is a string literal
(``importlib.import_module("x.y")``, ``import_module("x.y")``, ``__import__("x.y")``).

1. package edges: common imports nothing of ours; buffer only common; actors and learner only common and
   buffer.client; ops (the top layer) anything but tests; nothing imports ops but ops (and tests);
2. no bare-name import of a sibling module (``import long_suite`` in ops/bench/): ours are imported by
   their package path, so the checks here see them and no script directory shadows a package;
3. no cycle in the module graph of our own modules (bare-name imports resolved to the sibling they name);
4. no private (leading underscore) name imported from another top-level package.

Each failure names the file:line to fix."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "learner", "buffer", "common", "ops")
OURS = (*PACKAGES, "tests")

# Which of our modules each package may import: a top-level package name allows all of it, a dotted name
# allows that module (and its submodules) only.
ALLOWED: dict[str, tuple[str, ...]] = {
    "common": ("common",),
    "buffer": ("buffer", "common"),
    "actors": ("actors", "common", "buffer.client"),
    "learner": ("learner", "common", "buffer.client"),
    "ops": ("actors", "learner", "buffer", "common", "ops"),
}


@dataclass(frozen=True)
class Import:
    source: str      # importing module, dotted
    path: str        # importing file, relative to the root
    line: int
    target: str      # imported module, dotted (for ``from m import n``: m.n when that is a module, else m)
    names: tuple[str, ...]   # names taken by ``from m import ...``; empty for ``import m``
    bare: str = ""   # the name as written, when it named a sibling module without its package path

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_sources(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, tuple[str, str]]:
    """module name -> (file path relative to root, source text) for every .py under the packages."""
    sources = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            sources[module_name(path, root)] = (str(path.relative_to(root)), path.read_text())
    return sources


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


_DYNAMIC = ("import_module", "__import__")


def _dynamic_target(node: ast.Call) -> str | None:
    """The module of ``importlib.import_module("m")``, ``import_module("m")`` or ``__import__("m")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in _DYNAMIC or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _raw_imports(module: str, is_package: bool, tree: ast.AST,
                 modules: set[str]) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, target, names) of every import in the tree, our own modules or not."""
    found: list[tuple[int, str, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                    else node.module or "")
            names = tuple(alias.name for alias in node.names)
            submodules = [f"{base}.{name}" for name in names if f"{base}.{name}" in modules]
            plain = tuple(name for name in names if f"{base}.{name}" not in modules)
            found += [(node.lineno, sub, ()) for sub in submodules]
            if plain or not submodules:
                found.append((node.lineno, base, plain))
        elif isinstance(node, ast.Call) and (target := _dynamic_target(node)) is not None:
            found.append((node.lineno, target, ()))
    return found


def imports_of(module: str, path: str, text: str, modules: set[str],
               packages: frozenset[str] = frozenset()) -> list[Import]:
    """Every import of one module, wherever it is in the file, restricted to our own modules. A name that
    is none of ours but names a sibling module file (``import long_suite`` next to ops/bench/suites/long_suite.py,
    the way a script run by path finds it) is resolved to that module and kept with ``bare`` set. A sibling
    package is the source of a distribution installed under its own name (ops/sglang_cpu/sgl_kernel)."""
    is_package = path.endswith("__init__.py")
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for line, target, names in _raw_imports(module, is_package, ast.parse(text, filename=path), modules):
        top = target.split(".")[0]
        if top in OURS:
            found.append(Import(module, path, line, target, names))
        elif package and f"{package}.{top}" in modules and f"{package}.{top}" not in packages:
            found.append(Import(module, path, line, f"{package}.{target}", names, bare=target))
    return found


def all_imports(sources: dict[str, tuple[str, str]]) -> list[Import]:
    modules = set(sources)
    packages = frozenset(module for module, (path, _) in sources.items() if path.endswith("__init__.py"))
    return [imp for module, (path, text) in sources.items()
            for imp in imports_of(module, path, text, modules, packages)]


def _allows(allowed: str, target: str) -> bool:
    return target == allowed or target.startswith(allowed + ".")


def edge_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        package = imp.source.split(".")[0]
        if not any(_allows(allowed, imp.target) for allowed in ALLOWED[package]):
            bad.append(f"{imp.where()}: {package} may not import {imp.target} (allowed: {', '.join(ALLOWED[package])})")
    return bad


def bare_violations(imports: list[Import]) -> list[str]:
    return [f"{imp.where()}: bare-name import {imp.bare}: write it as {imp.target}" for imp in imports if imp.bare]


def private_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        if imp.source.split(".")[0] == imp.target.split(".")[0]:
            continue
        private = [name for name in imp.names if name.startswith("_")]
        private += [part for part in imp.target.split(".") if part.startswith("_") and part != "__init__"]
        for name in private:
            bad.append(f"{imp.where()}: private name {name} imported from {imp.target}")
    return bad


def _owner(target: str, modules: set[str]) -> str | None:
    """The module of ours a dotted import target names (the longest known prefix)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def find_cycles(imports: list[Import], modules: set[str]) -> list[str]:
    """One report per strongly connected component of more than one module (or a module importing itself),
    each with a cycle path through it and the file:line of every edge on that path."""
    graph: dict[str, dict[str, Import]] = {module: {} for module in modules}
    for imp in imports:
        target = _owner(imp.target, modules)
        if target is not None and target != imp.source:
            graph[imp.source].setdefault(target, imp)
    reports = []
    for component in _strong_components(graph):
        cycle = _cycle_in(component, graph)
        steps = [f"{a} -> {b} ({graph[a][b].where()})" for a, b in zip(cycle, cycle[1:], strict=False)]
        reports.append("cycle: " + "; ".join(steps))
    return reports


def _strong_components(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative so a deep import chain cannot hit the recursion limit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _cycle_in(component: list[str], graph: dict[str, dict[str, Import]]) -> list[str]:
    """A closed path start -> ... -> start inside one strongly connected component (breadth-first, shortest)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return [start, start]


def _report(title: str, problems: list[str]) -> str:
    return f"{title} ({len(problems)}); see docs/ARCHITECTURE.md, Arrows:\n  " + "\n  ".join(problems)


def test_package_edges_follow_the_layer_contract() -> None:
    problems = edge_violations(all_imports(collect_sources(ROOT)))
    assert not problems, _report("imports across layers the contract forbids", problems)


def test_our_modules_are_imported_by_their_package_path() -> None:
    problems = bare_violations(all_imports(collect_sources(ROOT)))
    assert not problems, _report("bare-name imports of our own modules", problems)


def test_no_import_cycles_between_modules() -> None:
    sources = collect_sources(ROOT)
    problems = find_cycles(all_imports(sources), set(sources))
    assert not problems, _report("import cycles", problems)


def test_no_private_name_imported_across_packages() -> None:
    problems = private_violations(all_imports(collect_sources(ROOT)))
    assert not problems, _report("private names imported from another package", problems)


def test_the_scan_sees_our_own_imports() -> None:
    # A parse that silently dropped imports would make the three checks above pass vacuously.
    imports = all_imports(collect_sources(ROOT))
    assert len(imports) > 200
    assert any(imp.source.startswith("learner") and imp.target.startswith("common") for imp in imports)
    assert any(imp.source == "ops.launch" and imp.target == "ops.launch_supervise" for imp in imports)
    assert any(imp.source == "ops.bench.suites.experiments" and imp.target == "ops.bench.suites.long_suite" for imp in imports)


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_reports_violations_with_file_and_line(tmp_path: Path) -> None:
    _write_tree(tmp_path, {
        "common/__init__.py": "",
        "common/a.py": "import os\n\ndef f() -> None:\n    from common import b\n",
        "common/b.py": "from .a import f\nfrom actors.worker import run\n",
        "actors/__init__.py": "",
        "actors/worker.py": "from learner.core import _helper\nrun = 1\n",
        "learner/__init__.py": "",
        "learner/core.py": "_helper = 1\n",
        "buffer/__init__.py": "",
        "ops/__init__.py": "",
        "ops/tool.py": "import tests.ports\nfrom buffer import client\n",
    })
    sources = collect_sources(tmp_path)
    imports = all_imports(sources)
    edges = edge_violations(imports)
    assert any(line.startswith("common/b.py:2: common may not import actors.worker") for line in edges), edges
    assert any(line.startswith("actors/worker.py:1: actors may not import learner.core") for line in edges), edges
    assert any(line.startswith("ops/tool.py:1: ops may not import tests.ports") for line in edges), edges
    assert not any(line.startswith("ops/tool.py:2") for line in edges), edges
    cycles = find_cycles(imports, set(sources))
    assert cycles == ["cycle: common.a -> common.b (common/a.py:4); common.b -> common.a (common/b.py:1)"], cycles
    private = private_violations(imports)
    assert private == ["actors/worker.py:1: private name _helper imported from learner.core"], private


def test_a_module_named_in_a_dynamic_import_string_is_an_edge(tmp_path: Path) -> None:
    _write_tree(tmp_path, {
        "actors/__init__.py": "",
        "actors/worker.py": "",
        "learner/__init__.py": "",
        "learner/plugin.py": "import importlib\n\n\ndef load() -> object:\n"
                             "    return importlib.import_module(\"actors.worker\")\n",
        "buffer/__init__.py": "",
        "buffer/hook.py": "hook = __import__('actors.worker')\n",
        "common/__init__.py": "",
        "common/late.py": "from importlib import import_module\n\nlaunch = import_module('ops.launch')\n"
                          "name = 'actors.worker'\nimport_module(name)\n",  # not a literal: not seen
        "ops/__init__.py": "",
        "ops/launch.py": "import importlib\n\nworker = importlib.import_module('actors.worker')\n",
    })
    imports = all_imports(collect_sources(tmp_path))
    assert sorted(edge_violations(imports)) == [
        "buffer/hook.py:1: buffer may not import actors.worker (allowed: buffer, common)",
        "common/late.py:3: common may not import ops.launch (allowed: common)",
        "learner/plugin.py:5: learner may not import actors.worker (allowed: learner, common, buffer.client)",
    ]


def test_a_cycle_between_ops_scripts_imported_by_bare_name_is_caught(tmp_path: Path) -> None:
    _write_tree(tmp_path, {
        "ops/__init__.py": "",
        "ops/bench/__init__.py": "",
        "ops/bench/suite.py": "import json\n\nimport tables\n",
        "ops/bench/tables.py": "from suite import RUNS\n",
        "ops/bench/learner.py": "from learner.train import Learner\n",  # the package, not its sibling
        "learner/__init__.py": "",
        "learner/train.py": "Learner = 1\n",
    })
    sources = collect_sources(tmp_path)
    imports = all_imports(sources)
    assert find_cycles(imports, set(sources)) == [
        "cycle: ops.bench.suite -> ops.bench.tables (ops/bench/suite.py:3); "
        "ops.bench.tables -> ops.bench.suite (ops/bench/tables.py:1)"]
    assert sorted(bare_violations(imports)) == [
        "ops/bench/suite.py:3: bare-name import tables: write it as ops.bench.tables",
        "ops/bench/tables.py:1: bare-name import suite: write it as ops.bench.suite",
    ]
