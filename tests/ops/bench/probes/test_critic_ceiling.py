"""ops.bench.probes.critic_ceiling: the oracle's EV on hand-made chain groups, the variants it trains, and the
refusal of a task the oracle cannot read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common import protocol
from common.config import load_config
from common.modeling import load_tokenizer
from common.tasks import Prompt, encode_prompt
from learner.batch import collate
from ops.bench.probes.critic_ceiling import oracle_evs, variants

ROOT = Path(__file__).resolve().parents[4]
BASE = ROOT / "ops" / "bases" / "chain-tiny"
PROMPT = Prompt(prompt_id="p", text="Q:3+7x02\n", answer="7", split="train", index=0)
RIGHT, SLIP = "01:3+7=0\n00:0+7=7\nA:7", "01:3+7=1\n00:1+7=8\nA:8"


def _group(tok: object, texts: list[str]) -> protocol.SampleGroup:
    samples = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]  # type: ignore[attr-defined]
        samples.append(protocol.Sample(prompt_ids=np.asarray(encode_prompt(tok, PROMPT), np.int32),
                                       output_ids=np.asarray(ids, np.int32), output_logprobs=np.zeros(len(ids), np.float32),
                                       reward=float(text == RIGHT), finish_reason="stop", weight_version=0,
                                       response_length=len(ids)))
    return protocol.SampleGroup(group_id="g", prompt_id="p", task="chain", actor_id=0, samples=samples, created_at=0.0)


def test_the_oracle_explains_what_the_step_count_alone_cannot() -> None:
    """Pool: 3 right rows, 1 slipped on line 1: p = 1 − 1/(6 + 1) = 6/7. On a fresh group of one right and one
    slipped row the oracle is 0 on the slipped row after its slip, where the return is 0, while the
    step-count-only oracle gives both rows the same value: EV 0 (no better than a constant)."""
    tok = load_tokenizer(str(BASE))
    pool = [_group(tok, [RIGHT, RIGHT, RIGHT, SLIP])]
    fresh = collate([_group(tok, [RIGHT, SLIP])], 0)
    out = oracle_evs(tok, pool, fresh, 1.0)
    assert out["line_accuracy"] == pytest.approx(6 / 7, abs=1e-4)
    assert out["steps_only"] == pytest.approx(0.0, abs=1e-6)
    # By hand: 22 tokens a row (21 characters + EOS); the right row (return 1) is valued p² up to its first
    # result digit (8 states), p up to its second (9), then 1 (5); the slipped one (return 0) p² for 8 states,
    # then 0. EV = 1 − Σ(R − V)² / Σ(R − R̄)² (same n − 1 on both sides).
    p = 6 / 7
    v = np.array([p**2] * 8 + [p] * 9 + [1.0] * 5 + [p**2] * 8 + [0.0] * 14)
    r = np.array([1.0] * 22 + [0.0] * 22)
    d = r - v
    want = 1 - ((d - d.mean()) ** 2).sum() / ((r - r.mean()) ** 2).sum()
    assert out["oracle"] == pytest.approx(want, abs=1e-3) and out["oracle"] > 0.5


def test_variants_train_at_the_actors_lr_and_the_grown_one_is_optional() -> None:
    cfg = load_config(str(ROOT / "ops/configs/long.yaml"), [])
    v = variants(cfg, None)
    assert set(v) == {"near_frozen", "actor_lr", "actor_lr_plain"}
    near_frozen = load_config(str(ROOT / "ops/configs/long.yaml"), v["near_frozen"])
    assert (near_frozen.learner.critic_lr, near_frozen.learner.value_head_surprise_source) == (1e-5, "critic_head")
    assert v["actor_lr"][-3:-1] == [f"learner.critic_lr={cfg.learner.actor_lr}", f"value_pretrain.lr={cfg.learner.actor_lr}"]
    assert "learner.value_head_surprise=false" in v["actor_lr_plain"]
    assert "learner.critic_grown_lr_scale=10" in variants(cfg, "runs/bases/x2")["grown"]


def test_a_task_without_an_oracle_is_refused() -> None:
    done = subprocess.run([sys.executable, "-m", "ops.bench.probes.critic_ceiling", "--config",
                           str(ROOT / "ops/configs/default.yaml")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "chain task" in done.stderr
