"""ops/bench/actors.py: its ``--quick`` mode starts an engine, then a buffer and an actor per round, and prints
one JSON line with the fields every ratio benchmark shares (ops/bench/measure.py); slow (~60 s on 2 shared cores)."""

from __future__ import annotations

import pytest

from tests.ops.bench.quick_fixtures import check_common, run_quick


@pytest.mark.slow  # an engine, then a buffer and an actor per round: ~60 s on 2 shared cores
def test_actors_quick() -> None:
    line = run_quick(["-m", "ops.bench.actors"], 600)
    check_common(line, "actors", "actor_over_raw_generate", ">= 0.9")
    assert len(line["raw_samples_per_s_rounds"]) == 2 and min(line["raw_samples_per_s_rounds"]) > 0
    assert line["max_new_tokens"] == 16 and line["actor_resubmits"] >= 0
