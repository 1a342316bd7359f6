"""common.device_peak: known GPUs' peaks by device name, the CPU's measured matmul ceiling, and which one the
learner takes."""

from __future__ import annotations

import pytest
import torch

from common.device_peak import learner_peak, measure_matmul_tflops, raised_cpu_peak, table_peak


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0),  # the SXM part does not say SXM
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H100 NVL", "fp16", 835.0),
    ("NVIDIA H200", "bf16", 989.0),
    ("NVIDIA H800", "bf16", 989.0),
    ("NVIDIA H20", "bf16", 148.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),  # plain FP32: vapo leaves TF32 off
    ("NVIDIA A10", "bf16", 125.0),
    ("NVIDIA A10G", "bf16", None),  # not the A10's figure
    ("NVIDIA L40S", "bf16", 362.0),
    ("NVIDIA L40", "bf16", 181.0),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA B200", "fp32", None),  # no FP32 figure in the table
    ("Tesla T4", "bf16", None),
])
def test_known_gpus_peaks_by_name(name: str, precision: str, peak: float | None) -> None:
    assert table_peak(name, precision) == peak


def test_the_cpu_ceiling_is_measured_once_and_plausible() -> None:
    first = measure_matmul_tflops(48, "fp32", 0.05)
    assert 1e-5 < first < 10.0  # TFLOP/s: above 10 MFLOP/s, below any CPU's fp32 matmul
    assert measure_matmul_tflops(48, "fp32", 0.05) == first  # cached: measured once per process and width


def test_the_learner_takes_the_configured_peak_else_the_table_else_a_measurement() -> None:
    assert learner_peak(400.0, "cuda", "bf16", 4096) == (400.0, "config")
    peak, source = learner_peak(0.0, "cpu", "fp32", 32)
    assert source == "measured" and peak is not None and peak > 0
    if not torch.cuda.is_available():
        assert learner_peak(0.0, "cuda", "bf16", 32) == (None, "unknown")


def test_a_step_faster_than_the_cpu_ceiling_has_it_timed_again_and_never_below_the_step() -> None:
    """A ceiling timed while an engine started (the chaos run on live SGLang read MFU 490-990 %) is low;
    the step that beats it sets a floor, and a fresh timing may raise it further."""
    assert raised_cpu_peak(2.0, 1.5, 48, "fp32") == 2.0  # within the ceiling: kept, nothing timed
    assert raised_cpu_peak(1e-9, 50.0, 48, "fp32") == 50.0  # beyond any CPU's fp32 matmul: the step's own figure
    assert raised_cpu_peak(1e-9, 2e-9, 48, "fp32") > 1e-6  # timed again: a real ceiling, not the low one
