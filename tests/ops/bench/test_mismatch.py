"""ops/bench/mismatch.py: the learner's fp32 log-probs against the rollout server's, bf16 and fp32 engines."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bf16_engine_mismatches_an_fp32_learner_and_an_fp32_engine_does_not(tiny_model_dir: Path) -> None:
    from common.config import load_config
    from common.modeling import load_tokenizer
    from common.tasks import encode_prompt, get_task
    from learner.train import Learner
    from ops.bench import mismatch as bench
    cfg = load_config(ROOT / "ops/configs/smoke.yaml", [f"model.path={tiny_model_dir}", "metrics.prometheus=false"])
    tok = load_tokenizer(str(tiny_model_dir))
    prompts = [encode_prompt(tok, get_task(cfg.task).train_prompt(i)) for i in range(4)]
    learner = Learner(cfg, None)
    got = {}
    for dtype in ("float32", "bfloat16"):
        seqs = bench.sample(str(tiny_model_dir), dtype, prompts, 2, 16, {int(tok.eos_token_id)}, seed=0)
        got[dtype] = bench.measure(cfg, learner, seqs, 2)
    assert got["float32"]["tokens"] > 0 and got["bfloat16"]["tokens"] > 0
    # Same weights, same precision: only kernel order differs.
    assert got["float32"]["mismatch_kl"] < 1e-7 and abs(got["float32"]["mismatch_ratio_max"] - 1) < 1e-4
    # bf16 weights and activations: a real mismatch, orders of magnitude above the fp32 floor.
    assert got["bfloat16"]["mean_abs_logprob_diff"] > 100 * got["float32"]["mean_abs_logprob_diff"]
    assert got["bfloat16"]["mismatch_kl"] > 1e-7 and got["bfloat16"]["mismatch_ratio_max"] > 1.001
