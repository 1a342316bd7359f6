"""common.metrics: declared once, documented, served over HTTP with the vapo_ prefix."""

from __future__ import annotations

import urllib.request

import pytest

from common.metrics import COMPONENTS, SPECS, Metrics, specs


def test_every_metric_is_declared_once_with_help_and_prefix() -> None:
    names = [s.full_name for s in SPECS]
    assert len(names) == len(set(names))
    for s in SPECS:
        assert s.full_name.startswith(f"vapo_{s.component}_")
        assert s.component in COMPONENTS
        assert len(s.help) > 10, s.full_name
        assert not s.name.endswith("_total"), "counters get _total from prometheus_client"


def test_component_registries_are_separate_and_served() -> None:
    m = Metrics("buffer")
    m.depth_groups.set(7)
    m.rejected_frames.labels(reason="oversized").inc(3)
    port = m.serve(0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "vapo_buffer_depth_groups 7.0" in body
    assert 'vapo_buffer_rejected_frames_total{reason="oversized"} 3.0' in body
    assert "vapo_learner_" not in body  # only this component's metrics
    assert {s.exposed_name for s in specs("buffer")} <= {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line.startswith("vapo_")} | {
        s.exposed_name for s in specs("buffer") if s.labels or s.kind == "histogram"
    }


def test_undeclared_metric_is_a_clear_error() -> None:
    with pytest.raises(AttributeError, match="vapo_learner_nope"):
        Metrics("learner").nope  # noqa: B018
    with pytest.raises(ValueError):
        Metrics("nobody")
