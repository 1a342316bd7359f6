"""One setting decides what a positive is: the actor's positives count and rate follow buffer.positive_reward,
as the buffer's positives store, the learner's NLL mask and its replay count do."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from actors.worker import RolloutWorker
from common.config import load_config


def _group(rewards: list[float]) -> SimpleNamespace:
    return SimpleNamespace(samples=[SimpleNamespace(reward=r, response_length=5) for r in rewards])


def test_actor_counts_positives_at_buffer_positive_reward(tiny_model_dir: Path) -> None:
    ack = SimpleNamespace(duplicate=False, error="")
    for threshold, expected in ((0.5, 3), (1.0, 1)):
        cfg = load_config(None, [f"model.path={tiny_model_dir}", f"buffer.positive_reward={threshold}",
                                 "metrics.prometheus=false"])
        w = RolloutWorker(cfg, 0)
        w.groups.record(_group([0.0, 0.5, 0.75, 1.0]), ack, 0)  # type: ignore[arg-type]
        assert w.counts.positives == expected
        assert w.metric("positives_rate")._value.get() == expected / 4
