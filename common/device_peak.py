"""The learner device's peak TFLOP/s: MFU's denominator (``learner.peak_tflops``). Not a CLI.

``learner_peak`` picks, in order: ``learner.peak_tflops`` when set (> 0); on CUDA, the dense datasheet peak of a
known GPU at ``learner.precision``, matched on ``torch.cuda.get_device_name()`` (``KNOWN_PEAKS``; an unknown
GPU has none, and MFU is then not reported); on the CPU, a matmul ceiling measured once per process
(``measure_matmul_tflops``: a timed matmul at the model's hidden size after a warm-up).

Deviations: CPU MFU is against that measured ceiling, not a datasheet: it says how much of what this CPU's
matmul reaches at this width the learner gets, and moves with the machine's load while it is measured; a
step that runs faster than the ceiling proves it timed low, and it is timed again (``raised_cpu_peak``).
Datasheet figures are without sparsity; bf16 and fp16 share one; ``fp32`` is the plain FP32 (not TF32) figure,
since vapo leaves TF32 matmuls off.
"""

from __future__ import annotations

import re
import time
from functools import lru_cache

import torch

# (pattern on the device name, case-insensitive, first match wins; dense TFLOP/s at bf16/fp16; at fp32 or None)
KNOWN_PEAKS: tuple[tuple[str, float, float | None], ...] = (
    (r"H100.*PCIe", 756.0, 51.0),
    (r"H100.*NVL", 835.0, 60.0),
    (r"H100", 989.0, 67.0),  # SXM: "NVIDIA H100 80GB HBM3"
    (r"H200.*NVL", 835.0, 60.0),
    (r"H200", 989.0, 67.0),  # also GH200
    (r"H800.*PCIe", 756.0, 51.0),
    (r"H800", 989.0, 67.0),
    (r"\bH20\b", 148.0, 44.0),
    (r"A100", 312.0, 19.5),
    (r"A800", 312.0, 19.5),
    (r"\bA30\b", 165.0, 10.3),
    (r"\bA10\b", 125.0, 31.2),  # not A10G, whose peak differs
    (r"L40S", 362.0, 91.6),
    (r"\bL40\b", 181.0, 90.5),
    (r"\bL4\b", 121.0, 30.3),
    (r"B200", 2250.0, None),
    (r"MI300X", 1307.0, 163.4),
    (r"RTX 4090", 165.0, 82.6),
)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MEASURE_SECONDS = 0.3  # timed matmuls after the warm-up: long enough to average out a scheduler tick


def table_peak(device_name: str, precision: str) -> float | None:
    """Dense peak TFLOP/s of the first ``KNOWN_PEAKS`` entry matching ``device_name`` at ``precision``."""
    for pattern, half, fp32 in KNOWN_PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return fp32 if precision == "fp32" else half
    return None


@lru_cache(maxsize=8)
def measure_matmul_tflops(hidden: int, precision: str = "fp32", seconds: float = MEASURE_SECONDS) -> float:
    """TFLOP/s of ``[m, hidden] @ [hidden, hidden]`` on the CPU at ``precision`` (m = 4096 for small widths,
    fewer for large ones so that one product stays near 8 GFLOP), timed over ``seconds`` after three
    warm-up products, with torch's current threads. Measured once per process and width."""
    width = max(1, min(hidden, 4096))
    m = max(64, min(4096, (1 << 32) // (width * width)))
    dtype = _DTYPES.get(precision, torch.float32)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, width, generator=gen).to(dtype)
    b = torch.randn(width, width, generator=gen).to(dtype)
    for _ in range(3):
        torch.mm(a, b)
    n, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return 2.0 * m * width * width * n / elapsed / 1e12


def raised_cpu_peak(peak: float, reached: float, hidden: int, precision: str) -> float:
    """The CPU ceiling after a step or phase ran at ``reached`` TFLOP/s: ``peak`` while ``reached`` is within
    it; else timed again (the first timing ran while something else held the cores: an engine starting,
    another run), and never below ``reached``, so that MFU stays <= 1 and the ceiling only rises."""
    if reached <= peak:
        return peak
    return max(measure_matmul_tflops.__wrapped__(hidden, precision), reached)


def learner_peak(configured: float, device: str, precision: str, hidden: int) -> tuple[float | None, str]:
    """(peak TFLOP/s of one learner device, where it came from: ``config`` | ``table`` | ``measured`` |
    ``unknown``); None when unknown (a GPU not in ``KNOWN_PEAKS``, or no figure at that precision)."""
    if configured > 0:
        return configured, "config"
    if device == "cuda" and torch.cuda.is_available():
        peak = table_peak(torch.cuda.get_device_name(torch.cuda.current_device()), precision)
        return peak, "table" if peak is not None else "unknown"
    if device == "cpu":
        return measure_matmul_tflops(hidden, precision), "measured"
    return None, "unknown"
