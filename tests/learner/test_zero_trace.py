"""learner/zero_trace.py: a 2-rank ZeRO-3 learner keeps DeepSpeed's prefetch trace complete through every pass kind
(no-grad values and pi_old, training updates with checkpoint recompute), and ZeRO-3 is sized to the model.

Before: one trace per engine for both kinds; a training pass after a no-grad pass invalidated it (every phase
boundary of the first step), and a no-grad pass under a training trace prefetched parameters for a backward that never
came (here the embedding, once per no-grad micro-batch)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from common.config import load_config
from learner.models import ds_config
from learner.zero_trace import layer_parameters, zero3_settings

QWEN25_32B = dict(vocab_size=152064, hidden_size=5120, num_hidden_layers=64, intermediate_size=27648,
                  num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False)


def test_zero3_is_sized_to_a_layer_of_the_model() -> None:
    # One Qwen2.5-32B layer: q and o 5120², k and v 5120 x 1024, their biases, the MLP 3 x 5120 x 27648, 2 norms.
    layer = 2 * 5120 * 5120 + 5120 + 2 * (5120 * 1024 + 1024) + 3 * 5120 * 27648 + 2 * 5120
    assert layer_parameters(QWEN25_32B) == layer == 487_605_248
    assert zero3_settings(3, QWEN25_32B) == {
        "stage3_prefetch_bucket_size": layer, "stage3_max_reuse_distance": layer,
        "stage3_max_live_parameters": 152064 * 5120 + 2 * layer,  # the LM head, then two layers
        "stage3_param_persistence_threshold": 5120, "log_trace_cache_warnings": True}
    assert zero3_settings(2, QWEN25_32B) == {}
    assert zero3_settings(3, None) == {"log_trace_cache_warnings": True}  # a shape it cannot read: DeepSpeed's sizes
    assert zero3_settings(3, {"hidden_size": 8}) == {"log_trace_cache_warnings": True}


def test_ds_config_reads_the_shape_from_model_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_32B))
    cfg = load_config(None, [f"model.path={tmp_path}", "learner.zero_stage=3", "metrics.prometheus=false"])
    zero = ds_config(cfg, 1.0)["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_prefetch_bucket_size"] == 487_605_248 and zero["log_trace_cache_warnings"]
    critic = {**QWEN25_32B, "hidden_size": 2560}  # a critic of its own shape passes it
    assert ds_config(cfg, 1.0, critic)["zero_optimization"]["stage3_param_persistence_threshold"] == 2560
    stage2 = load_config(None, [f"model.path={tmp_path}", "learner.zero_stage=2", "metrics.prometheus=false"])
    assert ds_config(stage2, 1.0)["zero_optimization"] == {"stage": 2}


def test_two_rank_zero3_steps_never_invalidate_the_trace() -> None:
    """Two learner steps on 2 CPU ranks (ops/bench/zero3_traffic.py's ranks, ~25-50 s on 2 shared cores): no
    invalidation at all, the first step's phase boundaries included; after it every sub-module fetch runs with a
    complete trace; no-grad passes gather at most the floor; nothing gathered outlives its pass."""
    from ops.bench.zero3_traffic import make_model, run_ranks

    vocab = 8192
    with tempfile.TemporaryDirectory() as d:
        make_model(Path(d) / "model", vocab, hidden=64, layers=2)
        ranks = run_ranks(Path(d) / "model", Path(d), quick=True, vocab=vocab, steps=2)
    for r in ranks:
        assert r["warmup_invalidations"] == 0 and r["invalidations"] == {}, r
        done, total = r["fetches"]
        assert total > 0 and done == total, r["fetches"]
        for phase in ("values", "proximal"):
            assert r["gathered"][phase] <= r["floor"][phase] * 1.001, (phase, r["gathered"], r["floor"])
        assert r["resident"] == 0.0
    assert ranks[0]["gathered"] == pytest.approx(ranks[1]["gathered"])
