"""Shared fixtures: a tiny HF-format model + char tokenizer built once per session (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 1-layer Qwen2 with the char tokenizer, saved with save_pretrained."""
    from common.modeling import build_char_tokenizer, build_tiny_qwen2, save_hf

    tok = build_char_tokenizer()
    model = build_tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=256, seed=0)
    return save_hf(model, tok, tmp_path_factory.mktemp("models") / "tiny")
