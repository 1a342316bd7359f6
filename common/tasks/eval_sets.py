"""Named evaluation sets (``task.eval_sets``): benchmark files evaluated beside the held-out slice.

Not a CLI. The learner evaluates every set of ``eval_sets`` each ``learner.eval_every`` steps::

    sets = eval_sets(cfg, task)        # [EvalSet("heldout", ...), EvalSet("aime", ...)]
    prompts = load_eval_set("data/aime24.jsonl", "aime", cfg.task)

A set file is any prompt file ``dataset:`` reads (``common.tasks.dataset_task``: .jsonl, .parquet or a
``datasets.save_to_disk`` directory; verl's layout or question/answer lines; string or chat prompts), its columns
found as the training data's are (``task.*_key`` where the set has that column, else recognised), its bad rows
counted and skipped or refused by ``task.bad_rows``. A row's ``data_source`` defaults to the set's name (reports
give avg@k and pass@k per data_source). Each prompt carries the training prompts' instruction
(``task.instruction``; for a ``jsonl:`` task without one, its ``\\boxed{}`` instruction), ``split="eval"`` and the
set's name as its bucket. Responses are checked by the training task's ``verify`` (and the rewards the config
names): the training task decides how answers are read.

With no sets configured the held-out slice alone is evaluated, as the set named ``heldout``; with sets, the
held-out slice comes first unless ``task.eval_heldout`` is false. Relative paths are taken from the working
directory (the repository root, where every process of a run starts).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from common.config import Config, TaskConfig
from common.tasks.base import Prompt, Task
from common.tasks.dataset_task import bad_rows_report, item_prompt, read_items
from common.tasks.jsonl_task import INSTRUCTION

log = logging.getLogger("vapo.tasks")

HELDOUT = "heldout"  # the held-out slice's set name (config validation keeps it for that slice)


@dataclass(frozen=True)
class EvalSet:
    """One set as evaluated: its prompts, samples per prompt and response limit (the config's zeros resolved)."""

    name: str
    prompts: tuple[Prompt, ...]
    k: int
    max_new_tokens: int


def set_instruction(cfg: TaskConfig) -> str:
    """What the training task appends to its prompts, so a set's prompts ask the same way."""
    return cfg.instruction or (INSTRUCTION if cfg.name.startswith("jsonl:") else "")


def load_eval_set(path: str, name: str, cfg: TaskConfig) -> list[Prompt]:
    """The prompts of the set file ``path`` (see the module docstring); ValueError naming the set and the file."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"eval set {name!r}: file not found: {p}")
    try:
        items, bad, total = read_items(p, cfg, name, strict=False)
    except ValueError as e:
        raise ValueError(f"eval set {name!r}: {e}") from e
    report = bad_rows_report(bad, total)
    if report and cfg.bad_rows == "error":
        raise ValueError(f"eval set {name!r} ({p}): {report} (task.bad_rows=error; fix the rows or use skip)")
    if report:
        log.warning("eval set %r (%s): %s; skipped (task.bad_rows=skip)", name, p, report)
    if not items:
        raise ValueError(f"eval set {name!r}: {p} has no usable rows ({report or 'none'})")
    instruction = set_instruction(cfg)
    return [item_prompt(item, instruction, f"{name}:eval:{i}", "eval", i, bucket=name) for i, item in enumerate(items)]


def eval_sets(cfg: Config, task: Task) -> list[EvalSet]:
    """The sets one evaluation covers, in report order: the held-out slice (unless sets are configured and
    ``task.eval_heldout`` is false), then ``task.eval_sets`` as listed."""
    lc, tc = cfg.learner, cfg.task
    out = []
    if not tc.eval_sets or tc.eval_heldout:
        out.append(EvalSet(HELDOUT, tuple(task.eval_prompts()), lc.eval_k, cfg.actors.max_new_tokens))
    for s in tc.eval_sets:
        out.append(EvalSet(s.name, tuple(load_eval_set(s.path, s.name, tc)), s.k or lc.eval_k,
                           s.max_new_tokens or cfg.actors.max_new_tokens))
    return out
