"""The value study suite (``ops/bench/suites/value_study_suite.py``, run through ``ops/bench/suites/experiments.py``): its
cells' configs, the two phases and their budget, the summary and its section of the report."""

from __future__ import annotations

import json
import shutil
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
    cfgs = {e.name: load_config(ROOT / e.config, [*e.launch_overrides, f"learner.total_steps={e.steps}"]) for e in suite}
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
    # The budget is 5 h minus what the runs took (19 runs of 99 s here), not minus phase 1's estimate.
    assert vs.phase2_budget(tmp_path) == pytest.approx(vs.BUDGET_MIN - 19 * 99 / 60)
    # 75 min: g2 (34) fits, hard (47: its VAPO seed 1 is done) does not, the next that fits is taken: pt50_a0.2
    # (35, with G = 8's DAPO); g4 (28) does not. With 82 min hard fits after g2 and nothing else does.
    assert vs.pick_phase2(tmp_path, budget_min=75) == ["g2", "pt50_a0.2"]
    assert vs.pick_phase2(tmp_path, budget_min=82) == ["g2", "hard"]
    assert vs.pick_phase2(tmp_path) == vs.pick_phase2(tmp_path, budget_min=1000) == ["g2", "hard", "pt50_a0.2", "g4"]
    monkeypatch.setattr(vs, "BUDGET_MIN", 19 * 99 / 60 + 75)
    seeds = {e.name: e.seeds for e in vs.experiments(exp.Experiment, tmp_path)}
    three = {n for n, s in seeds.items() if s == (0, 1, 2)}
    assert three == {"vs_g2_vapo", "vs_g2_dapo", "vs_pt50_a0.2_vapo", "vs_g8_dapo"}
    assert all(s == (0,) for n, s in seeds.items() if n not in three)
    # g2's seeds 1-2 done: g2 costs nothing more and hard (47) fits the 75 - 6.6 min (their 4 runs) left.
    for run in ("vs_g2_vapo", "vs_g2_dapo"):
        for seed in (1, 2):
            make_run(tmp_path / f"{run}-s{seed}", {0: 0.3, 40: 0.6})
    assert vs.pick_phase2(tmp_path) == ["g2", "hard"]
    # a machine slower than the estimate has spent the budget: only what is done stays picked
    summary = tmp_path / "vs_g8_vapo-s0" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "wall_seconds": 300 * 60}))
    assert vs.phase2_budget(tmp_path) < 0 and vs.pick_phase2(tmp_path) == ["g2"]
    out = subprocess.run([sys.executable, "-m", "ops.bench.suites.experiments", "--suite", "value_study", "--list",
                          "--root", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    assert "phase 2 picked g2 " in out[0] and len(out) == 1 + 18 + 2 * 2  # g2's 2 runs with seeds 1 and 2
    assert f"{vs.spent_minutes(tmp_path):.0f} min of runs spent" in out[0]
    assert out[1].split()[:5] == ["vs_g2_vapo-s0", "done", "40", "steps", "~8"]


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
            long_run(d, {0: 0.3, 20: 0.5 if arm == "vapo" else 0.45, 40: top + 0.01 * s}, 0.5)
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
    from ops.bench.reports import value_study_report as vr

    vs = exp.value_study_suite
    _value_study_phase1(tmp_path, {"vs_g2_vapo": 0.70})
    for arm, top in (("vapo", 0.70), ("dapo", 0.55)):
        for s in (0, 1, 2):
            shutil.rmtree(tmp_path / f"vs_g2_{arm}-s{s}", ignore_errors=True)
            long_run(tmp_path / f"vs_g2_{arm}-s{s}", {0: 0.3, 20: 0.5, 40: top + 0.01 * s}, 0.5)
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
