"""learner.host_tensors without ZeRO (one process): a model's state dict to host, in order, with tied names
left out (or shared), copied only when asked; the inverse loads it; groups stay under their byte bound."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from learner.host_tensors import (
    _groups,
    is_partitioned,
    iter_host_tensors,
    load_host_tensors,
    tied_aliases,
    unwrap,
)


def _model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def test_the_tied_lm_head_is_an_alias_of_the_embeddings(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    entries = list(model.state_dict(keep_vars=True).items())
    assert model.config.tie_word_embeddings
    # Declared tied by the model: the head is dropped, the embedding it reloads from is kept (save_pretrained's rule).
    assert tied_aliases(model, entries) == {"lm_head.weight": "model.embed_tokens.weight"}
    # Two names of one tensor in a module that declares nothing: the first name in order is kept.
    lin = torch.nn.Linear(2, 2)
    assert tied_aliases(lin, [("b", lin.weight), ("a", lin.weight), ("c", lin.bias)]) == {"b": "a"}


def test_host_tensors_are_the_state_dict_in_order_and_load_back(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    assert unwrap(model) is model and not is_partitioned(model)
    names = [n for n in model.state_dict() if n != "lm_head.weight"]
    got = list(iter_host_tensors(model))
    assert [n for n, _ in got] == names
    live = dict(model.named_parameters())
    emb = dict(got)["model.embed_tokens.weight"]
    assert emb is not None and emb.data_ptr() == live["model.embed_tokens.weight"].data_ptr()  # CPU: no copy
    copied = dict(iter_host_tensors(model, copy=True, aliases=True))
    assert copied["lm_head.weight"] is copied["model.embed_tokens.weight"]  # the alias shares the kept tensor
    assert copied["model.embed_tokens.weight"].data_ptr() != live["model.embed_tokens.weight"].data_ptr()
    state = {n: torch.full_like(t, float(i)) for i, (n, t) in enumerate(copied.items()) if t is not None}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    load_host_tensors(model, state)
    assert all(torch.equal(model.state_dict()[n], state[n]) for n in names)


def test_groups_stay_under_the_bound_and_a_larger_tensor_is_alone() -> None:
    t4, t8, t40 = torch.zeros(1), torch.zeros(2), torch.zeros(10)  # 4, 8 and 40 bytes
    entries = [("a", t4), ("b", t8), ("c", t40), ("d", t4), ("e", t4), ("f", t8)]
    assert [[n for n, _ in g] for g in _groups(entries, 12)] == [["a", "b"], ["c"], ["d", "e"], ["f"]]
