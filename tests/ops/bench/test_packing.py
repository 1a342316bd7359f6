"""ops/bench/packing.py: ``--quick`` runs two real learners (packed, padded) and prints one well-formed JSON line
whose counts agree with each other: the same real tokens on both sides, none of them padding on the packed side,
three model passes over every row a step (critic update, fresh values, actor update)."""

from __future__ import annotations

import math

from ops.bench.packing import QUICK, SIDES
from tests.ops.bench.quick_fixtures import check_common, run_quick

PASSES = 3  # the default algorithm: critic update, fresh values (post-update critic), actor update; no value pass


def test_quick_line_is_well_formed_and_its_counts_agree() -> None:
    line = run_quick(["-m", "ops.bench.packing"], 300)
    check_common(line, "packing", "packed_over_padded", ">= 1.15")
    packed, padded = line["packed"], line["padded"]
    # The judged ratio is the rounds' packed rate over padded rate: its median lies between the sides' extremes.
    assert min(packed["real_tokens_per_s_range"]) / max(padded["real_tokens_per_s_range"]) <= line["ratio"]
    assert line["ratio"] <= max(packed["real_tokens_per_s_range"]) / min(padded["real_tokens_per_s_range"])
    # Both sides stepped on the same batches, once a round (no minimum round time in --quick).
    assert packed["steps"] == padded["steps"] == 2 and packed["real_tokens_per_step"] == padded["real_tokens_per_step"]
    # Every model call's real tokens are the rows' tokens, once per pass, whatever the layout.
    for side in (packed, padded):
        assert side["real_run_per_step"] == PASSES * side["real_tokens_per_step"]
    assert packed["tokens_run_per_step"] == packed["real_run_per_step"] and packed["padding_share"] == 0.0
    assert padded["tokens_run_per_step"] > padded["real_run_per_step"]  # rows of unequal lengths share micro-batches
    assert math.isclose(padded["padding_share"], 1 - padded["real_run_per_step"] / padded["tokens_run_per_step"],
                        abs_tol=1e-4)
    # Each of 2 mini-batches needs at least one micro-batch per pass; the padded layout's row cap adds calls.
    assert 2 * PASSES <= packed["model_calls_per_step"] <= padded["model_calls_per_step"]
    # CPU MFU: model FLOPs of real tokens over a matmul ceiling measured in each round.
    assert line["matmul_ceiling_tflops"] > 0 and all(0 < s["cpu_mfu"] for s in (packed, padded))
    assert math.isclose(line["cpu_mfu_packed_over_padded"], packed["cpu_mfu"] / padded["cpu_mfu"], rel_tol=1e-2)
    # The draw: capped log-normal responses, their parameters printed; which side steps first alternates by round.
    lengths = line["lengths"]
    assert (lengths["mean"], lengths["cap"]) == (QUICK["mean"], QUICK["cap"]) and lengths["response_max"] <= QUICK["cap"]
    assert 0 <= lengths["truncated_fraction"] <= 1 and lengths["response_sigma"] == 1.0
    assert line["order"] == [[*SIDES, "ceiling"], [*SIDES[::-1], "ceiling"]]
