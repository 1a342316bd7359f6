"""Named evaluation sets (``task.eval_sets``): benchmark files evaluated beside the held-out slice.

Not a CLI. The learner evaluates every set of ``eval_sets`` each ``learner.eval_every`` steps::

    sets = eval_sets(cfg, task)        # [EvalSet("heldout", ...), EvalSet("aime", ...)]
    prompts = load_eval_set("data/aime24.jsonl", "aime", cfg.task)

A set file holds JSON lines of ``question`` and ``answer`` (``problem``/``solution`` accepted) with an optional
``data_source`` (default: the set's name; reports give avg@k and pass@k per data_source) and ``extra_info``.
Each prompt carries the instruction the jsonl task appends, ``split="eval"`` and the set's name as its bucket.
Responses are checked by the training task's own ``verify``: the training task decides how answers are read.
With no sets configured the held-out slice alone is evaluated, as the set named ``heldout``; with sets, the
held-out slice comes first unless ``task.eval_heldout`` is false. Relative paths are taken from the working
directory (the repository root, where every process of a run starts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.config import Config, TaskConfig
from common.tasks.base import Prompt, Task
from common.tasks.jsonl_task import INSTRUCTION

HELDOUT = "heldout"  # the held-out slice's set name (config validation keeps it for that slice)


@dataclass(frozen=True)
class EvalSet:
    """One set as evaluated: its prompts, samples per prompt and response limit (the config's zeros resolved)."""

    name: str
    prompts: tuple[Prompt, ...]
    k: int
    max_new_tokens: int


def load_eval_set(path: str, name: str, cfg: TaskConfig) -> list[Prompt]:
    """The prompts of the set file ``path`` (see the module docstring); ValueError naming the file and line.

    ``cfg`` is the task's settings: unused by this jsonl reader, the general dataset loader reads its options
    there."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"eval set {name!r}: file not found: {p}")
    out: list[Prompt] = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: invalid JSON: {e}") from e
        q = obj.get("question", obj.get("problem")) if isinstance(obj, dict) else None
        a = obj.get("answer", obj.get("solution")) if isinstance(obj, dict) else None
        if not isinstance(q, str) or a is None:
            raise ValueError(f"{p}:{lineno}: need an object with 'question' (string) and 'answer'")
        source = obj.get("data_source") or name
        extra = json.dumps(obj["extra_info"], sort_keys=True) if "extra_info" in obj else ""
        out.append(Prompt(f"{name}:eval:{len(out)}", q + INSTRUCTION, str(a), "eval", len(out), name, str(source), extra))
    if not out:
        raise ValueError(f"eval set {name!r}: {p} has no items")
    return out


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
