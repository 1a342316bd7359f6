"""learner.grow: block expansion keeps the model's function exactly, adds trainable layers, and gives a
directory ``model.critic_path`` accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.modeling import build_char_tokenizer, build_tiny_qwen2, save_hf
from learner.grow import expansion_plan, grow, grow_model, n_parameters
from learner.models import check_critic_base

ROOT = Path(__file__).resolve().parents[2]


def test_expansion_plan_spreads_the_copies_after_the_source_layers() -> None:
    assert expansion_plan(3, 6) == [(0, False), (0, True), (1, False), (1, True), (2, False), (2, True)]
    assert expansion_plan(3, 5) == [(0, False), (1, False), (1, True), (2, False), (2, True)]
    assert expansion_plan(2, 2) == [(0, False), (1, False)]
    with pytest.raises(ValueError, match="at least the source's layers"):
        expansion_plan(3, 2)


@pytest.fixture(scope="module")
def two_layer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=128, seed=5)
    return save_hf(model, tok, tmp_path_factory.mktemp("grow") / "src")


def test_the_grown_model_computes_the_same_logits_and_its_new_blocks_train(two_layer_dir: Path) -> None:
    src = AutoModelForCausalLM.from_pretrained(str(two_layer_dir), dtype=torch.float32)
    grown = grow_model(src, 5)
    assert grown.config.num_hidden_layers == 5 and len(grown.model.layers) == 5
    per_layer = sum(p.numel() for p in src.model.layers[0].parameters())
    assert n_parameters(grown) == n_parameters(src) + 3 * per_layer
    x = torch.randint(3, 60, (2, 17))
    with torch.no_grad():
        assert torch.allclose(grown(input_ids=x).logits, src(input_ids=x).logits, atol=1e-5)
    # An inserted block: its output projections are zero, so they get the gradient and the rest of it none yet.
    inserted = grown.model.layers[1]
    assert float(inserted.self_attn.o_proj.weight.detach().abs().sum()) == 0.0
    grown(input_ids=x).logits.logsumexp(-1).sum().backward()
    assert float(inserted.self_attn.o_proj.weight.grad.abs().sum()) > 0
    assert float(inserted.mlp.down_proj.weight.grad.abs().sum()) > 0
    assert float(inserted.self_attn.q_proj.weight.grad.abs().sum()) == 0.0
    assert float(grown.model.layers[0].self_attn.q_proj.weight.grad.abs().sum()) > 0


def test_the_cli_writes_a_critic_base_and_refuses_to_overwrite(two_layer_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "grown"
    cmd = [sys.executable, "-m", "learner.grow", str(two_layer_dir), str(out), "--layers", "4"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    info = json.loads((out / "grow.json").read_text())
    assert info["layers"] == 4 and info["parameters"]["grown"] > info["parameters"]["source"]
    assert [p["identity"] for p in info["plan"]] == [False, True, False, True]
    check_critic_base(two_layer_dir, out)  # same tokenizer, vocabulary and context: a valid model.critic_path
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists" in again.stderr
    with pytest.raises(FileExistsError):
        grow(two_layer_dir, out, 4)


def test_a_grown_critics_inserted_layers_train_at_their_own_rate(two_layer_dir: Path, tmp_path: Path) -> None:
    """``learner.critic_grown_lr_scale``: the layers grow.json marks as inserted (1 and 3 of 4) get critic_lr ×
    scale in the critic's optimizer, the source layers, embeddings and value head critic_lr, the surprise MLP
    critic_lr × value_head_lr_scale."""
    from common.config import load_config
    from learner.grow import inserted_layers
    from learner.models import build_critic

    out = grow(two_layer_dir, tmp_path / "grown", 4)
    assert inserted_layers(out) == {1, 3} and inserted_layers(two_layer_dir) == set()
    cfg = load_config(None, [f"model.path={two_layer_dir}", f"model.critic_path={out}", "learner.critic_lr=1e-3",
                             "learner.critic_grown_lr_scale=10", "learner.value_head_surprise=true",
                             "learner.value_head_lr_scale=100", "metrics.prometheus=false"])
    critic = build_critic(cfg)
    by_lr = {round(g["lr"], 9): {id(p) for p in g["params"]} for g in critic.optimizer.param_groups}
    names = {id(p): n for n, p in critic.module.named_parameters()}
    layer_of = {n: n.split("layers.")[1].split(".")[0] for n in names.values() if "layers." in n}
    assert sorted(by_lr) == [0.001, 0.01, 0.1]
    assert {layer_of[names[i]] for i in by_lr[0.01] if names[i] in layer_of} == {"1", "3"}
    assert {layer_of[names[i]] for i in by_lr[0.001] if names[i] in layer_of} == {"0", "2"}
    assert all(names[i].startswith("surprise_head.") for i in by_lr[0.1])


def test_the_inserted_blocks_output_projections_move_with_their_own_lr(two_layer_dir: Path, tmp_path: Path) -> None:
    """Three critic updates from the zero output projections of an inserted block: Adam moves each weight by
    about its lr per step, so at critic_grown_lr_scale 10 the projections end about 10x further from zero
    than at 1 (the reason a grown critic's new blocks barely moved at a near-frozen backbone lr)."""
    from common.config import load_config
    from learner.batch import collate
    from learner.models import build_critic
    from learner.synthetic import synth_groups
    from learner.update import critic_update

    out = grow(two_layer_dir, tmp_path / "grown", 4)
    batch = collate(synth_groups(4, 2, 60, seed=3), 0)
    returns = batch.rewards.unsqueeze(-1) * batch.mask
    moved = {}
    for scale in (1, 10):
        cfg = load_config(None, [f"model.path={two_layer_dir}", f"model.critic_path={out}", "learner.critic_lr=1e-4",
                                 f"learner.critic_grown_lr_scale={scale}", "metrics.prometheus=false",
                                 "learner.grad_clip=0"])
        torch.manual_seed(0)
        critic = build_critic(cfg)
        for _ in range(3):
            critic_update(critic, batch, minibatches=[torch.arange(batch.size)], returns=returns,
                          old_values=torch.zeros_like(returns), epochs=1, limits=64)
        layer = dict(critic.module.named_parameters())
        moved[scale] = float(next(p for n, p in layer.items() if n.endswith("layers.1.mlp.down_proj.weight")).abs().mean())
    assert moved[1] > 0 and 5 < moved[10] / moved[1] < 20
