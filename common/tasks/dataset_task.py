"""``dataset:<path>``: a user's own prompts from a .jsonl file, a .parquet file or a ``datasets.save_to_disk``
directory (``common.tasks.dataset_files``), checked with math-verify. docs/DATA.md is the user's guide.

Columns: ``task.prompt_key``, ``task.answer_key``, ``task.data_source_key`` and ``task.extra_info_key`` name
them (dotted for a nested field, ``reward_model.ground_truth``); empty keys are recognised: verl's layout
(``prompt`` / ``reward_model.ground_truth`` / ``data_source`` / ``extra_info``) or the jsonl task's
(``question``|``problem`` / ``answer``|``solution``). A prompt is a string or a list of chat messages
(``{"role": ..., "content": ...}``); ``task.instruction`` is appended to the string, or to the last user
turn of a chat. A row's ``data_source`` defaults to the file's stem; its ``extra_info`` is kept as JSON text.

Bad rows (no answer, an empty or malformed prompt, and after ``fit_context`` a prompt too long for the
engine's context) are counted and named by row number (0-based, blank jsonl lines not counted) when the
task loads: ``task.bad_rows=skip`` leaves them out and logs the report, ``error`` raises it.

Split: a row whose prompt (without the instruction) hashes into bucket 0 of ``task.eval_buckets`` is held
out, so duplicate prompts share a split. Training cycles over the other rows (the first ``task.train_size``
when > 0): with ``task.shuffle`` each pass over them is a fresh permutation drawn from ``task.shuffle_seed`` (the run's
seed unless set) and the
pass number, so ``train_prompt(index)`` is the same in every process and a resumed actor cursor (an index)
continues where it stopped.

Verifier: the jsonl task's (last ``\\boxed{}``, else a final ``Answer:``) and, failing both, a last line
``A:<answer>`` (the embedded tasks' answer line), compared with math-verify.
"""

from __future__ import annotations

import json
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import TaskConfig
from common.tasks.base import (
    Prompt,
    Task,
    Verdict,
    encode_prompt,
    final_answer,
    in_eval_bucket,
    plain_chat,
    stable_hash,
)
from common.tasks.dataset_files import Row, columns, read_rows
from common.tasks.dataset_files import field as get_field
from common.tasks.jsonl_task import extract_final, math_equal

log = logging.getLogger("vapo.tasks")

AUTO_PROMPT = ("prompt", "question", "problem")
AUTO_ANSWER = ("reward_model.ground_truth", "answer", "solution")
NO_ANSWER, EMPTY, MALFORMED, TOO_LONG = ("without an answer", "with an empty prompt", "with a malformed prompt",
                                         "too long for the context")
_SHOWN_ROWS = 5  # row numbers a report names per reason
Messages = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Item:
    """One good row: its prompt (a string, or chat turns), reference answer and identity."""

    row: int
    text: str  # the prompt without the instruction (a chat's plain form): the split's key
    messages: Messages
    answer: str
    data_source: str
    extra_info: str


@dataclass
class ColumnMap:
    prompt: str
    answer: str
    data_source: str  # "" = the file's stem
    extra_info: str  # "" = none


def resolve_columns(cfg: TaskConfig, names: list[str], strict: bool = True) -> ColumnMap:
    """The columns to read: the keys the config names (each must exist; unless ``strict``, a named key the file
    lacks falls back to the recognised ones) or the recognised ones."""
    top = set(names)

    def pick(key: str, auto: tuple[str, ...], what: str, required: bool) -> str:
        if key and (strict or key.split(".")[0] in top):
            if key.split(".")[0] not in top:
                raise ValueError(f"task.{what}_key={key!r} is not a column; columns: {names}")
            return key
        found = next((k for k in auto if k.split(".")[0] in top), "")
        if required and not found:
            raise ValueError(f"no {what} column (looked for {' | '.join(auto)}); columns: {names}; "
                             f"name it with task.{what}_key")
        return found

    return ColumnMap(pick(cfg.prompt_key, AUTO_PROMPT, "prompt", True), pick(cfg.answer_key, AUTO_ANSWER, "answer", True),
                     pick(cfg.data_source_key, ("data_source",), "data_source", False),
                     pick(cfg.extra_info_key, ("extra_info",), "extra_info", False))


def _messages(value: Any) -> Messages | None:
    """A list of ``{"role", "content"}`` dicts as (role, content) pairs; None when it is not one."""
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        out.append((m["role"], m["content"]))
    return tuple(out)


def _text(value: Any) -> str:
    """An answer, data source or extra-info value as text (structured ones as sorted JSON)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def parse_row(row: Row, number: int, cols: ColumnMap, stem: str) -> Item | str:
    """The row as an Item, or the reason it is bad."""
    raw = get_field(row, cols.prompt)
    messages: Messages = ()
    if isinstance(raw, str):
        text = raw
    elif isinstance(raw, list | tuple):
        parsed = _messages(raw)
        if parsed is None:
            return MALFORMED
        messages, text = parsed, plain_chat(parsed)
        if not any(c.strip() for _, c in parsed):
            return EMPTY
    elif raw is None:
        return EMPTY
    else:
        return MALFORMED
    if not text.strip():
        return EMPTY
    answer = _text(get_field(row, cols.answer)).strip()
    if not answer:
        return NO_ANSWER
    source = _text(get_field(row, cols.data_source)) if cols.data_source else ""
    extra = get_field(row, cols.extra_info) if cols.extra_info else None
    return Item(number, text, messages, answer, source or stem, "" if extra is None else _text(extra))


def bad_rows_report(bad: dict[str, list[int]], total: int) -> str:
    """``"4 bad rows of 100: 3 without an answer (rows 4, 9, 12), 1 with an empty prompt (row 7)"``; "" if none."""
    n = sum(len(v) for v in bad.values())
    if n == 0:
        return ""
    parts = []
    for reason, rows in bad.items():
        shown = ", ".join(str(r) for r in rows[:_SHOWN_ROWS]) + (", ..." if len(rows) > _SHOWN_ROWS else "")
        parts.append(f"{len(rows)} {reason} ({'row' if len(rows) == 1 else 'rows'} {shown})")
    return f"{n} bad row{'s' if n != 1 else ''} of {total}: " + ", ".join(parts)


def item_prompt(item: Item, instruction: str, prompt_id: str, split: str, index: int, bucket: str = "all") -> Prompt:
    """The Prompt of a good row, ``instruction`` appended to its text (a chat's last user turn; the last turn when
    none is the user's)."""
    messages = item.messages
    if messages and instruction:
        last = next((i for i in reversed(range(len(messages))) if messages[i][0] == "user"), len(messages) - 1)
        role, content = messages[last]
        messages = (*messages[:last], (role, content + instruction), *messages[last + 1:])
    text = plain_chat(messages) if messages else item.text + instruction
    return Prompt(prompt_id=prompt_id, text=text, answer=item.answer, split=split, index=index, bucket=bucket,
                  data_source=item.data_source, extra_info=item.extra_info, messages=messages)


def read_items(path: Path, cfg: TaskConfig, stem: str, strict: bool = True) -> tuple[list[Item], dict[str, list[int]], int]:
    """A prompt file's good rows, its bad rows' numbers by reason, and its row count (``stem``: the data_source
    of a row without one; ``strict``: see ``resolve_columns``); ValueError when it has no rows or lacks a prompt
    or answer column."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path} has no rows")
    cols = resolve_columns(cfg, columns(rows), strict)
    items: list[Item] = []
    bad: dict[str, list[int]] = {}
    for number, row in enumerate(rows):
        item = parse_row(row, number, cols, stem)
        if isinstance(item, Item):
            items.append(item)
        else:
            bad.setdefault(item, []).append(number)
    return items, bad, len(rows)


@dataclass
class _Split:
    train: list[Item] = field(default_factory=list)
    held: list[Item] = field(default_factory=list)


class DatasetTask(Task):
    def __init__(self, path: str, cfg: TaskConfig) -> None:
        if cfg.eval_buckets < 2:
            raise ValueError(f"dataset task: eval_buckets must be >= 2, got {cfg.eval_buckets}")
        self.name = f"dataset:{path}"
        self.cfg = cfg
        stem = Path(path).stem if Path(path).is_file() else Path(path).name
        try:
            self._items, self.bad, self.total = read_items(Path(path), cfg, stem)
        except ValueError as e:
            raise ValueError(f"dataset task: {e}") from e
        self._build()

    def _build(self) -> None:
        """Apply the bad-row policy, then split and order the good rows."""
        self.report = bad_rows_report(self.bad, self.total)
        if self.report:
            if self.cfg.bad_rows == "error":
                raise ValueError(f"{self.name}: {self.report} (task.bad_rows=error; fix the rows or use skip)")
            log.warning("%s: %s; skipped (task.bad_rows=skip)", self.name, self.report)
        split = _Split()
        for item in self._items:
            (split.held if in_eval_bucket(self.cfg.seed, self.cfg.eval_buckets, item.text) else split.train).append(item)
        if self.cfg.train_size > 0:
            split.train = split.train[: self.cfg.train_size]
        if not split.train:
            raise ValueError(f"{self.name}: no training rows ({len(split.held)} held out, "
                             f"{self.total - len(self._items)} bad)")
        self._train = split.train
        self._eval = [self._prompt(item, "eval", i) for i, item in enumerate(split.held[: self.cfg.eval_size])]
        self._orders: OrderedDict[int, list[int]] = OrderedDict()

    def fit_context(self, tokenizer: Any, max_prompt_tokens: int) -> None:
        """Count rows whose encoded prompt is longer than ``max_prompt_tokens`` as bad (policy applies)."""
        if max_prompt_tokens <= 0:
            return
        keep: list[Item] = []
        for item in self._items:
            if len(encode_prompt(tokenizer, self._prompt(item, "train", 0))) > max_prompt_tokens:
                self.bad.setdefault(TOO_LONG, []).append(item.row)
            else:
                keep.append(item)
        if len(keep) != len(self._items):
            self._items = keep
            self._build()

    def _prompt(self, item: Item, split: str, index: int) -> Prompt:
        return item_prompt(item, self.cfg.instruction, f"{self.name}:{split}:{index}", split, index)

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self._train)))
            random.Random(stable_hash(self.cfg.shuffle_seed, "order", epoch)).shuffle(order)
            self._orders[epoch] = order
            while len(self._orders) > 4:  # actors stay within a pass or two of each other
                self._orders.popitem(last=False)
        return order

    def _train_item(self, index: int) -> Item:
        if index < 0:
            raise ValueError(f"train_prompt: index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(self._train))
        return self._train[self._order(epoch)[pos] if self.cfg.shuffle else pos]

    def train_row(self, index: int) -> int:
        """The row number the ``index``-th training prompt comes from."""
        return self._train_item(index).row

    def train_prompt(self, index: int) -> Prompt:
        return self._prompt(self._train_item(index), "train", index)

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        parsed = extract_final(response) or (final_answer(response) or "").strip()
        if not parsed:
            return Verdict(0.0, None)
        return Verdict(1.0 if math_equal(prompt.answer, parsed) else 0.0, parsed)


__all__ = ["DatasetTask", "bad_rows_report", "item_prompt", "parse_row", "read_items", "resolve_columns"]
