"""The ratio benchmarks' ``--quick`` modes (ops/bench/buffer.py, gae.py, actors.py, learner.py, rollout.py,
engines.py) run and print one well-formed JSON line with the fields every ratio benchmark shares (ops/bench/measure.py);
weight_sync.py's quick mode is checked in test_weight_sync_bench.py. Buffer's and gae's run in the default
suite (6-8 s each on 2 loaded cores): actors' starts an engine, a buffer and an actor per round, learner's
builds DeepSpeed engines (each ~1 min or more on 2 shared cores), engines' needs SGLang."""

from __future__ import annotations

import pytest

from ops.bench.buffer import ceiling_rate
from tests.ops.quick_fixtures import check_common, check_ratio, run_quick


def test_buffer_quick() -> None:
    line = run_quick(["-m", "ops.bench.buffer"], 180)
    check_common(line, "buffer", "ingest_over_raw_lmdb", ">= 0.6")
    assert line["curve"] is True and line["resent"] == 0
    # every round ingested, put and sank at least one call's groups, and the ratio is their rates'
    assert all(n >= line["groups_per_call"]
               for n in line["ingest_groups_rounds"] + line["raw_groups_rounds"] + line["sink_groups_rounds"])
    assert line["sink_groups_per_s"] > 0 and line["raw_cpu_ms_per_group"] > 0 and line["ceiling_over_raw_lmdb"] > 0
    rates = [(n / s) / (m / t) for n, s, m, t in zip(line["ingest_groups_rounds"], line["ingest_s_rounds"],
                                                      line["raw_groups_rounds"], line["raw_s_rounds"], strict=True)]
    assert line["ratio_rounds"] == pytest.approx(rates, rel=0.05)
    assert line["serve_groups"] > 0 and line["serve_latency_decoded_s"] >= line["serve_latency_bytes_s"] > 0
    # the buffer held one call at most (it refuses more), drained before each call: 2 senders x 8 groups
    assert line["capacity_groups"] == line["groups_per_call"] == 16 and 0 < line["disk_peak_mb"] < 64


def test_the_ceiling_is_the_transport_and_the_lmdb_writes_sharing_the_cores() -> None:
    # a sink at 1,000 groups/s on 2 cores costs 2 ms of CPU a group; 0.5 ms of writes more: 2 / 2.5 ms = 800/s
    assert ceiling_rate(1000.0, 0.0005, 2) == pytest.approx(800.0)
    assert ceiling_rate(1000.0, 0.0, 2) == pytest.approx(1000.0)  # no writes: the sink's own rate


def test_gae_quick() -> None:
    line = run_quick(["-m", "ops.bench.gae"], 120)
    assert line["bench"] == "gae" and line["quick"] is True and line["rounds"] == 2 and line["verdict"] == "unclear"
    assert line["machine"]["cpus"] >= 1 and len(line["load_at_start"]) == 3
    (shape,) = line["shapes"]
    check_ratio(shape["speedup_vs_loop"], "speedup_vs_loop", ">= 5")
    check_ratio(shape["ours_over_copy"], "ours_over_copy", "<= 3")
    assert shape["max_abs_err_vs_loop"] < 1e-4  # both sides computed the same advantages


@pytest.mark.slow  # DeepSpeed and plain learners built and stepped: ~2 min on 2 shared cores
def test_learner_quick() -> None:
    line = run_quick(["-m", "ops.bench.learner"], 600)
    check_common(line, "learner", "deepspeed_over_plain", ">= 0.8")
    assert line["steps"] == 2 and line["deepspeed_tokens_per_s"] > 0 and line["plain_torch_tokens_per_s"] > 0


@pytest.mark.slow  # a rollout_server and HF generate in turn: ~1 min on 2 shared cores
def test_rollout_quick() -> None:
    line = run_quick(["-m", "ops.bench.rollout"], 600)
    check_common(line, "rollout", "server_over_hf_generate", ">= 1.5")
    assert line["tokens"] == 2 * 2 * 2 * 8  # clients x prompts x samples x max_new_tokens, on both sides


@pytest.mark.slow  # an engine, then a buffer and an actor per round: ~60 s on 2 shared cores
def test_actors_quick() -> None:
    line = run_quick(["-m", "ops.bench.actors"], 600)
    check_common(line, "actors", "actor_over_raw_generate", ">= 0.9")
    assert len(line["raw_samples_per_s_rounds"]) == 2 and min(line["raw_samples_per_s_rounds"]) > 0
    assert line["max_new_tokens"] == 16 and line["actor_resubmits"] >= 0


@pytest.mark.slow  # starts SGLang (~1 min) and runs 2 rounds of three phases
@pytest.mark.sglang
def test_engines_quick() -> None:
    from ops.sglang_cpu.live import skip_reason

    if (reason := skip_reason()) is not None:
        pytest.skip(reason)
    line = run_quick(["-m", "ops.bench.engines"], 900)
    check_common(line, "engines", "actor_over_raw_sglang", ">= 0.9")
    assert [r["order"] for r in line["per_round"]] == ["rollout_server,sglang,actor", "actor,sglang,rollout_server"]
    assert line["sglang_tokens_per_s"] > 0 and line["rollout_server_tokens_per_s"] > 0
