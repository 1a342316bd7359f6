"""learner.step_stats: per-token staleness of a batch, throughput and MFU by hand, and the step's statistics
exported as the learner's metrics (a step without rows of its own version keeps the last mismatch measurement),
and a CPU ceiling timed low raised by the step that beats it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.metrics import Metrics
from learner.step_stats import Phases, export_step, throughput, token_staleness
from learner.synthetic import synth_groups
from learner.train import Learner
from tests.learner.train_fixtures import VOCAB, make_cfg


def test_token_staleness_counts_real_tokens_from_the_weights_being_updated() -> None:
    versions = torch.tensor([[3, 3, 5, 0], [1, 4, 4, 4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # version 5: real tokens of versions 3, 3, 5 (a newer one counts 0), 1, 4; the padded ones not at all.
    st = token_staleness(5, versions, mask)
    assert st["token_staleness_mean"] == pytest.approx((2 + 2 + 0 + 4 + 1) / 5) and st["token_staleness_max"] == 4.0
    assert token_staleness(5, versions, torch.zeros_like(mask)) == {"token_staleness_mean": 0.0,
                                                                    "token_staleness_max": 0.0}


def stats(step: int, **extra: float) -> dict:
    return {"step": step, "time": 1000.0 + step, "actor_lr": 1e-6, "samples": 4, "reward_mean": 0.5,
            "phase_seconds": {"fetch": 0.25, "actor_update": 1.5}, **extra}


def test_export_sets_the_gauges_and_keeps_the_last_mismatch_measurement() -> None:
    m = Metrics("learner")
    get = m.registry.get_sample_value
    export_step(m, stats(1, mismatch_tokens=10, mismatch_kl=0.02, mismatch_ratio_max=1.5), torch.tensor([0, 1, 1]))
    export_step(m, stats(2, mismatch_tokens=0, mismatch_kl=9.0, mismatch_ratio_max=9.0), torch.tensor([2]))
    assert get("vapo_learner_step") == 2 and get("vapo_learner_reward_mean") == 0.5
    assert get("vapo_learner_mismatch_kl") == 0.02 and get("vapo_learner_mismatch_ratio_max") == 1.5
    assert get("vapo_learner_samples_total") == 8 and get("vapo_learner_data_wait_seconds_total") == 0.5
    assert get("vapo_learner_staleness_count") == 4 and get("vapo_learner_staleness_sum") == 4
    assert get("vapo_learner_phase_seconds", {"phase": "actor_update"}) == 1.5
    assert math.isnan(get("vapo_learner_grad_norm", {"model": "actor"}))  # no norm reported: NaN, not a stale one
    assert get("vapo_learner_lr", {"model": "critic"}) is None  # no critic (GRPO): its series never appear


def test_phases_add_up_the_time_of_a_name_entered_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 10.0, 12.0, 20.0, 24.0]).__next__  # values 1 s then 2 s, advantages 4 s
    monkeypatch.setattr("learner.step_stats.time.perf_counter", clock)
    t = Phases()
    for _ in range(2):
        with t("values"):
            pass
    with t("advantages"):
        pass
    assert t.seconds == {"values": 3.0, "advantages": 4.0}  # added, not overwritten by the second entry


def test_throughput_per_phase_per_rank_and_mfu_by_hand() -> None:
    """Two ranks. critic_update: 4 TFLOP of the batch in 2 s = 1 TFLOP/s per rank; actor_update: 9 TFLOP in
    3 s = 1.5; the step: 13 TFLOP in 5 busy s = 1.3. Against a peak of 2: MFU 0.5, 0.75, 0.65."""
    work = {"critic_update": (4e12, 100), "actor_update": (9e12, 300)}
    seconds = {"fetch": 1.0, "critic_update": 2.0, "advantages": 0.5, "actor_update": 3.0}
    out = throughput(work, seconds, busy_seconds=5.0, tokens_per_second=40.0, world=2, peak_tflops=2.0)
    assert out["tokens_per_second_per_rank"] == 20.0  # the step's 40 tokens/s over 2 ranks
    assert out["phase_tokens_per_second"] == {"critic_update": 50.0, "actor_update": 100.0}
    assert out["phase_tflops_per_rank"] == pytest.approx({"critic_update": 1.0, "actor_update": 1.5})
    assert out["tflops_per_rank"] == pytest.approx(1.3) and out["model_flops"] == 13e12
    assert out["phase_mfu"] == pytest.approx({"critic_update": 0.5, "actor_update": 0.75})
    assert out["mfu"] == pytest.approx(0.65) and out["peak_tflops"] == 2.0
    unknown = throughput(work, seconds, 5.0, 40.0, 2, None)  # an unknown GPU: throughput, no MFU
    assert "mfu" not in unknown and "phase_mfu" not in unknown and unknown["tflops_per_rank"] == pytest.approx(1.3)


def test_export_sets_the_throughput_gauges_per_phase_and_for_the_step() -> None:
    m = Metrics("learner")
    get = m.registry.get_sample_value
    work = {"critic_update": (4e12, 100), "actor_update": (9e12, 300)}
    seconds = {"fetch": 1.0, "critic_update": 2.0, "actor_update": 3.0}
    s = stats(1, **throughput(work, seconds, 5.0, 40.0, 2, 2.0))
    export_step(m, s, torch.tensor([0]))
    assert get("vapo_learner_mfu", {"phase": "step"}) == pytest.approx(0.65)
    assert get("vapo_learner_mfu", {"phase": "actor_update"}) == pytest.approx(0.75)
    assert get("vapo_learner_tflops_per_rank", {"phase": "step"}) == pytest.approx(1.3)
    assert get("vapo_learner_tflops_per_rank", {"phase": "critic_update"}) == pytest.approx(1.0)
    assert get("vapo_learner_phase_tokens_per_second", {"phase": "actor_update"}) == 100.0
    assert get("vapo_learner_tokens_per_second_per_rank") == 20.0
    assert get("vapo_learner_mfu", {"phase": "fetch"}) is None  # no model ran there


def test_mfu_stays_within_one_when_the_cpu_ceiling_was_timed_low(tiny_model_dir: Path) -> None:
    """A learner whose CPU ceiling was timed while something else held the cores: its first step beats it,
    the ceiling is timed again, and the MFU it reports (the step's, each phase's) stays <= 1."""
    learner = Learner(make_cfg(tiny_model_dir), None)
    assert learner.throughput.peak_source == "measured"
    learner.throughput.peak = 1e-12
    learner.step(synth_groups(4, 4, VOCAB, seed=31, resp_len=(1, 40), max_new_tokens=40))
    s = learner.last
    assert 0 < s["mfu"] <= 1 and s["phase_mfu"] and max(s["phase_mfu"].values()) <= 1
    assert learner.throughput.peak == s["peak_tflops_measured"] == s["peak_tflops"] > 1e-12
