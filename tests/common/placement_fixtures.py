"""Model shapes the placement, balance, dry-run and launch tests plan for (shared test data, no tests)."""

from __future__ import annotations

from typing import Any

# Shapes from the released Qwen2.5 config.json files; parameter counts as published.
QWEN_05B: dict[str, Any] = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, intermediate_size=4864,
                                num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
QWEN_7B: dict[str, Any] = dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)
QWEN_32B: dict[str, Any] = dict(vocab_size=152064, hidden_size=5120, num_hidden_layers=64, intermediate_size=27648,
                                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False)
