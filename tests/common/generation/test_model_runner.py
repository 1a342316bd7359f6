"""common.generation.model_runner: the slot-major KV cache's shape, prefill and decode logits against the HF
model's own forward (fp32), shared prefill of identical contexts, slot moves, fused weights, refusals."""

from __future__ import annotations

import pytest
import torch

from common.generation.model_runner import ModelRunner, hf_config
from common.modeling import build_tiny_qwen2

VOCAB = 50


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    # 64 hidden / 4 heads = head_dim 16; 2 KV heads: grouped-query attention with 2 query heads per KV head.
    return build_tiny_qwen2(VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=96, max_position_embeddings=64, seed=3).eval()


def hf_last_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_the_cache_is_slots_by_kv_heads_by_positions_by_head_dim(model: torch.nn.Module) -> None:
    runner = ModelRunner(model, max_slots=3, max_len=20, device=torch.device("cpu"), reseat=False)
    assert (runner.n_heads, runner.n_kv, runner.head_dim, runner.group) == (4, 2, 16, 2)
    assert len(runner.k) == len(runner.v) == 2  # one per layer
    assert runner.k[0].shape == runner.v[1].shape == (3, 2, 20, 16)
    assert runner.scale == pytest.approx(0.25)  # 16 ** -0.5
    assert runner.cos.shape == (20, 16)


def test_prefill_then_decode_give_the_hf_models_logits(model: torch.nn.Module) -> None:
    """Slots 0..2 hold A, B, A (A prefilled once, copied); each decode step appends one token per slot at
    its own position and must give what the HF forward gives on the whole context."""
    runner = ModelRunner(model, max_slots=4, max_len=32, device=torch.device("cpu"), reseat=False)
    a, b = [5, 6, 7, 8, 9], [10, 11, 12]
    contexts = [list(a), list(b), list(a)]
    with torch.no_grad():
        logits = runner.prefill(0, [list(c) for c in contexts])
    assert logits.shape == (3, VOCAB)
    assert torch.equal(logits[0], logits[2])  # the shared prefill: one computation, two rows
    for row, ctx in zip(logits, contexts, strict=True):
        torch.testing.assert_close(row, hf_last_logits(model, ctx), atol=1e-5, rtol=0)
    for step in range(3):
        tokens = [20 + step, 30 + step, 40 + step]  # slot 2 diverges from slot 0 here
        lens = [len(c) for c in contexts]
        with torch.no_grad():
            out = runner.decode(tokens, lens)
        for c, t in zip(contexts, tokens, strict=True):
            c.append(t)
        for row, ctx in zip(out, contexts, strict=True):
            torch.testing.assert_close(row, hf_last_logits(model, ctx), atol=1e-5, rtol=0)


def test_a_moved_slot_decodes_as_the_original(model: torch.nn.Module) -> None:
    runner = ModelRunner(model, max_slots=3, max_len=16, device=torch.device("cpu"), reseat=False)
    ctx = [3, 4, 5, 6]
    with torch.no_grad():
        runner.prefill(2, [ctx])
        runner.move(2, 0, len(ctx))
        out = runner.decode([7], [len(ctx)])
    torch.testing.assert_close(out[0], hf_last_logits(model, [*ctx, 7]), atol=1e-5, rtol=0)


def test_reseat_makes_the_projections_views_of_the_fused_weights() -> None:
    """reseat=True: q/k/v's weights live inside one fused tensor (an update copied into a parameter is what
    the fused matmul reads); reseat=False leaves every parameter where it was."""
    model = build_tiny_qwen2(VOCAB, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                             intermediate_size=96, max_position_embeddings=16, seed=1).eval()
    attn = model.model.layers[0].self_attn
    before = attn.q_proj.weight.data_ptr()
    ModelRunner(model, max_slots=1, max_len=8, device=torch.device("cpu"), reseat=False)
    assert attn.q_proj.weight.data_ptr() == before
    runner = ModelRunner(model, max_slots=1, max_len=8, device=torch.device("cpu"), reseat=True)
    fused, bias, sizes = runner.qkv[0]
    assert sizes == [64, 32, 32]  # 4 query heads x 16, 2 KV heads x 16 each for k and v
    assert fused.shape == (128, 64) and bias is not None and bias.shape == (128,)  # Qwen2: q/k/v have biases
    with torch.no_grad():
        attn.k_proj.weight.fill_(0.5)
    assert torch.all(fused[64:96] == 0.5) and not torch.any(fused[:64] == 0.5)


def test_other_modules_are_refused() -> None:
    with pytest.raises(RuntimeError, match="Llama-style decoders.*Linear"):
        ModelRunner(torch.nn.Linear(2, 2), max_slots=1, max_len=4, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="HF models.*Linear"):
        hf_config(torch.nn.Linear(2, 2))
