"""Task interface shared by every task: prompts, verdicts, the held-out split and prompt encoding.

A task is a deterministic, infinite, indexable stream of training prompts (actors shard it by index), a
fixed held-out list of evaluation prompts that is disjoint from training by construction (a stable hash
bucket of the item decides its split, so no training index can ever produce an evaluation item), and a
verifier that turns a decoded response into a reward of 1 or 0 plus the answer it parsed.

``encode_prompt`` gives exactly the token ids the engine is sent; ``decode_response`` gives exactly the
text ``verify`` receives. Both live here so actors, learner evaluation and the SFT bootstrap agree.
"""

from __future__ import annotations

import abc
import hashlib
import random
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One task item. ``answer`` is the reference answer; ``bucket`` groups items for evaluation reports."""

    prompt_id: str
    text: str
    answer: str
    split: str = "train"  # "train" | "eval"
    index: int = 0  # position in its split's stream (train) or list (eval)
    bucket: str = ""  # difficulty / length bucket label, e.g. "3d" for 3-column additions
    data_source: str = ""  # the dataset the item came from: per-source figures and reward functions key on it
    extra_info: str = ""  # the item's extra fields as JSON text, handed to a user's reward function
    # A chat prompt's turns as (role, content) pairs; ``text`` is then their plain form (``plain_chat``).
    messages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Verdict:
    """The verifier's score (1.0 or 0.0 for the built-in tasks) and the answer it parsed (None = unparseable).

    A reward function (``common.tasks.rewarded``) may add figures of its own (``extra``) and, when its call
    failed or its value was out of range, the kind of failure (``error``, one of ``REWARD_ERROR_KINDS``)."""

    reward: float
    parsed: str | None
    extra: dict[str, float] = field(default_factory=dict)
    error: str = ""


class Task(abc.ABC):
    """A prompt source with a held-out split and a verifier."""

    name: str

    @abc.abstractmethod
    def train_prompt(self, index: int) -> Prompt:
        """The ``index``-th training prompt (any index >= 0; same index, same prompt, in every process)."""

    @abc.abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts (fixed list; never produced by ``train_prompt``)."""

    @abc.abstractmethod
    def verify(self, prompt: Prompt, response: str) -> Verdict:
        """Score a decoded response to ``prompt``."""

    def fit_context(self, tokenizer: Any, max_prompt_tokens: int) -> None:  # noqa: B027 - optional hook, a no-op
        """Drop (or refuse, by the task's policy) prompts longer than ``max_prompt_tokens`` once encoded with
        ``tokenizer``. The built-in tasks' prompts are short, so only user data sets act on it."""

    def verify_batch(self, prompt: Prompt, responses: list[str]) -> list[Verdict]:
        """Score several responses to ``prompt`` (a group), in order; a reward pool does it in one round trip."""
        return [self.verify(prompt, r) for r in responses]

    def verify_blocks(self, prompt: Prompt) -> bool:
        """Whether scoring ``prompt``'s responses may block for long (a reward pool's round trip): an asyncio
        caller then runs ``verify_batch`` on a thread so its loop keeps serving."""
        return False

    def close(self) -> None:
        """Release what scoring holds (a reward pool's processes); the task's prompts stay usable."""
        return None  # the built-in tasks hold nothing

    def teacher_response(self, prompt: Prompt, rng: random.Random | None = None, error_rate: float = 0.0) -> str:
        """A worked response for ``prompt`` with step mistakes at ``error_rate`` (the SFT bootstrap's data).

        Only the embedded synthetic tasks have one; other tasks start from a pretrained model.
        """
        raise NotImplementedError(f"task {self.name!r} has no teacher; point model.path at a pretrained HF model")


_FINAL_LINE = re.compile(r"(?:^|\n)A:([^\n]*)\Z")


def final_answer(response: str) -> str | None:
    """What follows ``A:`` on the response's last line (trailing whitespace dropped); None when the last
    line is not an answer line. The built-in step-by-step tasks end every response with one."""
    m = _FINAL_LINE.search(response.rstrip())
    return None if m is None else m.group(1)


def stable_hash(*parts: Any) -> int:
    """A 64-bit hash that is identical across processes and Python versions (unlike ``hash``)."""
    data = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def in_eval_bucket(seed: int, buckets: int, key: str) -> bool:
    """Whether the item identified by ``key`` belongs to the held-out split (bucket 0 of ``buckets``)."""
    return stable_hash(seed, "split", key) % buckets == 0


def _token_ids(x: Any) -> list[int]:
    """apply_chat_template returns a list, a BatchEncoding or a dict depending on the transformers version."""
    if isinstance(x, dict) or hasattr(x, "keys"):
        x = x["input_ids"]
    return [int(i) for i in x]


def plain_chat(messages: tuple[tuple[str, str], ...]) -> str:
    """A chat prompt as plain text, for tokenizers without a chat template: a lone user turn is its content;
    a longer conversation is one ``<role>: <content>`` block per turn, joined by newlines."""
    if len(messages) == 1 and messages[0][0] == "user":
        return messages[0][1]
    return "\n".join(f"{role}: {content}" for role, content in messages)


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The token ids the engine is given for ``prompt``.

    Tokenizers with a chat template (instruct models on GPU) get the prompt's messages (a string prompt as
    one user turn) plus the generation prompt; plain tokenizers (the embedded char tokenizer, base models)
    get BOS + text (a chat prompt's ``plain_chat`` form).
    """
    if getattr(tokenizer, "chat_template", None):
        turns = prompt.messages or (("user", prompt.text),)
        ids = _token_ids(
            tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in turns], add_generation_prompt=True, tokenize=True
            )
        )
    else:
        ids = _token_ids(tokenizer.encode(prompt.text, add_special_tokens=True))
        bos = tokenizer.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
    return ids


def decode_response(tokenizer: Any, output_ids: list[int]) -> str:
    """The text ``verify`` receives: output ids up to (not including) the first EOS, specials dropped."""
    ids = [int(i) for i in output_ids]
    eos = tokenizer.eos_token_id
    if eos is not None and eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True)
