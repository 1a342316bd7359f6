"""The decode engine behind ``actors.rollout_server``: continuous batching over an HF transformers model.

One background thread owns the model and a preallocated KV cache of ``max_batch_size`` slots. Requests
arriving from any thread join a waiting queue; at every step boundary the thread admits waiting sequences
into free slots (one batched, right-padded prefill), then runs one batched decode step for every running
sequence, samples (temperature / top_p / top_k / min_p), and retires sequences that hit EOS, a stop token
or ``max_new_tokens``. Finished slots are compacted (the last running sequence moves into the hole) so the
decode step always works on a contiguous ``[:B]`` view of the cache.

The forward pass reuses the HF model's own weights and modules (embeddings, RMSNorm, projections, rotary
tables, MLP activation, lm_head) and replaces only the cache handling and the decode attention, so the
logits are the ones the learner recomputes with ``model(input_ids)`` (|Δ logprob| ≲ 1e-6 in fp32). Where
it gets its speed over ``model.generate``: q/k/v and gate/up run as one matmul each (the HF Linear weights
are re-seated as views into the fused tensors, so weight updates still land), the KV cache is written in
place (no per-step concatenation), identical prompts admitted together (the n samples of a request) are
prefilled once and their KV rows copied, and sampling inverts the CDF instead of calling multinomial.
Supported: Llama-style decoder stacks (Qwen2, Qwen3 with q/k norms, Llama, Mistral without sliding
window); anything else is refused at load with a clear message.

Weight updates (``update_weights``) are validated off the decode thread, then copied into the live model
between two decode steps: never in the middle of a forward. Like SGLang, an update waits for the running
requests to finish on the old weights unless generation is paused (``pause("in_place" | "retract")``), in
which case it applies at once and the paused requests continue on the new weights; every output token
records the weight version that produced it.

Deviations from SGLang: no radix/prefix cache (``flush_cache`` only checks that the engine is idle), no
chunked prefill, no streaming, no stop strings, no penalties.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import logging
import math
import mmap
import stat
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("vapo.engine")

SAMPLING_EPS = 1e-6  # SGLang: temperature below this means greedy
PAUSE_MODES = ("abort", "retract", "in_place")
# Sampling params SGLang accepts that this engine honours, and those it accepts only at their defaults.
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
    """A request the engine refuses (the server answers 400 with this message)."""


class EngineBusy(RuntimeError):
    """The waiting queue holds too many tokens to take this request (the server answers 503)."""


def _short(v: Any, limit: int = 80) -> str:
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
                    raise RequestError(f"sampling param {key}={_short(value)} is not supported by rollout_server")
                continue
            raise RequestError(f"unknown sampling param {_short(key)}")

        def num(key: str, default: float, kind: type, lo: float, hi: float) -> Any:
            # Range-check before any float()/int() conversion: a 400-digit integer must be a 400, not an
            # OverflowError, and a value past a tensor's dtype must never reach the sampler.
            v = d.get(key)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {_short(v)}.")
            if isinstance(v, float) and not math.isfinite(v) and key != "temperature":
                raise RequestError(f"{key} must be a finite number, got {v}.")
            if isinstance(v, float) and kind is int and not v.is_integer():
                raise RequestError(f"{key} must be an integer, got {v}.")
            if (isinstance(v, int) or math.isfinite(v)) and v > hi:
                raise RequestError(f"{key} must be at most {hi if kind is int else f'{hi:g}'}, got {_short(v)}.")
            if (isinstance(v, int) or math.isfinite(v)) and v < lo:
                raise RequestError(f"{key} must be at least {lo if kind is int else f'{lo:g}'}, got {_short(v)}.")
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
            raise RequestError(f"stop_token_ids must be a list of integers, got {_short(stop_ids)}.")
        if any(not 0 <= t < vocab_size for t in stop_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab_size - 1}], got {_short(stop_ids)}.")
        ignore_eos = d.get("ignore_eos") or False
        if not isinstance(ignore_eos, bool):
            raise RequestError(f"ignore_eos must be a boolean, got {_short(ignore_eos)}.")
        if temperature < SAMPLING_EPS:  # SGLang: greedy is top_k = 1 at temperature 1
            temperature, top_k = 1.0, 1
        return cls(max_new_tokens=-1 if max_new is None else max_new, temperature=temperature, top_p=top_p,
                   top_k=top_k, min_p=min_p, stop_token_ids=frozenset(stop_ids), ignore_eos=ignore_eos, n=n)


@dataclass
class Sequence:
    """One sample being generated (a request with n > 1 or a batch becomes several)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Sequence], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    retractions: int = 0
    created: float = field(default_factory=time.time)
    finished_at: float = 0.0
    # Slot bookkeeping: how many positions of this sequence's KV are in the cache.
    cached_len: int = 0
    # Tokens this sequence counts against ``max_queued_tokens`` while it waits (prompt + max_new_tokens).
    cost: int = 0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class WeightLoadError(RuntimeError):
    pass


def _regular_file(p: Path) -> None:
    """Refuse anything but a regular file: opening a FIFO (or a device) named like a checkpoint blocks the
    reader forever, which no later timeout can interrupt."""
    try:
        mode = p.stat().st_mode
    except OSError as e:
        raise WeightLoadError(f"cannot stat {p.name}: {e}") from e
    if not stat.S_ISREG(mode):
        raise WeightLoadError(f"{p.name} is not a regular file")


def _read_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (single file or shards)."""
    from safetensors.torch import load_file

    path = Path(model_path)
    if not path.is_dir():
        raise WeightLoadError(f"model_path {str(path)!r} is not a directory")
    index = path / "model.safetensors.index.json"
    if index.exists():
        _regular_file(index)
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {str(path)!r}")
    for name in files:
        _regular_file(path / name)
    out: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            out.update(load_file(str(path / name), device="cpu"))
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise WeightLoadError(f"cannot read {name}: {e}") from e
    return out


class _Runner:
    """Batched prefill/decode of a Llama-style HF model against a slot-major KV cache.

    The q/k/v and gate/up projection weights are re-seated as views into one fused tensor each, so a
    decode step runs one matmul per fused group while ``named_parameters()`` (and weight updates that
    ``copy_`` into them) keep working unchanged.
    """

    def __init__(self, model: torch.nn.Module, max_slots: int, max_len: int, device: torch.device) -> None:
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if base is None or layers is None or not hasattr(model, "lm_head") or not hasattr(base, "rotary_emb"):
            raise RuntimeError(f"rollout_server supports Llama-style decoders (Qwen2/Qwen3/Llama); got "
                               f"{type(model).__name__}. Serve other architectures with SGLang.")
        for layer in layers:
            attn = layer.self_attn
            if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
                raise RuntimeError(f"unsupported attention module {type(attn).__name__}")
            if getattr(attn, "sliding_window", None):
                raise RuntimeError("sliding-window attention is not supported by rollout_server")
        cfg = model.config
        self.model = model
        self.base = base
        self.layers = list(layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.scale = self.head_dim ** -0.5
        self.max_slots = max_slots
        self.max_len = max_len
        self.device = device
        dtype = next(model.parameters()).dtype
        self.fp32 = dtype == torch.float32
        shape = (max_slots, self.n_kv, max_len, self.head_dim)
        kv_bytes = 2 * len(self.layers) * math.prod(shape) * torch.finfo(dtype).bits // 8
        log.info("KV cache: %d slots x %d positions = %.1f MiB", max_slots, max_len, kv_bytes / 2**20)
        self._maps: list[mmap.mmap] = []
        try:
            self.k = [self._zeros(shape, dtype, device) for _ in self.layers]
            self.v = [self._zeros(shape, dtype, device) for _ in self.layers]
        except (RuntimeError, MemoryError, OSError) as e:
            raise RuntimeError(f"cannot allocate the KV cache ({kv_bytes / 2**30:.1f} GiB for {max_slots} slots x "
                               f"{max_len} positions): lower --max-batch-size or --context-length ({e})") from e
        self._arange = torch.arange(max_len, device=device)
        with torch.no_grad():
            self.qkv = [self._fuse([ly.self_attn.q_proj, ly.self_attn.k_proj, ly.self_attn.v_proj]) for ly in self.layers]
            mlps = [ly.mlp for ly in self.layers]
            self.gate_up = [self._fuse([m.gate_proj, m.up_proj]) if hasattr(m, "gate_proj") and hasattr(m, "up_proj")
                            and hasattr(m, "down_proj") and hasattr(m, "act_fn") else None for m in mlps]
            # cos/sin for every position, computed by the model's own rotary module (same values it uses).
            probe = torch.zeros(1, 1, device=device, dtype=dtype)
            cos, sin = base.rotary_emb(probe, self._arange[None])
            self.cos, self.sin = cos[0], sin[0]  # [max_len, D]

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed cache tensor. On CPU it lives in its own page-aligned anonymous mapping (huge pages where
        the kernel allows): decode steps measured ~20% faster than with the default allocator's memory,
        and untouched slots cost no RAM."""
        if device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
        self._maps.append(mm)  # the tensor borrows this memory; keep the mapping alive with the runner
        return torch.frombuffer(mm, dtype=dtype).view(shape)

    @staticmethod
    def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        sizes = [lin.weight.shape[0] for lin in linears]
        w = torch.cat([lin.weight.data for lin in linears], 0).contiguous()
        has_bias = [lin.bias is not None for lin in linears]
        b = torch.cat([lin.bias.data for lin in linears], 0).contiguous() if all(has_bias) else None
        off = 0
        for lin, n in zip(linears, sizes, strict=True):
            lin.weight.data = w[off : off + n]
            if b is not None:
                lin.bias.data = b[off : off + n]
            off += n
        if any(has_bias) and b is None:  # mixed biases: keep separate modules (not seen in practice)
            raise RuntimeError("q/k/v projections with partial biases are not supported")
        return w, b, sizes

    def _norm(self, mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        eps = getattr(mod, "variance_epsilon", None)
        if self.fp32 and eps is not None and type(mod).__name__.endswith("RMSNorm"):
            return F.rms_norm(x, (x.shape[-1],), mod.weight, eps)
        return mod(x)

    def _qkv(self, li: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Roped q ``[b, t, H, D]``, roped k and v ``[b, t, KV, D]``."""
        attn = self.layers[li].self_attn
        w, bias, _ = self.qkv[li]
        b, t, _ = h.shape
        x = F.linear(h, w, bias).view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk, v = x[:, :, : self.n_heads + self.n_kv], x[:, :, self.n_heads + self.n_kv :]
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before rope
            qk = torch.cat([attn.q_norm(qk[:, :, : self.n_heads]), attn.k_norm(qk[:, :, self.n_heads :])], dim=2)
        half = self.head_dim // 2
        rot = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        qk = qk * cos + rot * sin
        return qk[:, :, : self.n_heads], qk[:, :, self.n_heads :], v

    def _mlp_residual(self, li: int, x: torch.Tensor) -> torch.Tensor:
        layer = self.layers[li]
        h = self._norm(layer.post_attention_layernorm, x)
        fused = self.gate_up[li]
        if fused is None:
            return x + layer.mlp(h)
        w, bias, sizes = fused
        gu = F.linear(h, w, bias)
        g, u = gu[..., : sizes[0]], gu[..., sizes[0] :]
        return x + layer.mlp.down_proj(layer.mlp.act_fn(g) * u)

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self._norm(self.base.norm, x_last)).float()

    def prefill(self, slot0: int, contexts: list[list[int]]) -> torch.Tensor:
        """Fill slots slot0.. with ``contexts``; logits of each context's last position ``[n, V]``.

        Identical contexts (the n samples of one prompt) are computed once and their KV rows copied to the
        other slots, as SGLang's prefix cache would share them; HF generate recomputes every copy.
        """
        n = len(contexts)
        rep: dict[tuple[int, ...], int] = {}
        uniq: list[int] = []  # index in ``contexts`` of each distinct context
        which: list[int] = []  # for each context: its distinct context's position in ``uniq``
        for i, c in enumerate(contexts):
            j = rep.setdefault(tuple(c), len(uniq))
            if j == len(uniq):
                uniq.append(i)
            which.append(j)
        u = len(uniq)
        lens = torch.tensor([len(contexts[i]) for i in uniq], device=self.device)
        t = int(lens.max())
        ids = torch.zeros((u, t), dtype=torch.long)
        for r, i in enumerate(uniq):
            ids[r, : len(contexts[i])] = torch.tensor(contexts[i], dtype=torch.long)
        ids = ids.to(self.device)
        dst = None if u == n else torch.tensor(uniq, device=self.device) + slot0
        x = self.base.embed_tokens(ids)
        cos, sin = self.cos[:t][None, :, None, :], self.sin[:t][None, :, None, :]
        ar = self._arange[:t]
        mask = (ar[None, :] <= ar[:, None])[None, None] & (ar[None, None, None, :] < lens[:, None, None, None])
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(li, self._norm(layer.input_layernorm, x), cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if dst is None:
                self.k[li][slot0 : slot0 + n, :, :t] = k
                self.v[li][slot0 : slot0 + n, :, :t] = v
            else:
                self.k[li][dst, :, :t] = k
                self.v[li][dst, :, :t] = v
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.group > 1)
            x = x + layer.self_attn.o_proj(out.transpose(1, 2).reshape(u, t, -1))
            x = self._mlp_residual(li, x)
        logits = self._logits(x[torch.arange(u, device=self.device), lens - 1])
        if dst is None:
            return logits
        copies = [(slot0 + i, slot0 + uniq[which[i]]) for i in range(n) if uniq[which[i]] != i]
        to = torch.tensor([c[0] for c in copies], device=self.device)
        frm = torch.tensor([c[1] for c in copies], device=self.device)
        for cache in (*self.k, *self.v):
            cache[to, :, :t] = cache[:, :, :t].index_select(0, frm)
        return logits[torch.tensor(which, device=self.device)]

    def decode(self, tokens: list[int], lens: list[int]) -> torch.Tensor:
        """One step for slots 0..B-1: token i sits at position lens[i]; logits [B, V]."""
        b, kv, d = len(tokens), self.n_kv, self.head_dim
        tok = torch.tensor(tokens, dtype=torch.long).to(self.device).unsqueeze(1)
        pos = torch.tensor(lens, dtype=torch.long).to(self.device)
        t = int(max(lens)) + 1
        x = self.base.embed_tokens(tok)
        cos, sin = self.cos[pos][:, None, None, :], self.sin[pos][:, None, None, :]
        # Flat row index of (slot, kv head, position) in each [S*KV*T, D] cache view: one index_copy_ per tensor.
        rows = torch.arange(b, device=self.device)
        flat_idx = ((rows[:, None] * kv + torch.arange(kv, device=self.device)[None, :]) * self.max_len
                    + pos[:, None]).reshape(-1)
        # Additive mask per (slot, kv head): -inf past each sequence's length.
        neg = torch.zeros((b, 1, t), dtype=x.dtype, device=self.device)
        neg.masked_fill_((self._arange[:t][None, :] > pos[:, None])[:, None, :], float("-inf"))
        neg = neg.expand(b, kv, t).reshape(b * kv, 1, t)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(li, self._norm(layer.input_layernorm, x), cos, sin)
            kc, vc = self.k[li], self.v[li]
            kc.view(-1, d).index_copy_(0, flat_idx, k.reshape(b * kv, d))
            vc.view(-1, d).index_copy_(0, flat_idx, v.reshape(b * kv, d))
            # Grouped-query attention for one query position as two batched matmuls over (slot, kv head)
            # views of the cache (no K/V repeat, no copy).
            qg = q.reshape(b * kv, self.group, d) * self.scale
            keys = kc.view(-1, self.max_len, d)[: b * kv, :t]
            scores = torch.baddbmm(neg, qg, keys.transpose(1, 2))
            out = torch.bmm(torch.softmax(scores, dim=-1), vc.view(-1, self.max_len, d)[: b * kv, :t])
            x = x + layer.self_attn.o_proj(out.reshape(b, 1, -1))
            x = self._mlp_residual(li, x)
        return self._logits(x[:, 0])

    def move(self, src: int, dst: int, length: int) -> None:
        for kc, vc in zip(self.k, self.v, strict=True):
            kc[dst, :, :length] = kc[src, :, :length]
            vc[dst, :, :length] = vc[src, :, :length]


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


class Engine:
    """Continuous-batching generation engine; thread-safe ``submit`` / control calls."""

    def __init__(self, model: torch.nn.Module, *, max_batch_size: int = 256, context_length: int = 0,
                 weight_version: str = "default", eos_token_ids: set[int] | None = None, seed: int = 0,
                 scaled_logprobs: bool = False, batch_wait_ms: float = 0.0, metrics: Any = None,
                 max_prefill_tokens: int = 16384, max_queued_tokens: int = 0,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        """``max_queued_tokens``: most prompt + max_new_tokens tokens waiting for a slot (0 = 16 x slots x
        context length); past it ``submit`` raises ``EngineBusy``. ``on_death``: called (engine thread) with
        the exception when the engine thread dies, so the server can exit instead of answering 503 forever."""
        self.model = model.eval()
        self.device = next(model.parameters()).device
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        model_ctx = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        self.context_length = min(context_length, model_ctx) if context_length > 0 else model_ctx
        self.max_batch_size = max_batch_size
        self.runner = _Runner(model, max_batch_size, self.context_length, self.device)
        self.weight_version = weight_version
        self.eos_token_ids = set(eos_token_ids or ())
        self.scaled_logprobs = scaled_logprobs
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queued_tokens = max_queued_tokens or 16 * max_batch_size * self.context_length
        self.queued_tokens = 0
        self.on_death = on_death
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.metrics = metrics
        # Every parameter name, tied duplicates included (checkpoints may or may not store lm_head.weight).
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._aliases: dict[int, set[str]] = {}
        for name, p in self._params.items():
            self._aliases.setdefault(id(p), set()).add(name)

        self._cv = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._commands: deque[tuple[Callable[[], Any], cf.Future]] = deque()
        self.running: list[Sequence] = []  # index == KV slot; touched only by the engine thread
        self.paused: str | None = None
        self._pending_update: tuple[dict[str, torch.Tensor], str | None, cf.Future] | None = None
        self._stop = False
        self.steps = 0
        self.last_step_at = time.time()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        self._set_version_metric()

    # ------------------------------------------------------------------ public API (any thread)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def num_waiting(self) -> int:
        with self._cv:
            return len(self._waiting)

    def validate_prompt(self, ids: Any, params: SamplingParams) -> list[int]:
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids cannot be empty.")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("input_ids must be a list of integers or a list of lists of integers.")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise RequestError(f"The input_ids {_short(ids)} contains values greater than the vocab size ({self.vocab_size}).")
        if len(ids) >= self.context_length:
            raise RequestError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                               f"({self.context_length} tokens).")
        if params.max_new_tokens < 0:  # None: up to the context length
            params.max_new_tokens = self.context_length - len(ids)
        if len(ids) + params.max_new_tokens > self.context_length:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} tokens. "
                f"You requested a total of {len(ids) + params.max_new_tokens} tokens: {len(ids)} tokens from the "
                f"input messages and {params.max_new_tokens} tokens for the completion. Please reduce the number "
                f"of tokens in the input messages or the completion to fit within the limit.")
        return ids

    def admissible(self, cost: int) -> None:
        """Raise ``EngineBusy`` unless ``cost`` more queued tokens fit under ``max_queued_tokens``: callers
        check this before they build a request's sequences, so an oversized request allocates nothing."""
        if cost > self.max_queued_tokens:
            raise RequestError(f"The request needs {cost} tokens (prompts x n x (input + max_new_tokens)), more "
                               f"than the server queues at once ({self.max_queued_tokens}, --max-queued-tokens).")
        if self.queued_tokens + cost > self.max_queued_tokens:
            raise EngineBusy(f"The server is busy: {self.queued_tokens} tokens are queued and this request needs "
                             f"{cost} more (limit {self.max_queued_tokens}, --max-queued-tokens). Retry later.")

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences; each one's ``on_done`` is called from the engine thread when it finishes.
        Raises ``EngineBusy`` when they would push the queue past ``max_queued_tokens``."""
        if not self.alive:
            raise RuntimeError("engine is not running")
        done_now = []
        with self._cv:
            for s in seqs:
                s.cost = len(s.prompt_ids) + max(s.params.max_new_tokens, 0)
            self.admissible(sum(s.cost for s in seqs))
            for s in seqs:
                if s.params.max_new_tokens == 0:  # prefill-only in SGLang; nothing to generate here
                    s.finish = {"type": "length", "length": 0}
                    done_now.append(s)
                else:
                    self._waiting.append(s)
                    self.queued_tokens += s.cost
            self._cv.notify_all()
        for s in done_now:
            s.finished_at = time.time()
            s.on_done(s)

    def call(self, fn: Callable[[], Any]) -> cf.Future:
        """Run ``fn`` on the engine thread at the next step boundary."""
        fut: cf.Future = cf.Future()
        with self._cv:
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut

    def abort(self, rids: set[str] | None, message: str = "Aborted by request.", prefix: str | None = None) -> cf.Future:
        """Abort the given request ids (None = all; or those starting with ``prefix``, as SGLang matches a
        batch rid): they finish with finish_reason abort. The future resolves to how many were aborted."""
        return self.call(lambda: self._abort(rids, message, prefix))

    def pause(self, mode: str) -> cf.Future:
        if mode not in PAUSE_MODES:
            raise RequestError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        return self.call(lambda: self._pause(mode))

    def resume(self) -> cf.Future:
        return self.call(self._resume)

    def flush_cache(self) -> cf.Future:
        """SGLang refuses to flush while requests run or wait; there is no prefix cache to drop here."""
        return self.call(lambda: not self.running and not self._waiting)

    def update_weights(self, model_path: str, weight_version: str | None) -> cf.Future:
        """Validate a safetensors checkpoint now (caller's thread), apply it between decode steps.

        The future resolves to (success, message). While generation runs, the update waits for the running
        requests to finish (new ones wait behind it); while paused it applies at once.
        """
        try:
            sd = self._validated(model_path)
        except Exception as e:
            fut: cf.Future = cf.Future()
            fut.set_result((False, f"Failed to update weights: {e}."))
            return fut
        return self.apply_weights(sd, weight_version)

    def read_weights(self, model_path: str) -> dict[str, torch.Tensor]:
        """Read and validate a checkpoint (caller's thread); raises on any problem. ``apply_weights`` then
        installs it: a caller that gave up waiting for the read simply never applies it."""
        return self._validated(model_path)

    def apply_weights(self, sd: dict[str, torch.Tensor], weight_version: str | None) -> cf.Future:
        """Install validated weights between decode steps; the future resolves to (success, message)."""
        fut: cf.Future = cf.Future()

        def arm() -> None:
            if self._pending_update is not None:
                self._pending_update[2].set_result((False, "Superseded by a newer weight update."))
            self._pending_update = (sd, weight_version, fut)

        self.call(arm)
        return fut

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ engine thread

    def _validated(self, model_path: str) -> dict[str, torch.Tensor]:
        sd = _read_state_dict(model_path)
        unknown = sorted(set(sd) - set(self._params))
        if unknown:
            raise WeightLoadError(f"tensors not in the served model: {unknown[:5]}")
        missing = sorted(n for n, p in self._params.items() if not self._aliases[id(p)] & sd.keys())
        if missing:
            raise WeightLoadError(f"checkpoint lacks tensors: {missing[:5]}")
        for name, t in sd.items():
            if tuple(t.shape) != tuple(self._params[name].shape):
                raise WeightLoadError(f"shape mismatch for {name}: {tuple(t.shape)} vs {tuple(self._params[name].shape)}")
            if not torch.isfinite(t.float()).all():
                raise WeightLoadError(f"non-finite values in {name}")
        return sd

    def _apply_update(self) -> None:
        assert self._pending_update is not None
        sd, version, fut = self._pending_update
        self._pending_update = None
        with torch.no_grad():
            for name, t in sd.items():
                self._params[name].copy_(t)
        if version is not None:
            self.weight_version = version
        self._set_version_metric()
        msg = "Succeeded to update model weights."
        fut.set_result((True, msg))
        log.info("weights updated (version %s)", self.weight_version)

    def _set_version_metric(self) -> None:
        if self.metrics is not None:
            try:
                self.metrics.weight_version.set(float(self.weight_version))
            except ValueError:
                pass

    def _abort(self, rids: set[str] | None, message: str, prefix: str | None = None) -> int:
        def hit_by(s: Sequence) -> bool:
            if prefix is not None:
                return s.rid.startswith(prefix)
            return rids is None or s.rid in rids

        hit = 0
        with self._cv:
            keep: deque[Sequence] = deque()
            for s in self._waiting:
                if hit_by(s):
                    s.finish = {"type": "abort", "message": message, "status_code": None, "err_type": None}
                    self.queued_tokens -= s.cost
                    self._done(s)
                    hit += 1
                else:
                    keep.append(s)
            self._waiting = keep
        gone = {i for i, s in enumerate(self.running) if hit_by(s)}
        for i in gone:
            self.running[i].finish = {"type": "abort", "message": message, "status_code": None, "err_type": None}
            self._done(self.running[i])
        self._compact(gone)
        return hit + len(gone)

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(None, "Aborted by pause_generation.")
        elif mode == "retract":
            with self._cv:
                for s in reversed(self.running):
                    s.retractions += 1
                    s.cached_len = 0
                    self._waiting.appendleft(s)
                    self.queued_tokens += s.cost
            self.running = []
        self.paused = mode

    def _resume(self) -> None:
        self.paused = None

    def _done(self, s: Sequence) -> None:
        s.finished_at = time.time()
        if self.metrics is not None:
            self.metrics.requests.labels(status=s.finish["type"] if s.finish else "unknown").inc()
        try:
            s.on_done(s)
        except Exception:  # a callback must never kill the engine
            log.exception("on_done callback failed")

    def _compact(self, finished: set[int]) -> None:
        for idx in sorted(finished, reverse=True):
            last = len(self.running) - 1
            if idx != last:
                moved = self.running[last]
                self.runner.move(last, idx, moved.cached_len)
                self.running[idx] = moved
            self.running.pop()

    def _admission_blocked(self) -> bool:
        return self.paused is not None or self._pending_update is not None

    def _has_work(self) -> bool:
        if self._commands:
            return True
        if self._pending_update is not None and (self.paused is not None or not self.running):
            return True
        if self.paused is not None:
            return False
        return bool(self.running) or (bool(self._waiting) and not self._admission_blocked())

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._has_work():
                        self._cv.wait()
                    if self._stop:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut in commands:
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # report to the caller, keep serving
                        fut.set_exception(e)
                if self._pending_update is not None and (self.paused is not None or not self.running):
                    self._apply_update()
                if self.paused is None:
                    with torch.inference_mode():
                        self._step()
        except BaseException as e:  # the server reports unhealthy; every caller gets an answer
            self.error = e
            log.exception("engine thread died")
            with self._cv:
                pending = self.running + list(self._waiting)
                self._waiting.clear()
                self.queued_tokens = 0
                commands = list(self._commands)
                self._commands.clear()
            self.running = []
            for s in pending:
                s.finish = {"type": "abort", "message": f"engine error: {e}", "status_code": 500, "err_type": None}
                self._done(s)
            for _, fut in commands:
                fut.set_exception(RuntimeError(f"engine died: {e}"))
            if self._pending_update is not None:
                self._pending_update[2].set_result((False, f"engine died: {e}"))
            if self.on_death is not None:
                try:
                    self.on_death(e)
                except Exception:
                    log.exception("on_death callback failed")

    def _admit(self) -> list[Sequence]:
        with self._cv:
            if self._admission_blocked() or not self._waiting:
                return []
            if not self.running and self.batch_wait_s > 0:
                # Idle engine: give concurrent requests a moment to arrive so they share the first prefill.
                wait_until = self._waiting[0].created + self.batch_wait_s
                while time.time() < wait_until and len(self._waiting) < self.max_batch_size and not self._commands:
                    self._cv.wait(timeout=max(0.0, wait_until - time.time()))
            free = self.max_batch_size - len(self.running)
            batch: list[Sequence] = []
            tokens = 0
            while self._waiting and len(batch) < free:
                ctx = len(self._waiting[0].prompt_ids) + len(self._waiting[0].output_ids)
                if batch and tokens + ctx > self.max_prefill_tokens:
                    break
                s = self._waiting.popleft()
                self.queued_tokens -= s.cost
                batch.append(s)
                tokens += ctx
            return batch

    def _step(self) -> None:
        t0 = time.perf_counter()
        new = self._admit()
        finished: set[int] = set()
        if new:
            slot0 = len(self.running)
            contexts = [s.context for s in new]
            self.running.extend(new)  # before the forward, so a failure still answers them
            logits = self.runner.prefill(slot0, contexts)
            for s, c in zip(new, contexts, strict=True):
                s.cached_len = len(c)
            self._append(slot0, logits, finished)
        # Decode every running sequence that did not just get its token from the prefill.
        decode_upto = len(self.running) if not new else slot0
        if decode_upto > 0:
            seqs = self.running[:decode_upto]
            logits = self.runner.decode([s.output_ids[-1] for s in seqs], [s.cached_len for s in seqs])
            for s in seqs:
                s.cached_len += 1
            self._append(0, logits, finished, upto=decode_upto)
        for i in finished:
            self._done(self.running[i])
        self._compact(finished)
        self.steps += 1
        self.last_step_at = time.time()
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(self.running) + len(finished))
            self.metrics.running_sequences.set(len(self.running))
            self.metrics.queued_sequences.set(len(self._waiting))
            self.metrics.step_seconds.observe(time.perf_counter() - t0)

    def _append(self, start: int, logits: torch.Tensor, finished: set[int], upto: int | None = None) -> None:
        seqs = self.running[start:upto if upto is not None else len(self.running)]
        toks, lps = sample(logits, [s.params for s in seqs], self.generator, self.scaled_logprobs)
        version = self.weight_version
        for j, (s, tok, lp) in enumerate(zip(seqs, toks, lps, strict=True)):
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            p = s.params
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                s.finish = {"type": "stop", "matched": tok}
            elif len(s.output_ids) >= p.max_new_tokens or s.cached_len >= self.context_length:
                s.finish = {"type": "length", "length": len(s.output_ids)}
            if s.finish is not None:
                finished.add(start + j)
        if self.metrics is not None:
            self.metrics.generated_tokens.inc(len(seqs))


def new_rid() -> str:
    return uuid.uuid4().hex
