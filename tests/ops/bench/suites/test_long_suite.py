"""ops/bench/suites/long_suite.py: the α sweep's pick (on training reward, never on held-out accuracy), a fixed α
that skips the sweep, the follow-up runs' configs, and its section of the report (from hand-made run directories)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from common.config import load_config
from tests.ops.bench.bench_fixtures import ROOT, load_experiments, long_run, make_run


@pytest.fixture(scope="module")
def exp() -> ModuleType:
    return load_experiments()


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
    plain = load_config(ROOT / ls.CONFIG, list(suite["long_vapo_plain"].launch_overrides))
    assert plain.algo.alpha == 0.2 and not plain.learner.value_head_surprise and plain.algo.advantage == "gae"
    assert plain.value_pretrain.steps == 10  # long.yaml's pretraining; only the second follow-up changes it
    pt = load_config(ROOT / ls.CONFIG, list(suite["long_vapo_plain_pt50"].launch_overrides))
    assert (pt.algo.alpha, pt.learner.value_head_surprise, pt.value_pretrain.steps, pt.value_pretrain.lr) == (0.2, False, 50, 5e-4)
    assert pt.value_pretrain.patience >= pt.value_pretrain.steps and pt.learner.critic_lr == plain.learner.critic_lr
    assert list(suite)[-1] == "long_vapo_plain_pt50"  # the costliest run goes last
    for e in suite.values():  # every baseline override is a real key of long.yaml's tree
        cfg = load_config(ROOT / e.config, [*e.launch_overrides, f"learner.total_steps={e.steps}"])
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
