"""ops/bench/suites/actor_values_suite.py: its arms resolve to valid configs and its JSON summary reads finished runs."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from common.config import load_config
from tests.ops.bench.bench_fixtures import ROOT, load_experiments, make_run


@pytest.fixture(scope="module")
def exp() -> ModuleType:
    return load_experiments()


def test_actor_values_suite_resolves_and_summarises(exp: ModuleType, tmp_path: Path) -> None:
    """The pre- vs post-update critic comparison: 2 tasks x 2 arms x 2 seeds at equal samples, every run a
    valid config that differs from its twin only in algo.actor_values; the JSON line summarises finished runs
    (final avg@8 at step 40, reported EV, mismatch KL on the steps that measured one). The default-task change
    arms each turn exactly one learner-maths default off."""
    suite = exp.actor_values_suite.experiments(exp.Experiment)
    assert len(suite) == 6 and all(e.seeds == (0, 1) and e.steps == 40 for e in suite)
    for e in suite[:4]:
        cfg = load_config(ROOT / e.config, [*e.launch_overrides, f"learner.total_steps={e.steps}"])
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
