"""ops/bench/suites/experiments.py: run bookkeeping, generated-sample accounting, interpolated samples-to-accuracy,
wall time net of evaluation, per-slot ports, and the report it writes (from hand-made run directories)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from common.config import load_config
from ops.bench.reports import value_parts_report, value_study_report
from ops.bench.suites import long_suite
from tests.ops.bench.bench_fixtures import ROOT, load_experiments, long_run, make_run


@pytest.fixture(scope="module")
def exp() -> ModuleType:
    return load_experiments()


def test_accounting_crossing_and_net_wall_time(exp: ModuleType, tmp_path: Path) -> None:
    make_run(tmp_path / "dapo-s0", {0: 0.4, 2: 0.6, 4: 0.8}, filtered_per_step=1)
    run = exp.load_run(tmp_path / "dapo-s0")
    assert [(p["step"], p["acc"]) for p in run.points] == [(0, 0.4), (2, 0.6), (4, 0.8)]
    # Paid for = trained + value pretraining ((1 step x 2 + 1 held-out) groups x G = 24) + filtered (8 per step).
    assert [p["cost"] for p in run.points] == [24, 24 + 80, 24 + 160] and run.points[-1]["samples"] == 128
    # Everything that reached the learner, stale drops included: G x (consumed + stale + filtered).
    assert run.points[-1]["gen"] == 8 * (19 + 4 + 4) and run.stale_share(4) == pytest.approx(32 / 216)
    # Evaluation pauses are not training time: 10 s per step.
    assert [p["t"] for p in run.points] == pytest.approx([0.0, 20.0, 40.0])
    # 0.7 is halfway from step 2 to step 4.
    assert run.crossing(0.7, "cost") == pytest.approx(24 + 120.0)
    assert run.crossing(0.7, "t") == pytest.approx(30.0)
    assert run.crossing(0.4, "cost") == 24 and run.crossing(0.81, "cost") is None
    assert run.throughput(4) == pytest.approx(128 / 40.0)  # trained samples per learner second
    assert run.final(2)["acc"] == 0.6 and run.final()["acc"] == 0.8 and run.base == 0.4


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


def test_every_experiment_resolves_and_slots_have_distinct_ports(exp: ModuleType) -> None:
    def ports(cfg) -> set[int]:
        return {cfg.engine.base_port, cfg.actors.metrics_base_port, cfg.buffer.metrics_port, cfg.learner.metrics_port,
                cfg.metrics.launcher_port, *(int(a.rsplit(":", 1)[1]) for a in (
                    cfg.buffer.ingest_addr, cfg.buffer.serve_addr, cfg.learner.publish_addr, cfg.learner.query_addr))}

    seen: set[int] = set()
    for slot in range(3):
        p = ports(load_config(ROOT / "ops/configs/default.yaml", exp.port_overrides(slot)))
        assert len(p) == 9 and not p & seen
        seen |= p
    for e in exp.SUITE:  # every override is a real, valid config key
        cfg = load_config(ROOT / e.config, [*e.overrides, f"learner.total_steps={e.steps}"])
        assert cfg.learner.total_steps == e.steps
    assert load_config(ROOT / "ops/configs/default.yaml", list(exp.BY_NAME["no_group_sampling"].overrides)).actors.group_size == 1


def test_report_tables_and_plots(exp: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    for s, top in enumerate((0.8, 0.7, 0.75)):
        make_run(root / f"vapo-s{s}", {0: 0.45, 20: 0.6, 40: 0.7, 60: top})
    make_run(root / "grpo-s0", {0: 0.45, 20: 0.55, 40: 0.6, 60: 0.65})
    make_run(root / "stale0-s0", {0: 0.45, 20: 0.6, 40: 0.7}, step_s=20.0)
    make_run(root / "grpo_sync-s0", {0: 0.45, 20: 0.55, 40: 0.6}, step_s=20.0)
    make_run(root / "no_nll-s0", {0: 0.45, 20: 0.5, 40: 0.55})
    notes = tmp_path / "notes.md"
    notes.write_text("## Reading\nhand-written")
    out = tmp_path / "docs" / "RESULTS.md"
    text = exp.write_report(root, out, notes)
    assert out.read_text() == text and "## Reading\nhand-written" in text
    assert "| VAPO (default) | 3 | 0.750 ± 0.050 (0.700–0.800) |" in text
    assert "| GRPO | 1 | 0.650 ± 0.000 (0.650–0.650) |" in text and "not reached" in text
    assert "| DAPO | 0 | not run yet |" in text
    assert "**0.700 ± 0.000**" in text  # VAPO at step 40 over 3 seeds
    assert "| VAPO − positive-example NLL<br>`nll.coef=0` | 0 (1 seed) | 0.550 | -0.150 |" in text
    # vapo steps take 10 s, the synchronous run 20 s: async is 2x the sync throughput.
    assert "| 1 (default) | 3 | 3.2 | 2.00× | 0.50 | 9.50 |" in text and "| 0 (sync) | 1 | 1.6 | 1.00× |" in text
    assert "| max_staleness=1 | 1 | 3.2 | 2.00× | 0.600 |" in text
    for png in ("baselines_samples", "baselines_trained", "baselines_time", "ablations", "staleness_time"):
        assert (out.parent / "results" / f"{png}.png").stat().st_size > 5000


def test_remade_default_report_keeps_the_other_suites_sections(exp: ModuleType, tmp_path: Path) -> None:
    """The long suite, the value parts and the value study write their own sections of RESULTS.md; re-making the
    default tables replaces only those tables and keeps the three sections, in their order."""
    blocks = [f"{begin}\n{name} reading\n{end}\n" for name, begin, end in (
        ("long", long_suite.BEGIN, long_suite.END), ("parts", value_parts_report.BEGIN, value_parts_report.END),
        ("study", value_study_report.BEGIN, value_study_report.END))]
    out = tmp_path / "RESULTS.md"
    out.write_text("# Results\n\nold default tables\n\n" + "\n".join(blocks))
    make_run(tmp_path / "runs" / "vapo-s0", {0: 0.45, 60: 0.8})
    exp.write_report(tmp_path / "runs", out, tmp_path / "no-notes.md")
    text = out.read_text()
    where = [text.find(b) for b in blocks]
    assert "old default tables" not in text and -1 not in where and where == sorted(where)


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
    assert out[3].split() == ["ops/launch.sh", "ops/configs/default.yaml", "run.seed=1", "learner.total_steps=60"]
    bad = subprocess.run([sys.executable, "-m", "ops.bench.suites.experiments", "--only", "nope", "--list"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown experiment" in bad.stderr


def test_wall_from_launch_adds_the_suites_bootstrap(exp: ModuleType, tmp_path: Path) -> None:
    import os

    make_run(tmp_path / "vapo-s0", {0: 0.45, 2: 0.6}, step_s=10.0, eval_s=3.0, base_time=1000.0)
    os.utime(tmp_path / "vapo-s0" / "config.yaml", (950.0, 950.0))  # launched 50 s before the base eval
    info = tmp_path / "_base" / "y" / "vapo_info.json"  # the suite's own build of the run's model.path (x/y)
    info.parent.mkdir(parents=True)
    info.write_text(json.dumps({"bootstrap": {"sft_seconds": 300.0}}))
    run = exp.load_run(tmp_path / "vapo-s0")
    # Step 2 is logged at 1000 + 10 + 13; from the launch that is 73 s, plus the 300 s bootstrap.
    assert run.bootstrap_seconds == 300.0 and run.launch_to[2] == pytest.approx(73.0 + 300.0)


def test_wall_from_launch_adds_no_bootstrap_for_a_shipped_base(exp: ModuleType, tmp_path: Path) -> None:
    import os

    make_run(tmp_path / "vapo-s0", {0: 0.45, 2: 0.6}, step_s=10.0, eval_s=3.0, base_time=1000.0)
    cfg_path = tmp_path / "vapo-s0" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["model"]["path"] = "ops/bases/addition-tiny"  # shipped with the repository: no user bootstraps it
    cfg_path.write_text(yaml.safe_dump(cfg))
    os.utime(cfg_path, (950.0, 950.0))
    info = tmp_path / "_base" / "addition-tiny" / "vapo_info.json"  # an old suite bootstrap must not be added
    info.parent.mkdir(parents=True)
    info.write_text(json.dumps({"bootstrap": {"sft_seconds": 300.0}}))
    run = exp.load_run(tmp_path / "vapo-s0")
    assert run.bootstrap_seconds is None and run.launch_to[2] == pytest.approx(73.0)


def test_long_suite_with_a_fixed_alpha_skips_the_sweep(exp: ModuleType, tmp_path: Path) -> None:
    ls = exp.long_suite
    root = tmp_path / "exp-long"
    for name in ("long_vapo_a1", "long_dapo"):
        for s in (0, 1):
            long_run(root / f"{name}-s{s}", {0: 0.45, 40: 0.7}, 0.5, advantage="gae" if "vapo" in name else "grpo")
    assert ls.pick_alpha(root) is None  # α = 0.05 and 0.2 never ran
    out = tmp_path / "RESULTS.md"
    block = exp.write_long_report(root, out, fixed_alpha=1.0)
    assert "| VAPO α = 1 (fixed, not swept) | 2 | 0.700 ± 0.000" in block and "(picked" not in block
    assert "VAPO α = 0.05" not in block and "### α sweep\n\nNot re-measured" in block  # a pointer, not empty rows
    long_run(root / "long_vapo_a0.2-s0", {0: 0.45, 40: 0.6}, 0.5)
    block = exp.write_long_report(root, out, fixed_alpha=1.0)
    assert "| 1 (fixed) |" in block and "| 0.05 | 0.60 / 0.87 / 0.95 | not run yet |" in block
    listed = subprocess.run([sys.executable, "-m", "ops.bench.suites.experiments", "--suite", "long", "--root",
                             str(root), "--alpha", "1", "--list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert listed.splitlines()[0] == "α given by --alpha: 1" and "long_vapo_a1-s2" in listed and "long_vapo_plain-s0" in listed


def test_long_suite_picks_alpha_on_training_reward_and_keeps_the_default_tables(exp: ModuleType, tmp_path: Path) -> None:
    ls = exp.long_suite
    root = tmp_path / "exp-long"
    steps = {0: 0.45, 20: 0.6, 40: 0.7}
    # The held-out winner (α = 1) is not the training-reward winner (α = 0.2): the pick must not peek.
    for a, acc, reward in ((0.05, 0.65, 0.50), (0.2, 0.70, 0.62), (1.0, 0.80, 0.55)):
        assert ls.pick_alpha(root) is None  # unfinished sweep: nothing picked, phase 2 waits
        long_run(root / f"long_vapo_a{a:g}-s0", steps | {40: acc}, reward)
    assert ls.pick_alpha(root) == 0.2
    assert "long_vapo_plain" not in {e.name for e in ls.experiments(exp.Experiment, None)}  # needs the picked α
    suite = {e.name: e for e in ls.experiments(exp.Experiment, 0.2)}
    assert suite["long_vapo_a0.2"].seeds == (0, 1, 2) and suite["long_vapo_a1"].seeds == (0,)
    plain = load_config(ROOT / ls.CONFIG, list(suite["long_vapo_plain"].overrides))
    assert plain.algo.alpha == 0.2 and not plain.learner.value_head_surprise and plain.algo.advantage == "gae"
    assert plain.value_pretrain.steps == 10  # long.yaml's pretraining; only the second follow-up changes it
    pt = load_config(ROOT / ls.CONFIG, list(suite["long_vapo_plain_pt50"].overrides))
    assert (pt.algo.alpha, pt.learner.value_head_surprise, pt.value_pretrain.steps, pt.value_pretrain.lr) == (0.2, False, 50, 5e-4)
    assert pt.value_pretrain.patience >= pt.value_pretrain.steps and pt.learner.critic_lr == plain.learner.critic_lr
    assert list(suite)[-1] == "long_vapo_plain_pt50"  # the costliest run goes last
    for e in suite.values():  # every baseline override is a real key of long.yaml's tree
        cfg = load_config(ROOT / e.config, [*e.overrides, f"learner.total_steps={e.steps}"])
        assert cfg.task.name == "chain"
    dapo = load_config(ROOT / ls.CONFIG, list(suite["long_dapo"].overrides))
    assert dapo.algo.advantage == "grpo" and dapo.buffer.filter_uniform_groups and not dapo.value_pretrain.enabled
    for s in (0, 1, 2):
        long_run(root / f"long_dapo-s{s}", steps | {40: 0.6 + 0.01 * s}, 0.5, advantage="grpo")
    (root / "long_vapo_a0.2-s0" / "value_curve.json").write_text(json.dumps(
        {"failed_checked": 31, "value_before_first_mistake": 0.6, "value_after_first_mistake": 0.2,
         "value_change_at_mistake": -0.25, "fraction_dropping": 0.9, "mean_abs_change_elsewhere": 0.01}))
    out = tmp_path / "RESULTS.md"
    out.write_text("# Results\n\ndefault-task tables\n")
    block = exp.write_long_report(root, out)
    text = out.read_text()
    assert text.startswith("# Results\n\ndefault-task tables\n") and text.count(ls.BEGIN) == 1
    assert "| VAPO α = 0.2 (picked by the sweep) | 1 | 0.700 ± 0.000 (0.700–0.700) | 0.950 | 0.800 / 0.700 / 0.600 |" in block
    assert "| DAPO | 3 | 0.610 ± 0.010 (0.600–0.620) |" in block and "| GRPO | 0 | not run yet |" in block
    assert "| 0.2 **(picked)** | 0.90 / 0.97 / 0.99 | 0.700 |" in block and "| 0.05 | 0.60 / 0.87 / 0.95 |" in block
    assert "| 31 | 0.600 → 0.200 | -0.250 (0.90) | 0.010 |" in block
    assert "| long_vapo_a0.2-s0 | 24, 0 s, 0.400 | 0.30 / 0.30 / 0.30 / 0.30 / 0.30 |" in block  # (2 + 1) groups x G
    # Writing it again replaces the section; re-making the default task's report keeps it.
    exp.write_long_report(root, out)
    assert out.read_text() == text
    exp.write_report(tmp_path / "none", out, tmp_path / "no-notes.md")
    assert out.read_text().count(ls.BEGIN) == 1 and "(picked by the sweep)" in out.read_text()
    # No ablation, staleness or α run under that root: each section points to the earlier tables instead.
    assert out.read_text().count("Not re-measured from the shipped bases") == 3
    for png in ("long_samples", "long_critic_ev"):
        assert (tmp_path / "results" / f"{png}.png").stat().st_size > 5000


def test_long_suite_reads_buckets_from_a_rerun_final_evaluation(exp: ModuleType, tmp_path: Path) -> None:
    # Runs made before the learner kept accuracy by bucket get it from final_eval.json (same weights, seed, k).
    ls = exp.long_suite
    make_run(tmp_path / "old-s0", {0: 0.3, 40: 0.6})
    assert "by_bucket" not in ls.last_eval(tmp_path / "old-s0")
    (tmp_path / "old-s0" / "final_eval.json").write_text(json.dumps(
        {"avg_at_k": 0.6, "by_bucket": {"long": {"avg_at_k": 0.4}}, "by_response_length": {}}))
    rec = ls.last_eval(tmp_path / "old-s0")
    assert rec["avg_at_k"] == 0.6 and rec["by_bucket"] == {"long": {"avg_at_k": 0.4}} and rec["step"] == 40
    long_run(tmp_path / "new-s0", {0: 0.3, 40: 0.6}, 0.5)
    ls.final_eval(tmp_path / "new-s0", print)  # it has the tables already: nothing to re-run
    assert not (tmp_path / "new-s0" / "final_eval.json").exists()


def test_actor_values_suite_resolves_and_summarises(exp: ModuleType, tmp_path: Path) -> None:
    """The pre- vs post-update critic comparison: 2 tasks x 2 arms x 2 seeds at equal samples, every run a
    valid config that differs from its twin only in algo.actor_values; the JSON line summarises finished runs
    (final avg@8 at step 40, reported EV, mismatch KL on the steps that measured one). The default-task change
    arms each turn exactly one learner-maths default off."""
    suite = exp.actor_values_suite.experiments(exp.Experiment)
    assert len(suite) == 6 and all(e.seeds == (0, 1) and e.steps == 40 for e in suite)
    for e in suite[:4]:
        cfg = load_config(ROOT / e.config, [*e.overrides, f"learner.total_steps={e.steps}"])
        assert cfg.algo.actor_values == e.name.split("_", 2)[2]
    reference = load_config(ROOT / "ops/configs/default.yaml", [])
    for e, (key, off) in zip(suite[4:], (("clip_ratio_c", 0.0), ("truncated", "keep")), strict=True):
        cfg = load_config(ROOT / e.config, list(e.overrides))
        assert e.name.startswith("av_default_") and getattr(cfg.algo, key) == off != getattr(reference.algo, key)
    for arm, acc in (("post_update", 0.6), ("pre_update", 0.7)):
        for s in (0, 1):
            make_run(tmp_path / f"av_default_{arm}-s{s}", {0: 0.4, 40: acc + 0.02 * s})
    d = tmp_path / "av_default_pre_update-s0"
    recs = (d / "metrics.jsonl").read_text().splitlines()[:-1]
    recs = [json.dumps(json.loads(r) | {"mismatch_tokens": 10, "mismatch_kl": 0.002}) for r in recs]
    (d / "metrics.jsonl").write_text("\n".join(recs) + "\n")
    out = exp.actor_values_suite.summary(tmp_path, exp.load_run)
    assert out["default/post_update"]["final_avg_at_8"] == pytest.approx(0.61)
    assert out["default/pre_update"]["per_seed"] == [0.7, 0.72] and out["default/pre_update"]["ev_mean"] == 0.3
    assert out["default/pre_update"]["mismatch_kl_mean"] == 0.002 and out["default/post_update"]["mismatch_kl_mean"] is None
    assert out["long/pre_update"]["seeds_done"] == 0 and out["default/no_dual_clip"]["seeds_done"] == 0


def test_weight_sync_suite_engine_bound_arms_resolve_and_are_opt_in(exp: ModuleType, tmp_path: Path) -> None:
    """The engine-bound pair: valid configs on the long task that differ from the default pair only in the
    generation-bound overrides (and from each other only in the weight transport); run only when named."""
    ws = exp.weight_sync_suite
    suite = {e.name: e for e in ws.experiments(exp.Experiment)}
    assert set(suite) == {"ws_long_wait", "ws_long_in_place", "ws_long_wait_engine_bound", "ws_long_in_place_engine_bound"}
    assert ws.OPT_IN == {"ws_long_wait_engine_bound", "ws_long_in_place_engine_bound"}
    base = load_config(ROOT / ws.CONFIG, [])
    for arm in ("wait", "in_place"):
        plain = load_config(ROOT / ws.CONFIG, [*suite[f"ws_long_{arm}"].overrides, f"learner.total_steps={ws.STEPS}"])
        bound = load_config(ROOT / ws.CONFIG, [*suite[f"ws_long_{arm}_engine_bound"].overrides,
                                               f"learner.total_steps={ws.STEPS}"])
        assert bound.learner.weight_transport == plain.learner.weight_transport
        assert (bound.buffer.max_staleness, bound.learner.off_policy, bound.actors.prompts_in_flight) == (4, "decoupled", 32)
        assert (plain.buffer.max_staleness, plain.learner.off_policy) == (base.buffer.max_staleness, base.learner.off_policy)
        # 32 prompts x 8 samples fit the engine's batch: it decodes every sequence the credit allows at once
        assert bound.actors.prompts_in_flight * bound.actors.group_size <= bound.engine.max_batch_size
    out = subprocess.run([sys.executable, "-m", "ops.bench.suites.experiments", "--suite", "weight_sync", "--root",
                          str(tmp_path), "--list"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "ws_long_in_place-s1" in out and "engine_bound" not in out
    out = subprocess.run([sys.executable, "-m", "ops.bench.suites.experiments", "--suite", "weight_sync", "--root",
                          str(tmp_path), "--list", "--only", "ws_long_in_place_engine_bound"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() and all(line.startswith("ws_long_in_place_engine_bound-s") for line in out.splitlines())
    summary = ws.summary(tmp_path, exp.load_run)
    assert set(summary) == {"wait", "in_place", "wait_engine_bound", "in_place_engine_bound"}
    assert all(v["seeds_done"] == 0 for v in summary.values())


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
