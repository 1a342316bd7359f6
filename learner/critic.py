"""The critic module: V(s) from an HF backbone, a value head and (optionally) the surprise features (not a CLI).

``learner.models`` loads, saves and wraps it in DeepSpeed (``load_critic_module``, ``save_critic``,
``build_critic``); ``learner.forwards.critic_values`` reads V(s_t) from it over a micro-batch, padded or packed.

Deviation from the paper: none in the model; the value head is a fp32 ``Linear(hidden, 1)`` initialised deliberately
(``learner.value_head_init_*``), and the surprise MLP (``learner.value_head_surprise``) is vapo's own
(docs/CRITIC.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from learner.losses import chunked_token_logprobs
from learner.packing import Packed, segment_cummin


class Critic(nn.Module):
    """V(s) for every position: an HF backbone (no LM head) + a fp32 ``Linear(hidden, 1)`` value head.

    ``forward(input_ids, attention_mask, response_start=None) -> [B, S]`` fp32: values[b, s] is the value
    of the state that ends with token s (the caller reads position prompt_len + t − 1 for V(s_t)).

    With ``surprise`` (learner.value_head_surprise) a small fp32 MLP adds a term computed from two
    features of each response prefix: the log-probability of its latest token and the running minimum of
    its tokens' log-probabilities, both under the critic's own (tied) LM head and detached. On a
    deterministic task a sampled mistake is an unlikely token, and the running minimum keeps the value low
    after it; a linear head on the last hidden state has to re-derive that comparison (docs/CRITIC.md). The
    MLP's last layer starts at zero, so the initial values are the plain head's. The LM head is the input
    embedding matrix, so ``load_critic_module`` refuses a model with untied embeddings; the log-probs are
    computed over the response tokens only, ``logit_chunk_elements`` (tokens × vocab) at a time.

    ``surprise_source`` (learner.value_head_surprise_source) says whose log-probs the features are:
    ``critic_head`` the critic's own tied LM head over its own (training) backbone, which the value loss moves
    and with it the features; ``behaviour`` the behaviour log-probs each sample carries (the caller passes them
    as ``token_logprobs``); ``frozen_base`` a frozen copy of the base model (``frozen_base``, backbone and tied
    LM head, no gradient, never in the optimizer): a frozen head alone would still read the training backbone's
    hidden states, so the features would still move."""

    SOURCES = ("critic_head", "behaviour", "frozen_base")

    def __init__(self, backbone: PreTrainedModel, hidden_size: int, init_std: float, init_bias: float,
                 surprise: bool = False, logit_chunk_elements: int = 1 << 24, surprise_source: str = "critic_head",
                 frozen_base: PreTrainedModel | None = None) -> None:
        super().__init__()
        if surprise_source not in self.SOURCES:
            raise ValueError(f"surprise_source must be one of {self.SOURCES}, got {surprise_source!r}")
        self.backbone = backbone
        self.surprise_source = surprise_source
        self.frozen_base: PreTrainedModel | None = None
        if surprise and surprise_source == "frozen_base":
            self.frozen_base = frozen_base if frozen_base is not None else copy.deepcopy(backbone)
            self.frozen_base.requires_grad_(False)
        self.logit_chunk_elements = logit_chunk_elements
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        with torch.no_grad():
            if init_std > 0:
                self.value_head.weight.normal_(0.0, init_std)
            else:
                self.value_head.weight.zero_()
            self.value_head.bias.fill_(init_bias)
        self.surprise_head: nn.Sequential | None = None
        if surprise:
            first, last = nn.Linear(2, 32, dtype=torch.float32), nn.Linear(32, 1, dtype=torch.float32)
            self.surprise_head = nn.Sequential(first, nn.SiLU(), last)
            with torch.no_grad():
                last.weight.zero_()
                last.bias.zero_()

    def head_state_dict(self) -> dict[str, Tensor]:
        """Everything above the backbone (saved as ``value_head.safetensors``)."""
        out = dict(self.value_head.state_dict())
        if self.surprise_head is not None:
            out.update({f"surprise.{k}": v for k, v in self.surprise_head.state_dict().items()})
        return out

    def load_head_state_dict(self, state: dict[str, Tensor]) -> None:
        self.value_head.load_state_dict({k: v for k, v in state.items() if not k.startswith("surprise.")})
        extra = {k[len("surprise."):]: v for k, v in state.items() if k.startswith("surprise.")}
        if self.surprise_head is not None and extra:
            self.surprise_head.load_state_dict(extra)

    @torch.no_grad()
    def _surprise_features(self, h: Tensor, input_ids: Tensor, real: Tensor,
                           running_min: Callable[[Tensor], Tensor], token_logprobs: Tensor | None = None,
                           base_kwargs: dict[str, object] | None = None) -> Tensor:
        """``[B, S, 2]`` (running minimum, latest) token log-probs at the response tokens ``real`` ``[B, S]`` (each
        with a predecessor in its row), 0 elsewhere; ``running_min`` of ``[B, S]`` along each row.

        ``token_logprobs`` ``[B, S]`` (source ``behaviour``): each response token's log-prob at its own position,
        used as given; ``base_kwargs`` (source ``frozen_base``): the backbone's keyword inputs, for the frozen copy."""
        if token_logprobs is not None:
            tok = token_logprobs.to(device=h.device, dtype=torch.float32) * real
            return torch.stack([running_min(tok), tok], dim=-1)
        model = self.backbone
        if self.frozen_base is not None:
            model = self.frozen_base
            h = self.frozen_base(input_ids=input_ids, use_cache=False, **(base_kwargs or {})).last_hidden_state.float()
        emb = cast(Tensor, model.get_input_embeddings().weight)
        b, s = real.nonzero(as_tuple=True)  # log p(token s | < s) is read from the hidden state at s − 1
        chunks = max(1, -(-len(b) * emb.shape[0] // max(1, self.logit_chunk_elements)))
        lp, _ = chunked_token_logprobs(h[b, s - 1], lambda x: x @ emb.t().to(x.dtype), input_ids[b, s], chunks,
                                       recompute=False, entropy=False)
        tok = torch.zeros(input_ids.shape, dtype=torch.float32, device=h.device).index_put((b, s), lp)  # [B, S]
        return torch.stack([running_min(tok), tok], dim=-1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, response_start: Tensor | None = None,
                packed: Packed | None = None, token_logprobs: Tensor | None = None) -> Tensor:
        """``packed`` (``learner.packing``): ``input_ids`` is its ``[1, N]`` stream; the mask and response starts
        come from it (``attention_mask``, ``response_start`` unused). ``token_logprobs`` ``[B, S]`` / ``[1, N]``:
        the response tokens' behaviour log-probs at their own positions (read with surprise source ``behaviour``,
        which needs them)."""
        extra = packed.model_kwargs() if packed is not None else {"attention_mask": attention_mask}
        out = self.backbone(input_ids=input_ids, use_cache=False, **extra)
        h = out.last_hidden_state.float()
        # The head computes in fp32 even when DeepSpeed keeps the parameters in bf16/fp16.
        w, b = self.value_head.weight.float(), self.value_head.bias.float()
        v = torch.nn.functional.linear(h, w, b).squeeze(-1)
        if self.surprise_head is None:
            return v
        given = token_logprobs if self.surprise_source == "behaviour" else None
        if self.surprise_source == "behaviour" and given is None:
            raise ValueError("surprise source behaviour: the critic needs the samples' behaviour log-probs")
        if packed is not None:  # a row's response tokens all follow its prompt: each has a predecessor in its row
            feats = self._surprise_features(h.detach(), input_ids, packed.response_start,
                                            lambda x: segment_cummin(x[0], packed.cu_seqlens)[None], given, extra)
        elif response_start is not None and attention_mask is not None:
            feats = self._padded_surprise_features(h.detach(), input_ids, attention_mask, response_start, given)
        else:
            return v
        return v + self.surprise_head(feats).squeeze(-1)

    def _padded_surprise_features(self, h: Tensor, input_ids: Tensor, attention_mask: Tensor,
                                  response_start: Tensor, token_logprobs: Tensor | None = None) -> Tensor:
        """``_surprise_features`` of right-padded rows whose responses start at ``response_start`` ``[B]``."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        real = (pos[None, :] >= response_start.to(input_ids.device)[:, None]) & attention_mask.bool()
        real[:, 0] = False  # token 0 has no predecessor
        return self._surprise_features(h, input_ids, real, lambda x: torch.cummin(x, dim=1).values, token_logprobs,
                                       {"attention_mask": attention_mask})
