"""learner.weight_push without a process group (one CPU process): the push's bucket plan names the base
checkpoint's tensors in state-dict order, a differing plan is named before anything is sent, the buckets are the
weights' bytes (in reused host buffers), and a non-finite weight stops the version. The broadcast to real
engines is tested in tests/actors/test_weight_push.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.weight_bucket import BucketMeta
from learner.weight_push import HostPool, bucket_plan, iter_buckets, plan_mismatch


def _model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def test_the_plan_names_every_stored_tensor_in_order_within_the_bucket_bound(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    names = [n for n in model.state_dict() if n != "lm_head.weight"]  # tied to the embeddings: not sent twice
    emb_bytes = model.state_dict()["model.embed_tokens.weight"].numel() * 4
    plan = bucket_plan(model, emb_bytes)  # the embedding fills a bucket on its own
    assert [n for meta in plan for n in meta.names] == names
    assert plan[0].names == ["model.embed_tokens.weight"] and plan[0].nbytes == emb_bytes
    assert all(meta.nbytes <= emb_bytes for meta in plan)
    assert sum(meta.nbytes for meta in plan) == sum(model.state_dict()[n].numel() * 4 for n in names)
    assert plan_mismatch(plan, tiny_model_dir) is None


def test_a_plan_that_differs_from_the_base_checkpoint_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    plan = bucket_plan(_model(tiny_model_dir), 1 << 20)
    renamed = [BucketMeta(names=[n.replace("mlp", "ffn") for n in m.names], dtypes=m.dtypes, shapes=m.shapes,
                       nbytes=m.nbytes) for m in plan]
    why = plan_mismatch(renamed, tiny_model_dir)
    assert why is not None and "only in the learner, first ['model.layers.0.ffn.down_proj.weight'" in why
    wider = [BucketMeta(names=m.names, dtypes=m.dtypes, shapes=[[s[0] + 1, *s[1:]] for s in m.shapes], nbytes=m.nbytes)
             for m in plan]
    why = plan_mismatch(wider, tiny_model_dir)
    assert why is not None and why.startswith("shape of ")
    empty = tmp_path / "empty"
    shutil.copytree(tiny_model_dir, empty, ignore=shutil.ignore_patterns("*.safetensors"))
    assert "no safetensors tensors" in (plan_mismatch(plan, empty) or "")


@torch.no_grad()
def test_buckets_are_the_weights_bytes_in_reused_buffers_and_a_nan_stops_them(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    plan = bucket_plan(model, 4096)
    state = model.state_dict()
    pool = HostPool()
    bufs = list(iter_buckets(model, plan, pool))
    for meta, buf in zip(plan, bufs, strict=True):
        assert buf is not None
        want = torch.cat([state[n].reshape(-1).view(torch.uint8) for n in meta.names])
        assert torch.equal(buf, want)
    pool.give([(meta, buf) for meta, buf in zip(plan, bufs, strict=True) if buf is not None])
    again = list(iter_buckets(model, plan, pool))
    assert all(a is not None and b is not None and a.data_ptr() == b.data_ptr() for a, b in zip(bufs, again, strict=True))
    model.model.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="weight model.norm.weight has NaN or Inf"):
        list(iter_buckets(model, plan))
