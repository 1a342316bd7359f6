"""``actors.rollout_server``'s ``/generate`` bodies: parsed into a ``GenerateRequest`` and admitted, in SGLang's order.

``GenerateParser`` turns a ``/generate`` JSON body into prompts, sampling parameters, request ids and logprob
options, raising ``BadRequest`` (a malformed body: SGLang's validation error) or ``RequestError`` (a value
SGLang refuses) in the order SGLang checks, so the first error named matches; ``census`` counts a raw body
before it is parsed (``guard.check_generate_body``) and ``admit`` checks that every prompt fits the model and
the request fits the waiting queue before a single sequence exists. Used by ``http.Server``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from actors.rollout_server.body import BadRequest, check_text, is_int_list
from actors.rollout_server.guard import check_generate_body
from common.generation.sampling import DEFAULT_MAX_N, RequestError, SamplingParams
from common.generation.scheduler import Scheduler, new_rid


@dataclasses.dataclass
class GenerateRequest:
    """A parsed /generate body: one entry per prompt in ``prompts``, ``params``, ``rids``, ``return_logprob``."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    rids: list[str]
    return_logprob: list[bool]
    text_in_logprobs: bool
    single: bool  # answered with one object rather than a list

    @property
    def n(self) -> int:
        """Samples per prompt (the same for every prompt)."""
        return self.params[0].n


class GenerateParser:
    """A /generate body as a ``GenerateRequest`` (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any, *, max_n: int = DEFAULT_MAX_N, max_prompts: int = 0) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_n = max_n
        # Most prompts in one /generate (0: as many sequences as 16 full batches).
        self.max_prompts = max_prompts or 16 * scheduler.max_batch_size
        # Longest token in characters: a text prompt longer than context_length x this cannot fit, and is
        # refused before it is tokenised.
        self.max_token_chars = _max_token_chars(tokenizer)

    async def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        text, ids = body.get("text"), body.get("input_ids")
        if body.get("input_embeds") is not None:
            raise RequestError("input_embeds is not supported by rollout_server")
        if (text is None) == (ids is None):
            raise RequestError("Either text, input_ids or input_embeds should be provided.")
        if ids is not None:
            if not isinstance(ids, list):
                raise BadRequest("input_ids: Input should be a valid list")
            if len(ids) == 0:
                raise RequestError("input_ids cannot be empty.")
            if len(ids) > self.max_prompts and not isinstance(ids[0], int):
                raise RequestError(f"The request has {len(ids)} prompts, more than the server takes in one request "
                                   f"({self.max_prompts}, --max-prompts-per-request).")
            if is_int_list(ids):
                return [ids], True
            if all(is_int_list(x) for x in ids):
                return ids, False
            raise BadRequest("input_ids: Input should be a list of integers or a list of lists of integers")
        if self.tokenizer is None:
            raise RequestError("text input needs a tokenizer; the server runs with --skip-tokenizer-init")
        single = isinstance(text, str)
        texts = [text] if single else text
        if isinstance(texts, list) and len(texts) > self.max_prompts:
            raise RequestError(f"The request has {len(texts)} prompts, more than the server takes in one request "
                               f"({self.max_prompts}, --max-prompts-per-request).")
        if not (isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
            raise BadRequest("text: Input should be a valid string or list of strings")
        limit = self.scheduler.context_length * self.max_token_chars
        for t in texts:
            check_text(t, "text")
            if len(t) > limit:
                raise RequestError(f"text: {len(t)} characters cannot fit the model's context length "
                                   f"({self.scheduler.context_length} tokens).")
        # Off the event loop: a long batch takes a while to tokenise, and /health must keep answering.
        ids_list = await asyncio.to_thread(lambda: [self.tokenizer(t)["input_ids"] for t in texts])
        return ids_list, single

    def census(self, raw: bytes) -> str | None:
        return check_generate_body(raw, self.max_prompts, self.scheduler.max_queued_tokens)

    @staticmethod
    def _per_item(value: Any, n: int, name: str, default: Any) -> list[Any]:
        if value is None:
            return [default] * n
        if isinstance(value, list):
            if len(value) != n:
                raise RequestError(f"The length of {name} should be equal to the batch size ({n}), got {len(value)}.")
            return [default if v is None else v for v in value]
        return [value] * n

    async def parse(self, body: dict[str, Any]) -> GenerateRequest:
        """A /generate body as prompts, sampling parameters and options; raises BadRequest (malformed) or
        RequestError (a value SGLang refuses) in the order SGLang checks, so the first error named matches."""
        if body.get("stream"):
            raise RequestError("stream=true is not supported by rollout_server")
        prompts, single = await self._prompts(body)
        params = self._sampling_params(body.get("sampling_params"), len(prompts))
        if params[0].n > 1:
            single = False
        return_logprob = self._logprob_options(body, len(prompts))
        text_in_logprobs = body.get("return_text_in_logprobs", False)
        if not isinstance(text_in_logprobs, bool):
            raise BadRequest("return_text_in_logprobs: Input should be a valid boolean")
        rids = self._rids(body.get("rid"), len(prompts), single and params[0].n == 1)
        return GenerateRequest(prompts, params, rids, return_logprob, text_in_logprobs, single)

    def _sampling_params(self, raw: Any, batch: int) -> list[SamplingParams]:
        if raw is not None and not isinstance(raw, dict | list):
            raise BadRequest("sampling_params: Input should be a valid dictionary or list")
        items = self._per_item(raw, batch, "sampling_params", {})
        if not all(isinstance(s, dict) for s in items):
            raise BadRequest("sampling_params: each item should be a valid dictionary")
        params = [SamplingParams.from_dict(s, self.scheduler.vocab_size, self.max_n) for s in items]
        if any(p.n != params[0].n for p in params):
            raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
        return params

    def _logprob_options(self, body: dict[str, Any], batch: int) -> list[bool]:
        """Per-prompt ``return_logprob``; the logprob options this server does not implement are refused."""
        return_logprob = self._per_item(body.get("return_logprob"), batch, "return_logprob", False)
        if not all(isinstance(x, bool) for x in return_logprob):
            raise BadRequest("return_logprob: Input should be a valid boolean")
        for key in ("logprob_start_len", "top_logprobs_num"):
            vals = self._per_item(body.get(key), batch, key, -1 if key == "logprob_start_len" else 0)
            if any(v not in (-1, 0) or isinstance(v, bool) for v in vals) and key == "top_logprobs_num":
                raise RequestError("top_logprobs_num > 0 is not supported by rollout_server")
            if key == "logprob_start_len" and any(v != -1 for v in vals):
                raise RequestError("logprob_start_len other than -1 is not supported by rollout_server")
        if body.get("token_ids_logprob"):
            raise RequestError("token_ids_logprob is not supported by rollout_server")
        return return_logprob

    @staticmethod
    def _rids(rid: Any, batch: int, one_output: bool) -> list[str]:
        """One request id per prompt: generated, the caller's list, or the caller's string (suffixed per
        prompt unless the request has a single output)."""
        if isinstance(rid, str) or isinstance(rid, list) and all(isinstance(r, str) for r in rid):
            for r in [rid] if isinstance(rid, str) else rid:
                check_text(r, "rid")
        if rid is None:
            return [new_rid() for _ in range(batch)]
        if isinstance(rid, str):
            return [rid] if one_output else [f"{rid}_{i}" for i in range(batch)]
        if isinstance(rid, list) and len(rid) == batch and all(isinstance(r, str) for r in rid):
            return rid
        raise RequestError("The rid should be a string or a list of strings of the batch size.")

    def admit(self, req: GenerateRequest) -> None:
        """Every prompt fits the model, and what the request would queue fits the queue, checked before a
        single Sequence exists (RequestError, or SchedulerBusy while the queue is full)."""
        for ids, p in zip(req.prompts, req.params, strict=True):
            self.scheduler.validate_prompt(ids, p)
        self.scheduler.admissible(req.n * sum(len(ids) + p.max_new_tokens
                                              for ids, p in zip(req.prompts, req.params, strict=True)))


def _max_token_chars(tokenizer: Any) -> int:
    """Characters in the tokenizer's longest token (at least 1; 64 when the vocabulary cannot be read)."""
    if tokenizer is None:
        return 64
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:  # tokenizers without get_vocab
        return 64


__all__ = ["GenerateParser", "GenerateRequest"]
