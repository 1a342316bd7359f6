"""common.modeling: the char tokenizer survives save_pretrained + AutoTokenizer (transformers 5 loads qwen2
checkpoints through Qwen2Tokenizer, which rebuilds the pipeline from the vocab)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from common.modeling import CHARSET, build_char_tokenizer, decode_chars


def test_char_tokenizer_round_trips_through_every_load_path(tiny_model_dir: Path) -> None:
    built = build_char_tokenizer()
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    text = "".join(CHARSET) + "Q:12+7\n  A:19\n\n"
    ref = built.encode(text, add_special_tokens=False)
    assert len(ref) == len(text)
    for tok in (auto, plain):
        assert len(tok) == len(built) == model.config.vocab_size
        assert tok.encode(text, add_special_tokens=False) == ref
        assert tok.decode(ref) == text
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
        assert decode_chars(tok, [1, *ref, 2]) == text
