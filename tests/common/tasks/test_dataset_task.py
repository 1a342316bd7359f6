"""common.tasks.dataset_task (``dataset:<path>``): the same rows as parquet (verl's layout, chat prompts), as a
``datasets.save_to_disk`` directory and as jsonl load to the same Prompts; column keys; chat-template
rendering with a real tokenizer; bad rows counted and named; the shuffled order; a resumed cursor. Real
files in tmp_path, written by pyarrow, HF datasets and json."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.cursor import PromptCursor
from common.config import TaskConfig, load_config
from common.modeling import build_char_tokenizer
from common.tasks import Prompt, encode_prompt, fit_task, get_task, prompt_token_budget
from common.tasks.dataset_task import DatasetTask

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def verl_rows(n: int = 40) -> list[dict[str, Any]]:
    """Rows in verl's layout: chat prompts (every fifth with a system turn), reward_model, extra_info."""
    rows = []
    for i in range(n):
        turns = [{"role": "user", "content": f"Q:{i}+{2 * i}\n"}]
        if i % 5 == 0:
            turns.insert(0, {"role": "system", "content": "Be brief."})
        rows.append({"data_source": "toy_math", "prompt": turns, "ability": "math",
                     "reward_model": {"ground_truth": str(3 * i), "style": "rule"},
                     "extra_info": {"index": i, "split": "train"}})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path: Path, **kw: Any) -> DatasetTask:
    task = get_task(TaskConfig(name=f"dataset:{path}", **kw))
    assert isinstance(task, DatasetTask)
    return task


def anonymous(p: Prompt) -> Prompt:
    return dataclasses.replace(p, prompt_id="")  # the id names the file


def test_parquet_save_to_disk_and_jsonl_load_to_the_same_prompts(tmp_path: Path) -> None:
    rows = verl_rows()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "toy.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "toy_disk"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "toy_dict"))
    write_jsonl(tmp_path / "toy.jsonl", rows)
    tasks = [load(tmp_path / name, eval_size=4, eval_buckets=5)
             for name in ("toy.parquet", "toy_disk", "toy_dict", "toy.jsonl")]
    first = tasks[0]
    assert 0 < len(first.eval_prompts()) <= 4
    for other in tasks[1:]:
        assert [anonymous(p) for p in other.eval_prompts()] == [anonymous(p) for p in first.eval_prompts()]
        assert [anonymous(other.train_prompt(i)) for i in range(80)] == [anonymous(first.train_prompt(i)) for i in range(80)]
    p = next(first.train_prompt(i) for i in range(80) if first.train_row(i) == 5)
    assert p.messages == (("system", "Be brief."), ("user", "Q:5+10\n"))
    assert p.text == "system: Be brief.\nuser: Q:5+10\n"  # the plain form of a conversation
    assert (p.answer, p.data_source, p.split) == ("15", "toy_math", "train")
    assert json.loads(p.extra_info) == {"index": 5, "split": "train"}
    lone = next(first.train_prompt(i) for i in range(80) if first.train_row(i) == 3)
    assert lone.text == "Q:3+6\n" and lone.messages == (("user", "Q:3+6\n"),)  # a lone user turn is its content
    held = {p.text for p in first.eval_prompts()}
    assert not held & {first.train_prompt(i).text for i in range(200)}


def test_column_keys_name_nested_and_renamed_columns(tmp_path: Path) -> None:
    rows = [{"q": f"What is {i} plus {i}?", "meta": {"gold": 2 * i}, "src": f"s{i % 2}", "info": {"k": i}}
            for i in range(30)]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    with pytest.raises(ValueError, match="no prompt column"):
        load(path)
    task = load(path, prompt_key="q", answer_key="meta.gold", data_source_key="src", extra_info_key="info",
                instruction=" Put the answer in \\boxed{}.")
    p = task.train_prompt(0)
    i = task.train_row(0)
    assert p.text == f"What is {i} plus {i}? Put the answer in \\boxed{{}}." and p.messages == ()
    assert (p.answer, p.data_source, json.loads(p.extra_info)) == (str(2 * i), f"s{i % 2}", {"k": i})
    with pytest.raises(ValueError, match="task.answer_key='nope.gold' is not a column"):
        load(path, prompt_key="q", answer_key="nope.gold")
    # The jsonl task's layout is recognised; data_source is then the file's stem and extra_info empty.
    plain = write_jsonl(tmp_path / "plain_qa.jsonl", [{"problem": f"{i}*2=?", "solution": str(2 * i)} for i in range(20)])
    q = load(plain).train_prompt(0)
    assert (q.data_source, q.extra_info, q.text) == ("plain_qa", "", f"{load(plain).train_row(0)}*2=?")


def test_chat_prompts_render_with_the_tokenizers_template(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "toy.jsonl", verl_rows(10))
    task = load(path, instruction=" Answer briefly.")
    p = next(task.train_prompt(i) for i in range(40) if task.train_row(i) == 0)
    assert p.messages == (("system", "Be brief."), ("user", "Q:0+0\n Answer briefly."))  # onto the last user turn
    templated = build_char_tokenizer()
    templated.chat_template = CHAT_TEMPLATE
    want = "<system>Be brief.\n<user>Q:0+0\n Answer briefly.\n<assistant>"
    ids = encode_prompt(templated, p)
    assert ids == [templated.convert_tokens_to_ids(templated.tokenize(ch)[0]) for ch in want]
    assert templated.decode(ids) == want
    # A string prompt is one user turn of the template; without a template, BOS + the plain text.
    s = Prompt("x", "Q:1+2\n", "3")
    assert templated.decode(encode_prompt(templated, s)) == "<user>Q:1+2\n\n<assistant>"
    plain = build_char_tokenizer()
    ids = encode_prompt(plain, p)
    assert ids[0] == plain.bos_token_id and plain.decode(ids[1:]) == "system: Be brief.\nuser: Q:0+0\n Answer briefly."


def bad_rows(tmp_path: Path) -> Path:
    rows: list[dict[str, Any]] = verl_rows(30)
    for i in (4, 9, 12):
        rows[i]["reward_model"] = {"ground_truth": "" if i == 9 else None, "style": "rule"}
    rows[7]["prompt"] = [{"role": "user", "content": "  "}]
    rows[15]["prompt"] = [{"role": "user"}]  # no content
    rows[20]["prompt"] = [{"role": "user", "content": "Q:" + "1+" * 60 + "1\n"}]
    return write_jsonl(tmp_path / "bad.jsonl", rows)


def test_bad_rows_are_counted_named_and_skipped_or_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = bad_rows(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vapo.tasks"):
        task = load(path)
    want = ("5 bad rows of 30: 3 without an answer (rows 4, 9, 12), 1 with an empty prompt (row 7), "
            "1 with a malformed prompt (row 15)")
    assert task.report == want
    assert want in caplog.text and "skipped" in caplog.text
    used = {task.train_row(i) for i in range(200)}
    assert not used & {4, 7, 9, 12, 15} and 20 in used
    with pytest.raises(ValueError, match=r"5 bad rows of 30: 3 without an answer \(rows 4, 9, 12\).*task.bad_rows=error"):
        load(path, bad_rows="error")
    # Too long for the engine: the char tokenizer gives one token per character (+ BOS).
    task.fit_context(build_char_tokenizer(), 40)
    assert task.report == "6" + want[1:] + ", 1 too long for the context (row 20)"
    assert 20 not in {task.train_row(i) for i in range(200)}
    long_row = {"prompt": [{"role": "user", "content": "Q:" + "2+" * 60 + "2\n"}], "reward_model": {"ground_truth": "122"}}
    strict = load(write_jsonl(tmp_path / "long.jsonl", verl_rows(20) + [long_row]), bad_rows="error")
    cfg = load_config(None, ["engine.context_length=100", "actors.max_new_tokens=60"])
    assert prompt_token_budget(cfg) == 40
    with pytest.raises(ValueError, match=r"1 bad row of 21: 1 too long for the context \(row 20\)"):
        fit_task(strict, cfg, build_char_tokenizer())


def test_shuffled_order_is_a_permutation_per_pass_fixed_by_the_seed(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "toy.jsonl", verl_rows(40))
    a, b = load(path, shuffle_seed=7), load(path, shuffle_seed=7)
    n = len(a._train)
    order = [a.train_row(i) for i in range(3 * n)]
    assert order == [b.train_row(i) for i in range(3 * n)]  # another process, the same order
    passes = [order[k * n:(k + 1) * n] for k in range(3)]
    assert all(sorted(p) == sorted(passes[0]) and len(set(p)) == n for p in passes)  # each pass: every row once
    assert passes[0] != passes[1]  # a fresh permutation each pass
    assert passes[0] != sorted(passes[0])
    other = load(path, shuffle_seed=8)
    assert [other.train_row(i) for i in range(len(other._train))] != passes[0]
    assert other.eval_prompts() == a.eval_prompts()  # the order's seed leaves the held-out split alone
    in_file_order = load(path, shuffle_seed=7, shuffle=False)
    assert [in_file_order.train_row(i) for i in range(2 * n)] == sorted(passes[0]) * 2
    # The run's seed orders the data unless task.shuffle_seed says otherwise; the resolved config keeps it.
    assert load_config(None, ["run.seed=7"]).task.shuffle_seed == 7
    assert load_config(None, ["run.seed=7", "task.shuffle_seed=3"]).task.shuffle_seed == 3


def test_a_resumed_cursor_continues_the_same_prompt_stream(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "toy.jsonl", verl_rows(40))
    uninterrupted = load(path)
    cursor = PromptCursor(tmp_path / "cursor-1.json", actor_id=1, num_actors=2)
    seen = []
    for _ in range(7):
        k = cursor.take()
        assert k is not None
        seen.append(uninterrupted.train_prompt(cursor.index(k)))
        cursor.complete(k)
    resumed_task, resumed = load(path), PromptCursor(tmp_path / "cursor-1.json", actor_id=1, num_actors=2)
    for _ in range(50):  # past the end of the rows: the stream cycles
        k = resumed.take()
        assert k is not None
        seen.append(resumed_task.train_prompt(resumed.index(k)))
        resumed.complete(k)
    assert seen == [uninterrupted.train_prompt(1 + 2 * k) for k in range(57)]
