"""How a step's rows are cut: mini-batches, the deal of their rows to data-parallel ranks, micro-batches (not a CLI).

    minibatches = minibatch_rows(batch.size, mini_batches, seed, version)
    for micro in micro_batches(minibatches, batch, limits, grad=True, model="policy"): ...   # this rank's

Mini-batches: one seeded permutation of the rows per step (identical on every rank), cut into contiguous chunks;
every epoch reuses them.

The deal (``common.microplan.deal``): each mini-batch's rows that some loss reads are dealt to the ranks by a workload
model (linear + quadratic in a row's tokens: ``common.microplan.Workload`` from the model's shape), once, and every pass
of the step (values, critic update, π_old, actor update) uses that deal, so a rank holds the values and advantages of
exactly the rows it trains on (``my_rows``). Rows no loss reads are skipped in every pass: rows cut at the length limit
under ``algo.truncated=mask`` (``Batch.excluded``) by every pass, replayed positives (NLL only) by the critic's.

Micro-batches (``common.microplan.cut_shares``): each rank's share is cut into the same number of micro-batches, within
a token budget (``learner.micro_batch_tokens``; the no-grad passes, which keep no activations for a backward, use
``learner.no_grad_micro_batch_tokens``), balanced by workload within the rank and ordered heaviest first, so the k-th
micro-batches of the ranks, which ZeRO-2/3's per-layer collectives run in lockstep, cost about the same. Packed
(``learner.packing``; ``learner.packing`` builds the stream) a micro-batch is one token stream and the budget counts its
tokens; padded, rows × the longest, at most ``learner.micro_batch_size`` rows. A rank with no row left for an
index (a mini-batch with fewer rows than the plan has slots) runs a weight-0 filler there: every forward and backward
under ZeRO is a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from common.config import Config
from common.gpu_memory import read_model_config
from common.microplan import Workload, cut_shares, deal
from learner.batch import Batch
from learner.dist import rank, world_size


def minibatch_rows(n_rows: int, mini_batches: int, seed: int, version: int) -> list[Tensor]:
    """The step's mini-batches: one seeded permutation of the rows, cut into contiguous chunks."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(version))
    perm = torch.randperm(n_rows, generator=g)
    return [c for c in torch.tensor_split(perm, mini_batches) if len(c)]


def critic_minibatch_rows(actor: list[Tensor], n_rows: int, critic_updates: int, seed: int,
                          version: int) -> list[Tensor]:
    """The critic's mini-batches (learner.critic_updates, K_v): the actor's own list when ``critic_updates`` is 0,
    else the step's permutation cut into ``critic_updates`` chunks, one critic optimizer step each per epoch.
    Their rows are dealt to the ranks apart from the actor's, so with several ranks the pre-update values are
    summed over the ranks before the critic trains (``learner.train``)."""
    if critic_updates <= 0:
        return actor
    return minibatch_rows(n_rows, critic_updates, seed, version)


@dataclass(frozen=True)
class MicroLimits:
    """How micro-batches are cut (learner.packing, micro_batch_tokens, no_grad_micro_batch_tokens, micro_batch_size,
    logits_chunk_elements) and the sampling temperature the log-probs are of."""

    rows: int = 64  # padded layout: most rows per micro-batch
    tokens: int = 0  # training budget; 0 = ``rows`` × the batch's longest row
    no_grad_tokens: int = 0  # no-grad passes' budget; 0 = 2 × the training budget
    logit_elements: int = 0  # tokens × vocab per LM-head chunk; 0 = full logits
    temperature: float = 1.0  # the engines' sampling temperature: log π is of logits / temperature, as they sample
    packed: bool = False  # rows packed into one stream per micro-batch (learner.packing)
    work: Workload = field(default_factory=Workload)  # a row's cost, for the deal and the balance

    @classmethod
    def of(cls, limits: MicroLimits | int) -> MicroLimits:
        return limits if isinstance(limits, MicroLimits) else cls(rows=int(limits))

    @classmethod
    def from_config(cls, cfg: Config, temperature: float = 1.0) -> MicroLimits:
        """The run's limits (``cfg`` the whole config: the workload model reads ``model.path``'s shape)."""
        lc = cfg.learner
        hf = read_model_config(cfg.model.path)
        return cls(lc.micro_batch_size, lc.micro_batch_tokens, lc.no_grad_micro_batch_tokens, lc.logits_chunk_elements,
                   temperature, lc.packing, Workload.of_model(hf) if hf else Workload())

    def budget(self, batch: Batch, grad: bool) -> int:
        """Tokens one micro-batch may hold in a pass with (``grad``) or without a backward."""
        train = self.tokens or self.rows * int(seq_lengths(batch).max())
        return train if grad else (self.no_grad_tokens or 2 * train)


@dataclass(frozen=True)
class Micro:
    """One micro-batch of this rank."""

    rows: Tensor  # batch rows
    weight: float  # 1, or 0 for a filler that only keeps the ranks' collectives matched
    packed: bool  # run as one packed token stream (learner.packing)


def seq_lengths(batch: Batch) -> Tensor:
    """Tokens each row's forward processes: prompt + response ``[B]``."""
    return batch.prompt_lengths + batch.lengths


def read_rows(batch: Batch, rows: Tensor, model: str) -> Tensor:
    """The rows of ``rows`` some loss of ``model`` reads: not excluded; for the critic, not replayed either."""
    keep = ~batch.excluded[rows]
    if model == "critic":
        keep &= ~batch.is_replay[rows]
    return rows[keep]


def shares(mb: Tensor, batch: Batch, limits: MicroLimits, world: int) -> list[list[int]]:
    """Mini-batch ``mb``'s rows that any loss reads, dealt to ``world`` ranks (the same deal for every pass)."""
    rows = read_rows(batch, mb, "policy")
    return deal(seq_lengths(batch).tolist(), rows.tolist(), world, limits.work)


def micro_plan(mb: Tensor, batch: Batch, limits: MicroLimits, world: int, *, grad: bool,
               model: str) -> list[list[list[int]]]:
    """Every rank's micro-batches of mini-batch ``mb`` for one pass of ``model`` (row lists; [] = a filler)."""
    lengths = seq_lengths(batch).tolist()
    dealt = shares(mb, batch, limits, world)
    if model == "critic":
        skip = set(batch.is_replay.nonzero().flatten().tolist())
        dealt = [[r for r in s if r not in skip] for s in dealt]
    return cut_shares(dealt, lengths, limits.budget(batch, grad), limits.work, packed=limits.packed,
                      max_rows=0 if limits.packed else limits.rows)


def micro_batches(minibatches: list[Tensor], batch: Batch, limits: MicroLimits | int, *, grad: bool = True,
                  model: str = "policy") -> list[Micro]:
    """This rank's micro-batches over ``minibatches`` (the same count on every rank)."""
    lim = MicroLimits.of(limits)
    me, world = rank(), world_size()
    out: list[Micro] = []
    for mb in minibatches:
        for rows in micro_plan(mb, batch, lim, world, grad=grad, model=model)[me]:
            out.append(Micro(torch.tensor(rows, dtype=torch.long), 1.0, lim.packed) if rows
                       else Micro(_filler(batch, mb), 0.0, lim.packed))
    return out


def _filler(batch: Batch, mb: Tensor) -> Tensor:
    """The shortest row of ``mb`` (a filler's input: its loss is multiplied by 0)."""
    return mb[torch.argmin(seq_lengths(batch)[mb])].reshape(1)


def my_rows(minibatches: list[Tensor], batch: Batch, limits: MicroLimits | int) -> Tensor:
    """The rows this rank trains on (and needs values and advantages for)."""
    lim = MicroLimits.of(limits)
    mine = [r for mb in minibatches for r in shares(mb, batch, lim, world_size())[rank()]]
    return torch.tensor(sorted(mine), dtype=torch.long)


def as_minibatches(rows: Tensor | list[Tensor]) -> list[Tensor]:
    return [rows] if isinstance(rows, Tensor) else list(rows)


__all__ = ["critic_minibatch_rows", "minibatch_rows"]
