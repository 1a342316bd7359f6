"""Sampling parameters (parsed and range-checked like SGLang's) and the batched token sampler.

``SamplingParams.from_dict`` takes a request's ``sampling_params`` and verifies it as SGLang's
``SamplingParams.verify`` does (same defaults, same error messages); ``sample`` draws the next token of every
running sequence from one ``[B, V]`` logits batch (temperature / top_p / top_k / min_p, greedy rows by
argmax) and returns its logprob.

Deviations from SGLang: penalties, stop strings, grammars, logit bias and per-request seeds are accepted only
at their defaults (anything else is a ``RequestError``); the sampler inverts the CDF instead of calling
multinomial (same distribution, another random stream).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SAMPLING_EPS = 1e-6  # SGLang: temperature below this means greedy
# Sampling params SGLang accepts that this server honours, and those it accepts only at their defaults.
_HONOURED = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos", "n",
             "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
_DEFAULT_ONLY: dict[str, Any] = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                                 "min_new_tokens": 0, "stop": None, "stop_regex": None, "json_schema": None,
                                 "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
                                 "custom_params": None, "sampling_seed": None}


TOP_K_ALL = 1 << 30  # SGLang's sampling_params: top_k = -1 means this ("whole vocabulary")
INT32_MAX = 2**31 - 1
FLOAT_BOUND = 1e300  # float fields: an integer beyond this would overflow float()
DEFAULT_MAX_N = 1024


class RequestError(ValueError):
    """A request the server refuses (answered 400 with this message)."""


def short_repr(v: Any, limit: int = 80) -> str:
    """repr() of a client value, cut short: error messages must not echo (or first build) a 10 MB string.
    Integers past Python's str-conversion limit (4300 digits) are described, not converted."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"<integer of {v.bit_length()} bits>"
    if isinstance(v, list | dict | str) and len(v) > limit:
        return f"<{type(v).__name__} of length {len(v)}>"
    try:
        r = repr(v)
    except (ValueError, RecursionError):
        return f"<{type(v).__name__}>"
    return r if len(r) <= limit else r[:limit] + "..."


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, vocab_size: int, max_n: int = DEFAULT_MAX_N) -> SamplingParams:
        """Parse and verify like SGLang's SamplingParams.verify (same defaults, same error messages), plus
        the integer ranges SGLang's tensors imply (top_k <= 2^30, int32 token counts) and ``n <= max_n``."""
        d = dict(d or {})
        for key, value in d.items():
            if key in _HONOURED:
                continue
            if key in _DEFAULT_ONLY:
                if value not in (_DEFAULT_ONLY[key], None, [], {}, ""):
                    raise RequestError(f"sampling param {key}={short_repr(value)} is not supported by rollout_server")
                continue
            raise RequestError(f"unknown sampling param {short_repr(key)}")

        def num(key: str, default: float, kind: type, lo: float, hi: float) -> Any:
            # Range-check before any float()/int() conversion: a 400-digit integer must be a 400, not an
            # OverflowError, and a value past a tensor's dtype must never reach the sampler.
            v = d.get(key)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {short_repr(v)}.")
            if isinstance(v, float) and not math.isfinite(v) and key != "temperature":
                raise RequestError(f"{key} must be a finite number, got {v}.")
            if isinstance(v, float) and kind is int and not v.is_integer():
                raise RequestError(f"{key} must be an integer, got {v}.")
            if (isinstance(v, int) or math.isfinite(v)) and v > hi:
                raise RequestError(f"{key} must be at most {hi if kind is int else f'{hi:g}'}, got {short_repr(v)}.")
            if (isinstance(v, int) or math.isfinite(v)) and v < lo:
                raise RequestError(f"{key} must be at least {lo if kind is int else f'{lo:g}'}, got {short_repr(v)}.")
            return kind(v)

        temperature = num("temperature", 1.0, float, -FLOAT_BOUND, FLOAT_BOUND)
        top_p = num("top_p", 1.0, float, -FLOAT_BOUND, FLOAT_BOUND)
        top_k = num("top_k", -1, int, -math.inf, TOP_K_ALL)  # SGLang maps -1 to TOP_K_ALL = 2^30, its largest value
        min_p = num("min_p", 0.0, float, -FLOAT_BOUND, FLOAT_BOUND)
        n = num("n", 1, int, 1, max_n)
        max_new = d.get("max_new_tokens", 128)
        if max_new is not None:
            max_new = num("max_new_tokens", 128, int, -INT32_MAX, INT32_MAX)
        if not math.isfinite(temperature) or temperature < 0.0:
            raise RequestError(f"temperature must be a non-negative finite number, got {temperature}.")
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
        if not 0.0 <= min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {min_p}.")
        if top_k < 1 and top_k != -1:
            raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if max_new is not None and max_new < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
        stop_ids = d.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise RequestError(f"stop_token_ids must be a list of integers, got {short_repr(stop_ids)}.")
        if any(not 0 <= t < vocab_size for t in stop_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab_size - 1}], got {short_repr(stop_ids)}.")
        ignore_eos = d.get("ignore_eos") or False
        if not isinstance(ignore_eos, bool):
            raise RequestError(f"ignore_eos must be a boolean, got {short_repr(ignore_eos)}.")
        if temperature < SAMPLING_EPS:  # SGLang: greedy is top_k = 1 at temperature 1
            temperature, top_k = 1.0, 1
        return cls(max_new_tokens=-1 if max_new is None else max_new, temperature=temperature, top_p=top_p,
                   top_k=top_k, min_p=min_p, stop_token_ids=frozenset(stop_ids), ignore_eos=ignore_eos, n=n)


def validate_prompt(ids: Any, params: SamplingParams, vocab_size: int, context_length: int) -> list[int]:
    """``ids`` when they are a prompt the model can take with ``params`` (SGLang's wording otherwise, as a
    ``RequestError``); an unset ``max_new_tokens`` becomes the rest of the context."""
    if not isinstance(ids, list) or not ids:
        raise RequestError("input_ids cannot be empty.")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError("input_ids must be a list of integers or a list of lists of integers.")
    if any(t < 0 or t >= vocab_size for t in ids):
        raise RequestError(f"The input_ids {short_repr(ids)} contains values greater than the vocab size ({vocab_size}).")
    if len(ids) >= context_length:
        raise RequestError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                           f"({context_length} tokens).")
    if params.max_new_tokens < 0:  # None: up to the context length
        params.max_new_tokens = context_length - len(ids)
    if len(ids) + params.max_new_tokens > context_length:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {len(ids) + params.max_new_tokens} tokens: {len(ids)} tokens from the "
            f"input messages and {params.max_new_tokens} tokens for the completion. Please reduce the number "
            f"of tokens in the input messages or the completion to fit within the limit.")
    return ids



def _race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row from unnormalised ``probs`` by inverting the CDF (exact; ~20x cheaper than multinomial
    on CPU). Zero-probability tokens are never drawn: their CDF step is empty."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator,
           scaled_logprobs: bool) -> tuple[list[int], list[float]]:
    """Next tokens and their logprobs for a batch of fp32 logits ``[B, V]``.

    The returned logprob is log_softmax(logits) (temperature 1, what the learner recomputes) unless
    ``scaled_logprobs``, then log_softmax(logits / T) like SGLang's default. Neither reflects top-k/top-p
    truncation, as in SGLang.
    """
    b, vocab = logits.shape
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    greedy = all(p.greedy for p in params)
    if greedy:
        nxt = logits.argmax(dim=-1)
    else:
        scaled = logits / temps[:, None]
        # Clamped to the vocabulary: equivalent, and no value can overflow the int64 rank comparison.
        top_ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        need_filter = any(k < vocab for k in top_ks) or any(p.top_p < 1.0 or p.min_p > 0.0 for p in params)
        if not need_filter:
            nxt = _race(torch.softmax(scaled, dim=-1), generator)
        else:
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            rank = torch.arange(vocab, device=logits.device)[None, :]
            k_t = torch.tensor(top_ks, device=logits.device)[:, None]
            p_t = torch.tensor([p.top_p for p in params], device=logits.device)[:, None]
            m_t = torch.tensor([p.min_p for p in params], device=logits.device)[:, None]
            drop = (rank >= k_t) | ((probs.cumsum(-1) - probs) > p_t) | (probs < m_t * probs[:, :1])
            probs = probs.masked_fill(drop, 0.0)
            nxt = order.gather(1, _race(probs, generator)[:, None]).squeeze(1)
        greedy_rows = torch.tensor([p.greedy for p in params], device=logits.device)
        if bool(greedy_rows.any()):
            nxt = torch.where(greedy_rows, logits.argmax(dim=-1), nxt)
    if scaled_logprobs and not greedy:
        src = torch.where(torch.tensor([p.greedy for p in params], device=logits.device)[:, None], logits,
                          logits / temps[:, None])
    else:
        src = logits
    lp = torch.log_softmax(src, dim=-1).gather(1, nxt[:, None]).squeeze(1)
    return nxt.tolist(), lp.tolist()

