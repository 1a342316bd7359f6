"""``reasoning_gym:<generator>``: procedural reasoning tasks from the reasoning-gym package.

Items come from reasoning-gym's generators (``reasoning_gym.create_dataset``); rewards from the generator's
own ``score_answer`` applied to the text inside the response's last ``<answer>...</answer>`` tags (the
package's answer convention, extracted with its ``extract_answer``). Deviation: the score is binarised
(1 when ``score_answer`` gives full credit, else 0) because the buffer's positives and VAPO's terminal reward
assume a 0/1 verifier; some generators give partial credit for near answers.

Split: an item whose question text hashes into bucket 0 of ``task.eval_buckets`` is held out. The training
stream skips such items (it draws a replacement from a side stream at the same position), so no training
index yields a held-out question. ``task.train_size`` > 0 makes training cycle over that many items; 0 gives
an infinite stream built from reseeded chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import reasoning_gym
from reasoning_gym.utils import extract_answer

from common.config import TaskConfig
from common.tasks.base import Prompt, Task, Verdict, in_eval_bucket, stable_hash

INSTRUCTION = "\nGive only the final answer between <answer> and </answer> tags at the end of your response."
_CHUNK = 10_000
_MAX_DRAWS = 1000


class ReasoningGymTask(Task):
    def __init__(self, generator: str, cfg: TaskConfig) -> None:
        if generator not in reasoning_gym.factory.DATASETS:
            known = ", ".join(sorted(reasoning_gym.factory.DATASETS))
            raise ValueError(f"reasoning_gym: unknown generator {generator!r}; known: {known}")
        if cfg.eval_buckets < 2:
            raise ValueError(f"reasoning_gym: eval_buckets must be >= 2, got {cfg.eval_buckets}")
        self.generator = generator
        self.name = f"reasoning_gym:{generator}"
        self.seed = cfg.seed
        self.eval_buckets = cfg.eval_buckets
        self.eval_size = cfg.eval_size
        self.train_size = cfg.train_size
        self.chunk = cfg.train_size if cfg.train_size > 0 else _CHUNK
        self._datasets: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self._eval: list[tuple[Prompt, dict[str, Any]]] | None = None

    def _dataset(self, stream: str, chunk_no: int) -> Any:
        key = (stream, chunk_no)
        ds = self._datasets.get(key)
        if ds is None:
            seed = stable_hash(self.seed, self.generator, stream, chunk_no) % (2**31)
            ds = reasoning_gym.create_dataset(self.generator, seed=seed, size=self.chunk)
            self._datasets[key] = ds
            while len(self._datasets) > 8:
                self._datasets.popitem(last=False)
        else:
            self._datasets.move_to_end(key)
        return ds

    def _entry(self, stream: str, pos: int) -> tuple[Any, dict[str, Any]]:
        ds = self._dataset(stream, pos // self.chunk)
        return ds, ds[pos % self.chunk]

    def _is_eval(self, entry: dict[str, Any]) -> bool:
        return in_eval_bucket(self.seed, self.eval_buckets, entry["question"])

    def _train_entry(self, index: int) -> tuple[Any, dict[str, Any]]:
        pos = index % self.train_size if self.train_size > 0 else index
        for attempt in range(_MAX_DRAWS):
            ds, entry = self._entry("train" if attempt == 0 else f"train-alt{attempt}", pos)
            if not self._is_eval(entry):
                return ds, entry
        raise RuntimeError(f"{self.name}: no training item found for index {index}")

    @staticmethod
    def _prompt(entry: dict[str, Any], split: str, index: int, name: str) -> Prompt:
        return Prompt(
            prompt_id=f"{name}:{split}:{index}",
            text=entry["question"] + INSTRUCTION,
            answer=str(entry["answer"]),
            split=split,
            index=index,
            bucket="all",
        )

    def train_prompt(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"train_prompt: index must be >= 0, got {index}")
        return self._prompt(self._train_entry(index)[1], "train", index, self.name)

    def _eval_items(self) -> list[tuple[Prompt, dict[str, Any]]]:
        if self._eval is None:
            out: list[tuple[Prompt, dict[str, Any]]] = []
            seen: set[str] = set()
            for pos in range(max(self.eval_size, 1) * self.eval_buckets * 20):
                if len(out) >= self.eval_size:
                    break
                _, entry = self._entry("eval", pos)
                if entry["question"] in seen or not self._is_eval(entry):
                    continue
                seen.add(entry["question"])
                out.append((self._prompt(entry, "eval", len(out), self.name), entry))
            if not out:
                raise RuntimeError(f"{self.name}: the held-out split is empty")
            self._eval = out
        return self._eval

    def eval_prompts(self) -> list[Prompt]:
        return [p for p, _ in self._eval_items()]

    def verify(self, prompt: Prompt, response: str) -> Verdict:
        if prompt.split == "eval":
            ds, entry = self._dataset("eval", 0), self._eval_items()[prompt.index][1]
        else:
            ds, entry = self._train_entry(prompt.index)
        parsed = extract_answer(response)
        if parsed is None:
            return Verdict(0.0, None)
        try:
            score = float(ds.score_answer(parsed, entry))
        except Exception:  # a generator's scorer choking on garbage is a wrong answer, not a crash
            score = 0.0
        return Verdict(1.0 if score >= 1.0 - 1e-9 else 0.0, parsed)
