"""common.tasks.base: prompts encoded with BOS and decoded responses cut at EOS (the char tokenizer), the final
answer line, stable hashes and held-out buckets, and the plain chat rendering."""

from __future__ import annotations

import random

from common.config import TaskConfig
from common.modeling import build_char_tokenizer
from common.tasks import Prompt, decode_response, encode_prompt, get_task
from common.tasks.addition import AdditionTask, teacher_response
from common.tasks.base import final_answer, in_eval_bucket, plain_chat, stable_hash


def _addition() -> AdditionTask:
    task = get_task(TaskConfig())
    assert isinstance(task, AdditionTask)
    return task


def test_encode_and_decode_round_trip_with_char_tokenizer() -> None:
    tok = build_char_tokenizer()
    task = _addition()
    p = task.eval_prompts()[0]
    ids = encode_prompt(tok, p)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]) == p.text
    resp = teacher_response(p)
    out = tok.encode(resp, add_special_tokens=False) + [tok.eos_token_id, 5, 6]
    assert decode_response(tok, out) == resp  # cut at EOS
    assert task.verify(p, decode_response(tok, out)).reward == 1.0
    # Every character of every prompt and trace has its own token (the char tokenizer drops unknown ones).
    for i in range(300):
        q = task.train_prompt(i)
        for text in (q.text, teacher_response(q, random.Random(i), 0.5)):
            assert len(tok.encode(text, add_special_tokens=False)) == len(text)


def test_the_final_answer_is_what_follows_a_colon_on_the_last_line() -> None:
    assert final_answer("12+3\n=15\nA:15") == "15"
    assert final_answer("A:7  \n\n") == "7"  # trailing whitespace is not part of the answer
    assert final_answer("A:") == ""
    assert final_answer("A:1\nthen more") is None  # the last line must be the answer line
    assert final_answer("xA:1") is None and final_answer("") is None


def test_stable_hash_is_blake2b_of_the_parts_joined_by_the_unit_separator() -> None:
    """The value is pinned: a held-out split must not move between processes or Python versions. It is
    blake2b-64 (little-endian) of ``"a" + "\\x1f" + "1"``."""
    assert stable_hash("a", 1) == 13924241962069754241
    assert stable_hash("a", 1) != stable_hash("a1")
    # Bucket 0 of 3 for seed 0, of ten one-letter keys: a fixed, seed-determined subset.
    assert [k for k in "abcdefghij" if in_eval_bucket(0, 3, k)] == ["a", "j"]


def test_plain_chat_is_the_lone_user_turn_or_one_block_per_turn() -> None:
    assert plain_chat((("user", "2+2?"),)) == "2+2?"
    assert plain_chat((("system", "be brief"), ("user", "2+2?"))) == "system: be brief\nuser: 2+2?"
    assert plain_chat((("assistant", "hi"),)) == "assistant: hi"


def test_a_chat_prompt_without_a_template_is_bos_and_its_plain_text() -> None:
    tok = build_char_tokenizer()
    p = Prompt("p", "system: s\nuser: 1+1", "2", "train", 0, messages=(("system", "s"), ("user", "1+1")))
    assert encode_prompt(tok, p) == [tok.bos_token_id, *tok.encode("system: s\nuser: 1+1", add_special_tokens=False)]
    assert decode_response(tok, []) == ""
