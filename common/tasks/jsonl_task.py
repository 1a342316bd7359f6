"""``jsonl:<path>``: question/answer pairs from a JSON-lines file, checked with math-verify.

Each line is an object with ``question`` and ``answer`` strings (``problem``/``solution`` are accepted as
aliases). The prompt asks for the final answer in ``\\boxed{}`` (``task.instruction``, when set, replaces
that request); the verifier takes the last ``\\boxed{...}``
of the response (or, failing that, the text after a final ``Answer:``) and compares it with the reference
using math-verify (``parse`` + ``verify``), so ``1/2``, ``0.5`` and ``\\frac{1}{2}`` all match.

Split: a line whose question hashes into bucket 0 of ``task.eval_buckets`` is held out; the rest train,
cycled in file order (``task.train_size`` > 0 keeps only the first that many training lines). Duplicate
questions land in the same split, so the splits never share a question.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

from math_verify import parse, verify

from common.config import TaskConfig
from common.tasks.base import Prompt, Task, Verdict, in_eval_bucket

INSTRUCTION = "\nPut your final answer within \\boxed{}."


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_final(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    m = re.search(r"Answer:\s*(.+?)\s*\Z", text.strip(), flags=re.IGNORECASE | re.DOTALL)
    return m.group(1).strip() if m and "\n" not in m.group(1).strip() else None


def math_equal(gold: str, pred: str) -> bool:
    # math-verify's timeouts use signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def wrap(s: str) -> str:
        return s if ("$" in s or "\\boxed" in s) else f"${s}$"

    try:
        g = parse(wrap(gold), parsing_timeout=timeout)
        p = parse(wrap(pred), parsing_timeout=timeout)
        if not g or not p:
            return gold.strip() == pred.strip()
        return bool(verify(g, p, timeout_seconds=timeout))
    except Exception:
        return gold.strip() == pred.strip()


class JsonlTask(Task):
    def __init__(self, path: str, cfg: TaskConfig) -> None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"jsonl task: file not found: {p}")
        if cfg.eval_buckets < 2:
            raise ValueError(f"jsonl task: eval_buckets must be >= 2, got {cfg.eval_buckets}")
        self.name = f"jsonl:{path}"
        self.instruction = cfg.instruction or INSTRUCTION
        train: list[tuple[str, str]] = []
        held: list[tuple[str, str]] = []
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
            item = (q, str(a))
            (held if in_eval_bucket(cfg.seed, cfg.eval_buckets, q) else train).append(item)
        if cfg.train_size > 0:
            train = train[: cfg.train_size]
        if not train:
            raise ValueError(f"{p}: no training lines (all {len(held)} fell into the held-out bucket)")
        self._train = train
        self._eval = [
            Prompt(f"{self.name}:eval:{i}", q + self.instruction, a, "eval", i, "all")
            for i, (q, a) in enumerate(held[: cfg.eval_size])
        ]

    def train_prompt(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"train_prompt: index must be >= 0, got {index}")
        q, a = self._train[index % len(self._train)]
        return Prompt(f"{self.name}:train:{index}", q + self.instruction, a, "train", index, "all")

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        parsed = extract_final(response)
        if parsed is None or not parsed:
            return Verdict(0.0, None)
        return Verdict(1.0 if math_equal(prompt.answer, parsed) else 0.0, parsed)
