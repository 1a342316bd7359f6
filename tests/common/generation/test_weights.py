"""common.generation.weights.WeightUpdates: the one update waiting for a step boundary, superseded by a newer
one, installed with its version (and the gauge), or answered when the engine dies."""

from __future__ import annotations

import concurrent.futures as cf

import torch
from prometheus_client import CollectorRegistry, Gauge

from common.generation.weights import LiveWeights, WeightUpdates


class Gauges:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.weight_version = Gauge("weight_version", "served version", registry=self.registry)

    def served(self) -> float | None:
        return self.registry.get_sample_value("weight_version")


def test_a_newer_update_supersedes_the_waiting_one_and_applies_with_its_version() -> None:
    model = torch.nn.Linear(2, 2)
    metrics = Gauges()
    updates = WeightUpdates(LiveWeights(model), "3", metrics)
    assert metrics.served() == 3.0
    old, new = cf.Future(), cf.Future()
    updates.arm({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, "4", old)
    updates.arm({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, "5", new)
    assert old.result(timeout=0) == (False, "Superseded by a newer weight update.") and not new.done()
    updates.apply()
    assert new.result(timeout=0)[0] and updates.pending is None and updates.version == "5"
    assert torch.equal(model.weight.detach(), torch.ones(2, 2)) and metrics.served() == 5.0


def test_an_update_without_a_version_keeps_the_served_one_and_a_dying_engine_answers_the_waiting_one() -> None:
    model = torch.nn.Linear(2, 2)
    updates = WeightUpdates(LiveWeights(model), "default")  # a version that is no number: no gauge to set
    done = cf.Future()
    updates.arm({"weight": torch.full((2, 2), 2.0), "bias": torch.zeros(2)}, None, done)
    updates.apply()
    assert done.result(timeout=0)[0] and updates.version == "default"
    dying = cf.Future()
    updates.arm({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, "9", dying)
    updates.fail("engine died: boom")
    updates.fail("again")  # nothing waits any more: no second answer
    assert dying.result(timeout=0) == (False, "engine died: boom") and updates.pending is None
    assert torch.equal(model.weight.detach(), torch.full((2, 2), 2.0))  # the failed update never went in
