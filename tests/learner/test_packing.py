"""learner.packing: the packed stream of a micro-batch, its per-row running minimum, and the attention that keeps
rows apart (against each row run alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.modeling import build_tiny_qwen2
from common.protocol import Sample
from learner.batch import collate_samples
from learner.packing import ATTENTION, attention_buckets, pack, segment_cummin, unpack, use_packed_attention


def _sample(prompt: list[int], output: list[int]) -> Sample:
    return Sample(prompt_ids=np.array(prompt, dtype=np.int32), output_ids=np.array(output, dtype=np.int32),
                  output_logprobs=np.zeros(len(output), dtype=np.float32), reward=0.0, finish_reason="stop",
                  weight_version=0, response_length=len(output))


def test_pack_lays_rows_end_to_end_with_positions_restarting() -> None:
    b = collate_samples([_sample([5, 6], [7, 8, 9]), _sample([3], [4])], pad_id=0)
    p = pack(b, torch.tensor([0, 1]))
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 3, 4]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert p.cu_seqlens.tolist() == [0, 5, 7] and p.max_len == 5 and p.tokens == 7
    # Response token t of row 0 is scored at stream index 1 + t; row 1's only token at 5 + 0, its padded slots
    # at its last prompt token (stream 5), as learner.batch points padded slots inside the prompt.
    assert p.positions.tolist() == [[1, 2, 3], [5, 5, 5]]
    assert p.response_start.tolist() == [[False, False, True, True, True, False, True]]
    # Rows in another order: the stream follows the order asked for.
    q = pack(b, torch.tensor([1, 0]))
    assert q.input_ids.tolist() == [[3, 4, 5, 6, 7, 8, 9]] and q.positions.tolist() == [[0, 0, 0], [3, 4, 5]]
    x = torch.arange(7.0)[None]
    assert unpack(x, p).tolist() == [[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]]


def test_segment_cummin_restarts_at_each_row() -> None:
    x = torch.tensor([3.0, 1.0, 2.0, 5.0, 4.0, 6.0, -1.0])
    assert segment_cummin(x, torch.tensor([0, 3, 6, 7])).tolist() == [3.0, 1.0, 1.0, 5.0, 4.0, 4.0, -1.0]


@pytest.mark.parametrize("lengths", [(7, 2, 11), (300, 2, 700, 640)])
def test_packed_attention_keeps_rows_apart_and_unpacked_calls_are_sdpa(lengths: tuple[int, ...]) -> None:
    """Rows of different lengths through a model with grouped-query attention (4 query heads, 2 kv heads): the
    packed stream's logits and parameter gradients equal each row's own forward's, whether the rows share one
    padded attention call (all short) or three (700 with 640, 300 alone, 2 alone); an unpacked padded call equals
    plain SDPA's."""
    torch.manual_seed(0)
    model = build_tiny_qwen2(40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2).eval()
    rows = [torch.randint(3, 40, (1, n)) for n in lengths]
    alone = [model(input_ids=r).logits for r in rows]  # kept with their graphs: the gradients are compared below
    n, longest = len(rows), max(lengths)
    padded = torch.zeros(n, longest, dtype=torch.long)
    mask = torch.zeros(n, longest, dtype=torch.long)
    for i, r in enumerate(rows):
        padded[i, : r.shape[1]] = r
        mask[i, : r.shape[1]] = 1
    sdpa = model(input_ids=padded, attention_mask=mask).logits
    use_packed_attention(model)
    assert model.config._attn_implementation == ATTENTION
    b = collate_samples([_sample(r[0, :1].tolist(), r[0, 1:].tolist()) for r in rows], pad_id=0)
    p = pack(b, torch.arange(n))
    out = model(input_ids=p.input_ids, **p.model_kwargs()).logits[0]
    starts = p.cu_seqlens.tolist()
    for i, ref in enumerate(alone):
        assert torch.allclose(out[starts[i]: starts[i + 1]], ref[0], atol=1e-5), i
    weights = torch.randn(out.shape)  # a loss that reads every position differently
    (out * weights).sum().backward()
    packed_grads = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    sum((ref[0] * weights[starts[i]: starts[i + 1]]).sum() for i, ref in enumerate(alone)).backward()
    for got, want in zip(packed_grads, [q.grad for q in model.parameters()], strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        again = model(input_ids=padded, attention_mask=mask).logits
    assert torch.allclose((again - sdpa) * mask[..., None], torch.zeros_like(sdpa), atol=1e-6)
    # Without the row boundaries the stream would attend across rows: the check above can fail.
    leaky = model(input_ids=p.input_ids, position_ids=p.position_ids).logits[0]
    assert not torch.allclose(leaky[starts[1]: starts[2]], alone[1][0], atol=1e-3)


def test_attention_buckets_group_similar_lengths_and_all_short_rows() -> None:
    # 1000 takes 900 and 800 (>= 0.8 x 1000), not 700; 700 starts a call that takes 600 (>= 560); every row up to
    # 256 tokens shares the call of the longest of them (10 with 256).
    lengths = [600, 10, 1000, 256, 700, 900, 800]
    assert attention_buckets(lengths) == [[2, 5, 6], [4, 0], [3, 1]]
    assert attention_buckets([]) == []
