"""ops/bench/suites/default_suite.py: every experiment of the default suite is a valid config, and parallel slots
get distinct ports (``run_records.port_overrides``)."""

from __future__ import annotations

from types import ModuleType

import pytest

from common.config import load_config
from tests.ops.bench.bench_fixtures import ROOT, load_experiments


@pytest.fixture(scope="module")
def exp() -> ModuleType:
    return load_experiments()


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
        cfg = load_config(ROOT / e.config, [*e.launch_overrides, f"learner.total_steps={e.steps}"])
        assert cfg.learner.total_steps == e.steps
    assert load_config(ROOT / "ops/configs/default.yaml", list(exp.BY_NAME["no_group_sampling"].launch_overrides)).actors.group_size == 1
    # The suites' runs keep the critic their records were measured on, whatever default.yaml ships now.
    vapo = load_config(ROOT / "ops/configs/default.yaml", list(exp.BY_NAME["vapo"].launch_overrides))
    assert (vapo.learner.critic_lr, vapo.learner.value_head_lr_scale, vapo.learner.critic_updates,
            vapo.learner.critic_warmup_steps, vapo.learner.value_head_surprise_source) == (1e-5, 1000, 0, 0, "critic_head")
    assert (vapo.value_pretrain.lr, vapo.value_pretrain.steps, vapo.value_pretrain.pool_groups,
            vapo.value_pretrain.allow_untrained_critic) == (1e-5, 10, 0, True)
    assert exp.BY_NAME["dapo"].launch_overrides == ()  # dapo.yaml has no critic to pin
