"""ops/bench/gpu_learner.py: ``--cpu-dry`` runs the GPU check's code path (a random Qwen2 saved and loaded, one
ZeRO-3 bf16 learner with activation checkpointing, packed and padded steps in ABBA rounds) and prints one JSON line
whose counts agree; without a GPU the real check refuses in one line; its shapes and rows are the ones it claims."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from common.gpu_memory import count_parameters
from ops.bench.gpu_learner import DRY_ROWS, FIT, GPU_ROWS, SIZES, make_rows, model_states_gib

ROOT = Path(__file__).resolve().parents[3]


def _run(*args: str, timeout: float = 300) -> tuple[int, dict[str, Any]]:
    p = subprocess.run([sys.executable, "-m", "ops.bench.gpu_learner", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, (p.stdout[-2000:], p.stderr[-4000:])  # one JSON line, nothing else on stdout
    return p.returncode, json.loads(lines[0])


@pytest.mark.slow  # two CPU dry runs of a ZeRO-3 learner (~12 s)
def test_cpu_dry_runs_both_layouts_on_one_zero3_learner() -> None:
    rc, out = _run("--cpu-dry")
    assert rc == 0 and out["ok"], out
    assert (out["cpu_dry"], out["device"], out["zero_stage"], out["peak_source"]) == (True, "cpu", 3, "measured")
    assert out["versions"]["deepspeed"] == "0.19.8" and out["versions"]["transformers"]
    assert out["model"]["hidden_size"] == 64 and out["model"]["num_hidden_layers"] == 2
    assert out["ratio_name"] == "packed_over_padded" and out["rounds"] == 2 and len(out["ratio_rounds"]) == 2
    assert out["verdict"] == "unclear"  # 2 rounds judge nothing
    rows = out["rows"]
    assert DRY_ROWS["lo"] <= rows["tokens_min"] <= rows["tokens_max"] <= DRY_ROWS["hi"]
    packed, padded = out["packed"], out["padded"]
    for side in (packed, padded):
        assert side["steps"] == 2 and len(side["step_s_all"]) == 2 and side["mfu"] > 0 and side["model_tflops"] > 0
        # The module order is the same in both layouts and both pass kinds: no trace is ever invalidated.
        assert side["trace_invalidations"] == 0 and side["warmup_trace_invalidations"] == 0
        assert side["peak_memory_gib"] is None  # a CUDA figure only
    assert packed["real_tokens_per_step"] == padded["real_tokens_per_step"]  # the same batches
    assert packed["padding_share"] == 0.0 and padded["padding_share"] > 0.0
    assert packed["model_calls_per_step"] <= padded["model_calls_per_step"]


def test_without_a_gpu_the_check_refuses_in_one_line() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the real check instead")
    rc, out = _run(timeout=120)
    assert rc == 2 and out["ok"] is False and "CUDA" in out["error"] and out["size"] == "1.5b"


def test_a_check_that_fails_still_prints_its_line_with_the_error() -> None:
    rc, out = _run("--cpu-dry", "learner.no_such_key=1", timeout=120)
    assert rc == 1 and out["ok"] is False and "no_such_key" in out["error"] and out["traceback"]
    assert out["model"]["hidden_size"] == 64  # the model was made before the config failed


def test_the_shapes_are_qwen2_5s_and_7b_does_not_fit_one_gpu() -> None:
    # Qwen2.5-1.5B and -7B's published parameter counts (tied embeddings at 1.5B, untied at 7B).
    assert count_parameters(SIZES["1.5b"])["policy"] == 1_543_714_304
    assert count_parameters(SIZES["7b"])["policy"] == 7_615_616_512
    # 16 bytes a parameter (bf16 weights and gradients, fp32 master and moments) for the policy and the critic
    # (the backbone plus a value head of hidden + 1), whatever the stage on one rank.
    critic = 1_543_714_304 + 1536 + 1
    assert model_states_gib("1.5b", 3) == model_states_gib("1.5b", 0) == pytest.approx(16 * (1_543_714_304 + critic) / 2**30)
    assert model_states_gib("1.5b", 3) < FIT * 80 < model_states_gib("7b", 3)
    assert model_states_gib("7b", 3) > FIT * 141  # not an H200's either


def test_rows_hold_4k_to_24k_tokens_and_a_group_shares_its_prompt() -> None:
    n, g = GPU_ROWS["groups"] * GPU_ROWS["group_size"], GPU_ROWS["group_size"]
    rows = make_rows(n, g, GPU_ROWS, seed=0)
    total = rows.prompts + rows.responses
    assert len(total) == n and total.min() >= 4096 and total.max() <= 24576 and (rows.responses > 0).all()
    assert all(len(set(rows.prompts[i:i + g].tolist())) == 1 for i in range(0, n, g))
    assert 80_000 <= int(total.sum()) <= 150_000  # the step the 10-minute sizing assumes (docstring)
