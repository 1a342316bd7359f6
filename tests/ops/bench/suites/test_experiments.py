"""ops/bench/suites/experiments.py: run states, the refusal to re-make a report from no finished run, the
listing, and the table of suites its main dispatches on (from hand-made run directories)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ops.bench.suites.default_suite import SHIPPED_CRITIC
from tests.ops.bench.bench_fixtures import ROOT, load_experiments, make_run


@pytest.fixture(scope="module")
def exp() -> ModuleType:
    return load_experiments()


def test_unfinished_run_is_not_loaded_and_status(exp: ModuleType, tmp_path: Path) -> None:
    e = exp.BY_NAME["grpo"]
    assert exp.status(tmp_path, e, 0) == "todo"
    (tmp_path / "grpo-s0" / "checkpoints" / "step-2").mkdir(parents=True)
    assert exp.status(tmp_path, e, 0) == "resumable"
    assert exp.load_run(tmp_path / "grpo-s0") is None
    (tmp_path / "grpo-s1").mkdir()
    assert exp.status(tmp_path, e, 1) == "partial"
    make_run(tmp_path / "grpo-s2", {0: 0.4, 2: 0.5})
    assert exp.status(tmp_path, e, 2) == "done"


def test_report_only_refuses_without_finished_runs(exp: ModuleType, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Runs are not in git: on another checkout (or with a mistyped --root) a report re-made from no finished run
    would empty its tables. Each suite that reports from run directories refuses and leaves the report as it was."""
    out = tmp_path / "RESULTS.md"
    out.write_text("# Results\n\ntables made from runs on another checkout\n")
    root = tmp_path / "runs"
    (root / "vapo-s0").mkdir(parents=True)  # started, never finished: no summary.json
    for suite in ("default", "long", "value_study"):
        argv = ["--suite", suite, "--report-only", "--root", str(root), "--out", str(out)]
        with pytest.raises(SystemExit) as stop:
            sys.exit(exp.main(argv))
        assert stop.value.code == 2, suite
        assert "none of this suite's runs finished under" in capsys.readouterr().err, suite
        assert out.read_text() == "# Results\n\ntables made from runs on another checkout\n", suite
    # A finished default-suite run counts for the default report only, not for the other suites' sections.
    make_run(root / "vapo-s1", {0: 0.45, 60: 0.8})
    assert exp.refuse_empty_report(root, [(e, s) for e in exp.SUITE for s in e.seeds]) is None
    for suite in ("long", "value_study"):
        with pytest.raises(SystemExit) as stop:
            sys.exit(exp.main(["--suite", suite, "--report-only", "--root", str(root), "--out", str(out)]))
        assert stop.value.code == 2 and out.read_text().endswith("another checkout\n"), suite


def test_cli_list(tmp_path: Path) -> None:
    make_run(tmp_path / "vapo-s0", {0: 0.45, 60: 0.8})
    out = subprocess.run([sys.executable, "-m", "ops.bench.suites.experiments", "--root", str(tmp_path), "--list",
                          "--only", "vapo"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    assert [ln.split()[:2] for ln in out[::2]] == [["vapo-s0", "done"], ["vapo-s1", "todo"], ["vapo-s2", "todo"]]
    # Every run is a plain launch a user can repeat.
    assert out[3].split() == ["ops/launch.sh", "ops/configs/default.yaml", "run.seed=1", "learner.total_steps=60",
                              *SHIPPED_CRITIC]
    bad = subprocess.run([sys.executable, "-m", "ops.bench.suites.experiments", "--only", "nope", "--list"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown experiment" in bad.stderr


def test_main_dispatches_each_suite_to_its_runner_with_its_own_root(exp: ModuleType, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """One table, one dispatch: each --suite reaches its own runner, at its default root unless --root is given."""
    calls: list[tuple[str, Path, bool]] = []
    for name, suite in list(exp.SUITES.items()):
        monkeypatch.setitem(exp.SUITES, name, exp.Suite(suite.root, lambda root, args, n=name: calls.append(
            (n, root, args.list)) or 7, suite.doc))
    for name in ("default", "long", "actor_values", "weight_sync", "value_study", "value_parts"):
        assert exp.main(["--suite", name, "--list"]) == 7
    assert exp.main(["--suite", "long", "--root", str(tmp_path)]) == 7
    rel = [(n, root.relative_to(ROOT).as_posix(), listed) for n, root, listed in calls[:-1]]
    assert rel == [("default", "runs/exp", True), ("long", "runs/exp-long", True),
                   ("actor_values", "runs/exp-actor-values", True), ("weight_sync", "runs/exp-weight-sync", True),
                   ("value_study", "runs/exp-value-study", True), ("value_parts", "runs/exp-value-parts", True)]
    assert calls[-1] == ("long", tmp_path.resolve(), False)
    with pytest.raises(SystemExit):
        exp.main(["--suite", "long", "--jobs", "0"])
    assert len(calls) == 7  # refused before any runner


def test_a_suite_states_its_estimate_before_its_first_run(exp: ModuleType, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """value_parts with --only two opt-in arms and --max-runs 4: the line giving 4 runs and the suite's minutes
    for them is printed before run_suite starts any."""
    import argparse

    from ops.bench.suites import value_parts_suite as vp

    printed_before: list[str] = []

    def fake_run_suite(root, todo, jobs, on_done=None) -> int:
        printed_before.append(capsys.readouterr().out)
        return 1  # a failure: the runner stops there

    monkeypatch.setattr(exp, "run_suite", fake_run_suite)
    monkeypatch.setattr(vp, "LEDGER", tmp_path / "none.jsonl")  # none recorded, whatever the committed ledger holds
    only = [vp.name("g2_paper_behaviour_a1"), vp.name("g16_loo_a1")]
    args = argparse.Namespace(only=only, seeds=None, list=False, report_only=False, max_runs=4, jobs=1,
                              out="unused.md")
    monkeypatch.setattr(vp, "summary", lambda root, load_run: {})
    monkeypatch.setattr(vp, "report", lambda root, summary, out: None)
    exp.run_actor_values(tmp_path, args, vp, "value_parts")
    minutes = 3 * vp.RUN_MIN * vp.PAPER_SHARE + vp.RUN_MIN
    assert f"experiments: 4 runs to start, ~{minutes:.0f} min" in printed_before[0]
