"""HF-format tokenizer and model helpers shared by the SFT bootstrap, engines and learner.

The embedded default uses a character-level tokenizer (``tokenizers`` WordLevel over single characters,
wrapped in ``PreTrainedTokenizerFast``) and a tiny Qwen2 (``transformers``), both saved with
``save_pretrained`` so that SGLang, ``actors.rollout_server`` and the learner load them like any HF
checkpoint (``AutoTokenizer`` / ``AutoModelForCausalLM``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import cast

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

try:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX
except ImportError:  # older transformers: the same expression Qwen2's tokenizer.json carries
    QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# Every character the embedded tasks print: digits, operators, separators, a few letters for words.
CHARSET = list("0123456789+-*=:;,.()[]{}<>?!/ \n") + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") + ["#", "|", "_"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; one of {', '.join(_DTYPES)}") from None


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode table (what the ByteLevel pre-tokenizer emits per byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_char_tokenizer(charset: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0..2 are <pad>, <s>, </s>; then one id per (ASCII) character.

    It is built as a byte-level BPE with no merges and Qwen2's normaliser, pre-tokeniser and decoder.
    transformers 5 loads every ``model_type: qwen2`` checkpoint's tokenizer through ``Qwen2Tokenizer``,
    which keeps the vocab and merges of tokenizer.json but replaces the rest of the pipeline with
    Qwen2's; a tokenizer with any other pipeline (e.g. WordLevel) silently drops characters such as
    newline after ``AutoTokenizer.from_pretrained``. With this construction both load paths (and SGLang's)
    give the same ids, one per character.
    """
    chars = charset or CHARSET
    table = _byte_level_alphabet()
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for ch in chars:
        encoded = ch.encode()
        if len(encoded) != 1:
            raise ValueError(f"char tokenizer: only single-byte characters are supported, got {ch!r}")
        sym = table[encoded[0]]
        if sym not in vocab:
            vocab[sym] = len(vocab)
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=[], dropout=None, unk_token=None, continuing_subword_prefix="",
                   end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        # unk_token is only recorded so that Qwen2Tokenizer does not append its own <|endoftext|> token;
        # unknown characters are dropped by both load paths (byte-level BPE without byte fallback).
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD,
        clean_up_tokenization_spaces=False,
    )


def decode_chars(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    """Decode ids to text with special tokens dropped (kept for callers; same as ``tokenizer.decode``)."""
    text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if not isinstance(text, str):  # decode gives a list only for a batch of id lists
        raise TypeError(f"decode of one id list gave {type(text).__name__}")
    return text


def build_tiny_qwen2(
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 256,
    seed: int = 0,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        attention_dropout=0.0,
        use_sliding_window=False,
    )
    return Qwen2ForCausalLM(config)


def save_hf(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: str | Path, extra: dict | None = None) -> Path:
    """save_pretrained (safetensors) of model and tokenizer into ``path`` atomically (tmp dir + rename)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"save_hf saves HF models (save_pretrained); got {type(model).__name__}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if extra:
        (tmp / "vapo_info.json").write_text(json.dumps(extra, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    # A cast, not a check: for a model without tokenizer.json AutoTokenizer may give the sentencepiece backend,
    # and that works too, since callers use only what both backends share (encode, decode, the chat template).
    return cast(PreTrainedTokenizerFast, AutoTokenizer.from_pretrained(str(path)))


def pad_token_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """The id that pads batches: the tokenizer's pad token, else its EOS token, else 0."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0)


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype))
    # transformers wraps PreTrainedModel.to in a decorator typed as a plain function of the model, so mypy
    # reads the device as the model argument.
    return model.to(device)  # type: ignore[arg-type]
