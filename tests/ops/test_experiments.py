"""ops/bench/experiments.py: run bookkeeping, generated-sample accounting, interpolated samples-to-accuracy,
wall time net of evaluation, per-slot ports, and the report it writes (from hand-made run directories)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from common.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exp() -> ModuleType:
    spec = importlib.util.spec_from_file_location("experiments_mod", ROOT / "ops" / "bench" / "experiments.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["experiments_mod"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def make_run(d: Path, accs: dict[int, float], group_size: int = 8, filtered_per_step: int = 0,
             step_s: float = 10.0, eval_s: float = 3.0, base_time: float = 1000.0) -> None:
    """A finished run: base eval at ``base_time``, one step every ``step_s`` seconds (plus ``eval_s`` when it
    evaluates), 4 groups consumed per step, ``filtered_per_step`` uniform groups dropped per step."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"actors": {"group_size": group_size}, "model": {"path": "x/y"},
                                                   "value_pretrain": {"batch_groups": 2, "eval_groups": 1}}))
    recs = [{"kind": "value_pretrain", "step": 1, "explained_variance": 0.4, "time": base_time - 5},
            {"kind": "eval", "weight_version": 0, "step": 0, "time": base_time, "avg_at_k": accs[0],
             "greedy_accuracy": 0.9}]
    t = base_time
    for step in range(1, max(accs) + 1):
        evals = step in accs
        t += step_s + (eval_s if evals else 0.0)
        r = {"kind": "learner_step", "step": step, "weight_version": step, "time": t, "samples": 4 * group_size,
             "groups_consumed_total": 4 * step + 3, "stale_dropped_total": step, "filtered_total": filtered_per_step * step,
             "phase_seconds": {"fetch": 0.5, "actor_update": 9.5} | ({"eval": eval_s} if evals else {}),
             "value_explained_variance": 0.3,
             "response_length_mean": 40.0 + step, "entropy": 0.1, "staleness_mean": 0.5, "reward_mean": 0.5}
        if evals:
            r["eval"] = {"avg_at_k": accs[step], "greedy_accuracy": 0.95}
        recs.append(r)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n{cut by a cra")
    (d / "summary.json").write_text(json.dumps({"value_pretrain_explained_variance": 0.4, "wall_seconds": 99.0}))


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


def test_cli_list(tmp_path: Path) -> None:
    make_run(tmp_path / "vapo-s0", {0: 0.45, 60: 0.8})
    out = subprocess.run([sys.executable, str(ROOT / "ops/bench/experiments.py"), "--root", str(tmp_path), "--list",
                          "--only", "vapo"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert [ln.split()[:2] for ln in out[::2]] == [["vapo-s0", "done"], ["vapo-s1", "todo"], ["vapo-s2", "todo"]]
    # Every run is a plain launch a user can repeat.
    assert out[3].split() == ["ops/launch.sh", "ops/configs/default.yaml", "run.seed=1", "learner.total_steps=60"]
    bad = subprocess.run([sys.executable, str(ROOT / "ops/bench/experiments.py"), "--only", "nope", "--list"],
                         capture_output=True, text=True)
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
            _long_run(root / f"{name}-s{s}", {0: 0.45, 40: 0.7}, 0.5, advantage="gae" if "vapo" in name else "grpo")
    assert ls.pick_alpha(root) is None  # α = 0.05 and 0.2 never ran
    out = tmp_path / "RESULTS.md"
    block = exp.write_long_report(root, out, fixed_alpha=1.0)
    assert "| VAPO α = 1 (fixed, not swept) | 2 | 0.700 ± 0.000" in block and "(picked" not in block
    assert "VAPO α = 0.05" not in block and "### α sweep\n\nNot re-measured" in block  # a pointer, not empty rows
    _long_run(root / "long_vapo_a0.2-s0", {0: 0.45, 40: 0.6}, 0.5)
    block = exp.write_long_report(root, out, fixed_alpha=1.0)
    assert "| 1 (fixed) |" in block and "| 0.05 | 0.60 / 0.87 / 0.95 | not run yet |" in block
    listed = subprocess.run([sys.executable, str(ROOT / "ops/bench/experiments.py"), "--suite", "long", "--root",
                             str(root), "--alpha", "1", "--list"], capture_output=True, text=True, check=True).stdout
    assert listed.splitlines()[0] == "α given by --alpha: 1" and "long_vapo_a1-s2" in listed and "long_vapo_plain-s0" in listed


def _long_run(d: Path, accs: dict[int, float], reward: float, advantage: str = "gae") -> None:
    """A finished long-suite run: make_run plus per-bucket held-out accuracy and the late training reward."""
    make_run(d, accs)
    cfg = yaml.safe_load((d / "config.yaml").read_text()) | {"algo": {"advantage": advantage}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()[:-1]]
    for r in recs:
        if r["kind"] == "learner_step":
            r["reward_mean"] = reward
        ev = r if r["kind"] == "eval" else r.get("eval")
        if ev is not None:
            ev.update({"by_bucket": {b: {"avg_at_k": ev["avg_at_k"] + dv} for b, dv in
                                     (("short", 0.1), ("medium", 0.0), ("long", -0.1))},
                       "min_response_length": 49, "max_response_length": 400, "mean_response_length": 150.0,
                       "by_response_length": {"<=64": {"n_samples": 10, "avg_at_k": 0.9}}})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_long_suite_picks_alpha_on_training_reward_and_keeps_the_default_tables(exp: ModuleType, tmp_path: Path) -> None:
    ls = exp.long_suite
    root = tmp_path / "exp-long"
    steps = {0: 0.45, 20: 0.6, 40: 0.7}
    # The held-out winner (α = 1) is not the training-reward winner (α = 0.2): the pick must not peek.
    for a, acc, reward in ((0.05, 0.65, 0.50), (0.2, 0.70, 0.62), (1.0, 0.80, 0.55)):
        assert ls.pick_alpha(root) is None  # unfinished sweep: nothing picked, phase 2 waits
        _long_run(root / f"long_vapo_a{a:g}-s0", steps | {40: acc}, reward)
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
        _long_run(root / f"long_dapo-s{s}", steps | {40: 0.6 + 0.01 * s}, 0.5, advantage="grpo")
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
    _long_run(tmp_path / "new-s0", {0: 0.3, 40: 0.6}, 0.5)
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
    out = subprocess.run([sys.executable, str(ROOT / "ops/bench/experiments.py"), "--suite", "weight_sync", "--root",
                          str(tmp_path), "--list"], capture_output=True, text=True, check=True).stdout
    assert "ws_long_in_place-s1" in out and "engine_bound" not in out
    out = subprocess.run([sys.executable, str(ROOT / "ops/bench/experiments.py"), "--suite", "weight_sync", "--root",
                          str(tmp_path), "--list", "--only", "ws_long_in_place_engine_bound"],
                         capture_output=True, text=True, check=True).stdout
    assert out.split() and all(line.startswith("ws_long_in_place_engine_bound-s") for line in out.splitlines())
    summary = ws.summary(tmp_path, exp.load_run)
    assert set(summary) == {"wait", "in_place", "wait_engine_bound", "in_place_engine_bound"}
    assert all(v["seeds_done"] == 0 for v in summary.values())


def _edit_records(d: Path, **extra: object) -> None:
    """Add ``extra`` to every record of the run's metrics.jsonl (``pretrain_s``: seconds of its value_pretrain record)."""
    recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines() if ln.startswith("{\"")]
    for r in recs:
        if r["kind"] == "value_pretrain" and "pretrain_s" in extra:
            r["seconds"] = extra["pretrain_s"]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def test_value_study_cells_resolve_at_equal_samples(exp: ModuleType) -> None:
    """Every run of the value study is a valid long.yaml config; every cell trains (and pretrains, and decodes
    at once) the same samples per step at any G, and its two arms differ only in the method's keys."""
    from common.tasks import get_task

    vs = exp.value_study_suite
    suite = vs.experiments(exp.Experiment)
    assert len(suite) == len({e.name for e in suite}) == 18 and all(e.seeds == (0,) and e.steps == 40 for e in suite)
    cfgs = {e.name: load_config(ROOT / e.config, [*e.overrides, f"learner.total_steps={e.steps}"]) for e in suite}
    for name, cfg in cfgs.items():
        g = cfg.actors.group_size
        assert cfg.task.name == "chain" and g * cfg.learner.batch_groups == 256 and g * cfg.actors.prompts_in_flight == 128
        vapo = name.endswith("_vapo")
        assert (cfg.algo.advantage == "gae") == vapo and cfg.buffer.filter_uniform_groups != vapo
        if vapo:
            assert g * cfg.value_pretrain.batch_groups == g * cfg.value_pretrain.eval_groups == 256
    assert sorted(cfgs[f"vs_g{g}_dapo"].actors.group_size for g in (2, 4, 8, 16)) == [2, 4, 8, 16]
    for c in vs.CELLS:  # the two arms see the same task, group size and batch
        v, d = (cfgs[n] for n in vs.arms(c).values())
        assert (v.task, v.actors, v.learner.batch_groups) == (d.task, d.actors, d.learner.batch_groups)
    hard = cfgs["vs_hard_vapo"].task
    prompts = get_task(hard).eval_prompts()  # every held-out item of 35-44 additions, all of them long
    assert hard.min_steps == 35 and len(prompts) == hard.eval_size and {p.bucket for p in prompts} == {"long"}
    assert cfgs["vs_longest_dapo"].task.min_steps == 20 and cfgs["vs_g8_vapo"].task == cfgs["vs_g2_vapo"].task
    for a in (1.0, 0.2, 0.05):  # (d): the critic's budget x α, against the G = 8 DAPO arm
        cell = vs.BY_CELL[f"pt50_a{a:g}"]
        cfg = cfgs[vs.arms(cell)["vapo"]]
        assert vs.arms(cell)["dapo"] == "vs_g8_dapo" and cfg.algo.alpha == a
        assert cfg.value_pretrain.steps == 50 <= cfg.value_pretrain.patience and cfg.actors.group_size == 8
        x2 = cfgs[vs.arms(vs.BY_CELL[f"x2_a{a:g}"])["vapo"]]  # the same, with the critic twice the policy
        assert x2.model.critic_path == vs.CRITIC_X2 and x2.algo == cfg.algo and x2.value_pretrain == cfg.value_pretrain
        assert vs.arms(vs.BY_CELL[f"x2_a{a:g}"])["dapo"] == "vs_g8_dapo" and not cfg.model.critic_path
    assert cfgs["vs_g8_vapo"].value_pretrain.steps == 10 and cfgs["vs_g8_vapo"].algo.alpha == 1.0
    # The stated estimate: phase 1 as the docstring says, phase 2 the rest of the 5 h.
    assert f"~{vs.phase1_minutes():.0f} min" in vs.__doc__ and vs.phase1_minutes() + vs.phase2_budget() == 300


def _value_study_phase1(root: Path, finals: dict[str, float], skip: str = "") -> None:
    """Seed 0 of every value-study run but ``skip``, each ending at ``finals[name]`` (default 0.55)."""
    for name in ["vs_g2_vapo", "vs_g2_dapo", "vs_g4_vapo", "vs_g4_dapo", "vs_g8_vapo", "vs_g8_dapo", "vs_g16_vapo",
                 "vs_g16_dapo", "vs_hard_vapo", "vs_hard_dapo", "vs_longest_vapo", "vs_longest_dapo",
                 "vs_pt50_a1_vapo", "vs_pt50_a0.2_vapo", "vs_pt50_a0.05_vapo", "vs_x2_a1_vapo", "vs_x2_a0.2_vapo",
                 "vs_x2_a0.05_vapo"]:
        if name != skip:
            make_run(root / f"{name}-s0", {0: 0.3, 20: 0.45, 40: finals.get(name, 0.55)})


def test_value_study_phase2_follows_phase1(exp: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase 2 waits for every seed-0 run, then gives seeds 1-2 to the cells past the threshold, largest |Δ|
    first, as far as the budget goes; a shared DAPO arm gets them once, with the cell that needs it."""
    vs = exp.value_study_suite
    finals = {"vs_g2_vapo": 0.70, "vs_hard_vapo": 0.43, "vs_g4_vapo": 0.61, "vs_pt50_a0.2_vapo": 0.62,
              "vs_g16_vapo": 0.56}  # Δ: g2 +0.15, hard −0.12, pt50_a0.2 +0.07, g4 +0.06, g16 +0.01
    _value_study_phase1(tmp_path, finals, skip="vs_hard_vapo")
    assert vs.pick_phase2(tmp_path) is None and all(e.seeds == (0,) for e in vs.experiments(exp.Experiment, tmp_path))
    make_run(tmp_path / "vs_hard_vapo-s1", {0: 0.3, 40: 0.43})  # another seed does not stand in for seed 0
    assert vs.pick_phase2(tmp_path) is None
    make_run(tmp_path / "vs_hard_vapo-s0", {0: 0.3, 20: 0.4, 40: 0.43})
    # ~92 min: g2 (34) fits, hard (64) does not, the next that fits is taken: pt50_a0.2 (35, with G = 8's DAPO);
    # then g4 (28) does not fit. With 100 min hard fits after g2 and nothing else does.
    assert vs.pick_phase2(tmp_path) == ["g2", "pt50_a0.2"]
    assert vs.pick_phase2(tmp_path, budget_min=100) == ["g2", "hard"]
    assert vs.pick_phase2(tmp_path, budget_min=1000) == ["g2", "hard", "pt50_a0.2", "g4"]
    seeds = {e.name: e.seeds for e in vs.experiments(exp.Experiment, tmp_path)}
    three = {n for n, s in seeds.items() if s == (0, 1, 2)}
    assert three == {"vs_g2_vapo", "vs_g2_dapo", "vs_pt50_a0.2_vapo", "vs_g8_dapo"}
    assert all(s == (0,) for n, s in seeds.items() if n not in three)
    out = subprocess.run([sys.executable, str(ROOT / "ops/bench/experiments.py"), "--suite", "value_study", "--list",
                          "--root", str(tmp_path)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert "phase 2 picked g2, pt50_a0.2" in out[0] and len(out) == 1 + 18 + 4 * 2  # 4 runs got seeds 1 and 2
    assert out[1].split()[:5] == ["vs_g2_vapo-s0", "done", "40", "steps", "~8"]
    monkeypatch.setattr(vs, "BUDGET_MIN", vs.BUDGET_MIN + 42)  # ~134 min for phase 2: g2, hard, then pt50_a0.2
    seeds = {e.name: e.seeds for e in vs.experiments(exp.Experiment, tmp_path)}
    # its DAPO arm is G = 8's, which gets seeds 1 and 2 once, with the cell that needs it
    assert {n for n, s in seeds.items() if s == (0, 1, 2)} == {"vs_g2_vapo", "vs_g2_dapo", "vs_hard_vapo", "vs_hard_dapo",
                                                              "vs_pt50_a0.2_vapo", "vs_g8_dapo"}


def test_value_study_phase2_measure_is_paid_samples_except_for_the_critic_cells(exp: ModuleType, tmp_path: Path) -> None:
    """(a)-(c) are compared at equal paid samples: a DAPO arm equal at step 40 that dropped a group for every one
    it trained is behind where VAPO's budget ends. The critic cells (d) share that DAPO arm but compare at step
    40, so it does not pick them."""
    vs = exp.value_study_suite
    _value_study_phase1(tmp_path, {})
    shutil.rmtree(tmp_path / "vs_g8_dapo-s0")
    make_run(tmp_path / "vs_g8_dapo-s0", {0: 0.3, 20: 0.45, 40: 0.55}, filtered_per_step=4)
    assert exp.load_run(tmp_path / "vs_g8_dapo-s0").final(40)["acc"] == 0.55  # a tie at equal trained samples
    # VAPO's 1304 paid samples are DAPO's step 20 (24 + 20 x 64): 0.55 − 0.45.
    assert vs.seed0_delta(vs.BY_CELL["g8"], tmp_path, exp.load_run) == pytest.approx(0.10)
    assert vs.seed0_delta(vs.BY_CELL["pt50_a0.2"], tmp_path, exp.load_run) == 0.0
    assert vs.pick_phase2(tmp_path) == ["g8"]


def test_value_study_summary(exp: ModuleType, tmp_path: Path) -> None:
    """Per cell: each arm's final avg@8 and buckets, Δ over all seeds, seed 0 and seeds 1-2 apart, and at equal
    learner time with value pretraining's seconds on VAPO's clock."""
    vs = exp.value_study_suite
    _value_study_phase1(tmp_path, {"vs_g2_vapo": 0.70})
    for arm, top in (("vapo", 0.70), ("dapo", 0.55)):
        for s in (0, 1, 2):
            d = tmp_path / f"vs_g2_{arm}-s{s}"
            shutil.rmtree(d, ignore_errors=True)
            _long_run(d, {0: 0.3, 20: 0.5 if arm == "vapo" else 0.45, 40: top + 0.01 * s}, 0.5)
    _edit_records(tmp_path / "vs_g2_vapo-s0", pretrain_s=50.0)
    out = vs.summary(tmp_path, exp.load_run)
    g2 = out["g2"]
    assert out["_phase2"] == ["g2"] and g2["phase2"] and not out["g4"]["phase2"]
    assert g2["vapo"]["per_seed"] == {"0": 0.7, "1": 0.71, "2": 0.72} and g2["dapo"]["final_avg_at_8"] == 0.56
    assert g2["vapo_minus_dapo"] == g2["vapo_minus_dapo_seed0"] == g2["vapo_minus_dapo_confirm"] == 0.15
    assert g2["vapo"]["by_bucket"] == {"short": 0.81, "medium": 0.71, "long": 0.61} and g2["vapo"]["ev_mean"] == 0.3
    assert g2["by_bucket_vapo_minus_dapo"] == {"short": 0.15, "medium": 0.15, "long": 0.15}
    # 10 s a step: every run's final learner time is 400 s, VAPO seed 0's 450 (50 s pretraining). At 400 s that
    # seed is 350 s into RL: 0.5 + 0.2 x 150/200 = 0.65; the others are at their finals.
    assert g2["vapo"]["learner_s"] == pytest.approx((450 + 400 + 400) / 3, abs=0.1)
    eq = g2["equal_learner_time"]
    assert eq["t_s"] == 400.0 and eq["vapo"] == pytest.approx((0.65 + 0.71 + 0.72) / 3, abs=1e-4)
    assert eq["dapo"] == 0.56 and eq["vapo_minus_dapo"] == pytest.approx(eq["vapo"] - 0.56, abs=1e-4)
    # Paid samples: 40 steps x 32 trained + (1 pretraining step x 2 + 1 held-out) groups x 8 = 1304 for every run
    # here, so both arms are compared at their finals; a DAPO arm that dropped groups ends later and is cut back.
    assert g2["equal_paid_samples"] == {"samples": 1304.0, "vapo": 0.71, "dapo": 0.56, "vapo_minus_dapo": 0.15}
    for s in (0, 1, 2):
        d = tmp_path / f"vs_g2_dapo-s{s}"
        shutil.rmtree(d)
        make_run(d, {0: 0.3, 20: 0.45, 40: 0.56 + 0.01 * s}, filtered_per_step=4)  # pays 32 more samples a step
    es = vs.summary(tmp_path, exp.load_run)["g2"]["equal_paid_samples"]
    # At 1304 paid samples (1304 = 24 + 40 x 32), DAPO is at step 20 (24 + 20 x 64 = 1304): 0.45 on every seed.
    assert es["samples"] == 1304.0 and es["dapo"] == pytest.approx(0.45) and es["vapo_minus_dapo"] == pytest.approx(0.71 - 0.45)
    assert out["hard"]["vapo_minus_dapo_confirm"] is None and out["hard"]["vapo_minus_dapo_seed0"] == 0.0
    assert out["pt50_a1"]["dapo"]["run"] == "vs_g8_dapo"


def test_value_study_report_section_survives_a_remade_report(exp: ModuleType, tmp_path: Path) -> None:
    """The study's section of RESULTS.md: one row per cell from the summary, the critic's credit where probed;
    written twice it is the same, and re-making the default report keeps it."""
    import value_study_report as vr

    vs = exp.value_study_suite
    _value_study_phase1(tmp_path, {"vs_g2_vapo": 0.70})
    for arm, top in (("vapo", 0.70), ("dapo", 0.55)):
        for s in (0, 1, 2):
            shutil.rmtree(tmp_path / f"vs_g2_{arm}-s{s}", ignore_errors=True)
            _long_run(tmp_path / f"vs_g2_{arm}-s{s}", {0: 0.3, 20: 0.5, 40: top + 0.01 * s}, 0.5)
    (tmp_path / "vs_g2_vapo-s0" / "value_curve.json").write_text(json.dumps(
        {"value_change_at_mistake": -0.4, "fraction_dropping": 0.98, "mean_abs_change_elsewhere": 0.012,
         "advantage_share_on_mistake_line": 0.088, "uniform_share_on_mistake_line": 0.035,
         "advantage_before_mistake_line": -2.03, "advantage_on_mistake_line": -2.1, "advantage_after_mistake_line": -0.5}))
    out = tmp_path / "RESULTS.md"
    out.write_text("# Results\n\ndefault-task tables\n")
    block = vr.write(tmp_path, out, vs.summary(tmp_path, exp.load_run), notes=None)
    assert out.read_text().startswith("# Results\n\ndefault-task tables\n") and out.read_text().count(vr.BEGIN) == 1
    assert ("| (a) G = 2, 128 prompts per step **[3 seeds]** | 0.710 (0.700, 0.710, 0.720) | 0.560 (0.550, 0.560, 0.570) "
            "| **+0.150** (seed 0 +0.150, seeds 1-2 +0.150) | +0.150 / +0.150 / +0.150 | +0.150 (1.3k) | +0.150 (400) "
            "| 1.3k / 1.3k |") in block
    assert "| (a) G = 4, 64 prompts per step | 0.550 (0.550) | 0.550 (0.550) | **+0.000** |" in block
    assert "Phase 2 (seeds 1-2 for |Δ| > 0.05 at seed 0: at equal paid samples for (a)-(c), at step 40 for (d)): g2." in block
    assert ("| (a) G = 2, 128 prompts per step | -0.400 (0.98) | 0.012 | 0.088 / — (0.035) | -2.03 / -2.10 / -0.50 "
            "| — / — / — |") in block  # a probe from before the raw figures
    text = out.read_text()
    vr.write(tmp_path, out, vs.summary(tmp_path, exp.load_run), notes=None)
    assert out.read_text() == text
    exp.write_report(tmp_path / "none", out, tmp_path / "no-notes.md")
    assert block.strip() in out.read_text() and out.read_text().count(vr.END) == 1
