"""ops/bench/gae.py: its ``--quick`` mode runs in the default suite (~6 s on 2 loaded cores) and prints one
JSON line with the fields every ratio benchmark shares (ops/bench/measure.py), both sides' advantages equal."""

from __future__ import annotations

from ops.bench.gae import parse_shape
from tests.ops.bench.quick_fixtures import check_ratio, run_quick


def test_gae_quick() -> None:
    line = run_quick(["-m", "ops.bench.gae"], 120)
    assert line["bench"] == "gae" and line["quick"] is True and line["rounds"] == 2 and line["verdict"] == "unclear"
    assert line["machine"]["cpus"] >= 1 and len(line["load_at_start"]) == 3
    (shape,) = line["shapes"]
    check_ratio(shape["speedup_vs_loop"], "speedup_vs_loop", ">= 5")
    check_ratio(shape["ours_over_copy"], "ours_over_copy", "<= 3")
    assert shape["max_abs_err_vs_loop"] < 1e-4  # both sides computed the same advantages


def test_shapes_are_batch_by_length() -> None:
    assert parse_shape("1024x4096") == (1024, 4096)
