"""Every ``python -m ops....`` command the docs, the README, the scripts and the docstrings name still runs: the
module resolves, defines ``main`` and calls it when run as a script (or is a package with ``__main__.py``), and
imports cleanly. Moving a module (``ops/bench``'s suites, reports and probes went to their own folders) without
following every page that names it fails here."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"python -m (ops(?:\.[a-z_][a-z0-9_]*)+)(?![a-z0-9_.]*<)")


def named_commands(root: Path) -> dict[str, str]:
    """module -> the first file that names ``python -m <module>`` (a template like ``ops.bench.<name>`` aside)."""
    texts = [root / "README.md", *sorted(root.glob("docs/**/*.md")), *sorted(root.glob("ops/**/*.py")),
             *sorted(root.glob("ops/**/*.sh")), *sorted(root.glob("common/**/*.py")), root / ".ci" / "run"]
    found: dict[str, str] = {}
    for path in texts:
        if path.is_file():
            for mod in COMMAND.findall(path.read_text()):
                found.setdefault(mod, path.relative_to(root).as_posix())
    return found


def _runs_main(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    guard = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    return has_main and any("main(" in ast.unparse(g) for g in guard)


def unrunnable(root: Path, commands: dict[str, str]) -> list[str]:
    """The commands whose module is missing, or has no ``main`` that its ``__main__`` guard calls."""
    bad: list[str] = []
    for mod, where in sorted(commands.items()):
        base = root.joinpath(*mod.split("."))
        if (base / "__main__.py").is_file():
            continue
        if not base.with_suffix(".py").is_file():
            bad.append(f"{where}: python -m {mod} (no such module)")
        elif not _runs_main(base.with_suffix(".py")):
            bad.append(f"{where}: python -m {mod} (no main called under `if __name__ == \"__main__\"`)")
    return bad


def test_every_named_command_has_a_main_it_runs() -> None:
    commands = named_commands(ROOT)
    # a scan that lost its pages would pass vacuously
    assert {"ops.launch", "ops.bench.packing", "ops.bench.suites.experiments", "ops.bench.probes.critic_probe",
            "ops.bench.reports.compute_axes"} <= set(commands)
    assert "ops.bench." not in commands and "ops.bench" not in commands  # `python -m ops.bench.<name>` is a template
    assert unrunnable(ROOT, commands) == []


def test_every_named_command_module_imports() -> None:
    mods = sorted(m for m in named_commands(ROOT) if not (ROOT.joinpath(*m.split(".")) / "__main__.py").is_file())
    probe = ("import importlib, sys\n"
             "bad = [m for m in sys.argv[1:] if not callable(getattr(importlib.import_module(m), 'main', None))]\n"
             "print(bad)")
    p = subprocess.run([sys.executable, "-c", probe, *mods], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.strip() == "[]"


def test_the_check_names_a_missing_module_and_a_module_without_main(tmp_path: Path) -> None:
    (tmp_path / "ops" / "tool").mkdir(parents=True)
    (tmp_path / "ops" / "good.py").write_text("def main() -> int:\n    return 0\n\n\nif __name__ == '__main__':\n"
                                              "    raise SystemExit(main())\n")
    (tmp_path / "ops" / "script.py").write_text("if __name__ == '__main__':\n    print('no main')\n")
    (tmp_path / "ops" / "tool" / "__main__.py").write_text("print('a package')\n")
    (tmp_path / "README.md").write_text("Run `python -m ops.good`, `python -m ops.tool`, `python -m ops.script`,\n"
                                        "`python -m ops.gone --flag`, any `python -m ops.bench.<name>` or `python -m ops.x.y.<name>`.\n")
    commands = named_commands(tmp_path)
    assert sorted(commands) == ["ops.gone", "ops.good", "ops.script", "ops.tool"]
    assert unrunnable(tmp_path, commands) == [
        "README.md: python -m ops.gone (no such module)",
        'README.md: python -m ops.script (no main called under `if __name__ == "__main__"`)']
