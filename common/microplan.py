"""Balanced micro-batch plans: a mini-batch's rows dealt to the data-parallel ranks and cut into micro-batches
so that the ranks, which run every micro-batch in lockstep under ZeRO, wait for each other as little as possible.

    work = Workload.of_model(hf_config)                       # FLOPs of a row of n tokens: linear n + quadratic n^2
    shares = deal(lengths, rows, world, work)                 # one deal per mini-batch, shared by every pass
    plan = cut_shares(shares, lengths, budget, work)          # plan[rank][j]: rows of rank's j-th micro-batch
    lockstep(plan, lengths, work, packed=True)["over_ideal"]  # the step's cost over the perfectly balanced one

Not a CLI; pure Python and numpy, importing nothing outside ``common/``: the learner plans with it and the
balance estimate (``common.balance``, ``ops/launch.sh CONFIG --dry-run``) and ``ops/bench/plan.py`` measure the
same plan. ``lengths[i]`` is row i's tokens through a forward (prompt + response).

Under ZeRO-3 every layer's collectives hold the ranks in lockstep, so the j-th micro-batch of every rank costs
what the slowest rank's j-th costs. The plan therefore:

- deals a mini-batch's rows to the ranks by workload (longest first, each to the least-loaded rank: LPT);
- gives every rank the SAME number k of micro-batches: the fewest that keep each within the token budget
  (packed: the sum of its rows' tokens; padded: rows x the longest; a row longer than the budget goes alone),
  so no rank runs a filler while the others compute;
- cuts each rank's share into k micro-batches within the budget, ordered heaviest first on every rank, and
  aims them at a profile common to the ranks rather than at equal micro-batches within one rank: where one
  rank's longest row makes its first micro-batch heavy, the others fill their first one as far and lighten
  the rest (of that cut and the plain balanced one, LPT again, the one cheaper in lockstep is kept).

On paper.yaml's step (8,192 rows, 16 mini-batches, 48 ranks, 24,576-token budget) the lockstep cost is within
1.08 / 1.02 / 1.03 of the ideal at mean responses of 1,500 / 5,000 / 8,000 tokens (``ops/bench/plan.py``).

A rank with fewer rows than k gets empty micro-batches ``[]`` in its last slots (only when a mini-batch has
too few rows for the ranks: ``lockstep``'s ``filler_share``). Rows that no loss reads (a truncated response
under ``algo.truncated=mask``) are left out by the caller: ``rows`` are the rows to run.

``synthetic_lengths`` makes paper-scale rows: prompts ~ log-normal around 256 tokens, responses log-normal with
a given mean after capping at ``max_new_tokens`` (a response at the cap is truncated).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.gpu_memory import count_parameters

SIGMA = 1.0  # log-normal spread of synthetic response lengths (its log's standard deviation)
PROMPT_SIGMA = 0.3


@dataclass(frozen=True)
class Workload:
    """Cost of a forward of a row of n tokens: ``linear·n + quadratic·n²`` (causal attention is quadratic)."""

    linear: float = 1.0
    quadratic: float = 0.0

    def row(self, n: int) -> float:
        return self.linear * n + self.quadratic * n * n

    def micro(self, lens: Sequence[int], packed: bool) -> float:
        """A micro-batch's cost: packed, the sum of its rows'; padded, rows x the cost of the longest."""
        if not lens:
            return 0.0
        return sum(self.row(n) for n in lens) if packed else len(lens) * self.row(max(lens))

    @classmethod
    def of_model(cls, hf_config: dict[str, Any], model: str = "policy") -> Workload:
        """FLOPs of one forward from a HF ``config.json``: ``2·N`` a token (N: the ``model``'s parameters,
        ``common.gpu_memory.count_parameters``) and attention ``4·layers·q_dim`` a token per attended token,
        ``2·layers·q_dim·n²`` for a causal row of n tokens."""
        c = hf_config.get("text_config", hf_config)
        heads = int(c.get("num_attention_heads", 1))
        q_dim = heads * int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        return cls(2.0 * count_parameters(hf_config)[model], 2.0 * int(c["num_hidden_layers"]) * q_dim)


def tokens(lens: Sequence[int], packed: bool) -> int:
    """Tokens a micro-batch occupies: packed, the sum; padded, rows x the longest."""
    return (sum(lens) if packed else len(lens) * max(lens)) if lens else 0


def _longest_first(rows: Sequence[int], lengths: Sequence[int]) -> list[int]:
    return sorted(rows, key=lambda r: (-int(lengths[r]), r))


def deal(lengths: Sequence[int], rows: Sequence[int], world: int, work: Workload) -> list[list[int]]:
    """``rows`` dealt to ``world`` ranks: longest first, each to the rank with the least workload so far (then
    the fewest rows, then the lowest rank): deterministic. One deal per mini-batch serves every pass of the
    step (a rank needs values and advantages for the rows it trains)."""
    heap = [(0.0, 0, r) for r in range(world)]
    out: list[list[int]] = [[] for _ in range(world)]
    for row in _longest_first(rows, lengths):
        load, n, r = heapq.heappop(heap)
        out[r].append(row)
        heapq.heappush(heap, (load + work.row(int(lengths[row])), n + 1, r))
    return out


def _cut(share: list[int], lengths: Sequence[int], k: int, budget: int, work: Workload, packed: bool,
         max_rows: int, caps: Sequence[float] | None = None) -> list[list[int]] | None:
    """``share`` cut into ``k`` micro-batches within the token budget, rows longest first, heaviest micro-batch
    first; None when some row fits none of them. Without ``caps`` each row goes to the micro-batch it leaves
    least loaded (LPT); with ``caps`` (a workload per index, heaviest first) to the first one it still fits
    under its cap, else to the one it overshoots least. An empty micro-batch takes any row, and none is left
    empty while the rows last."""
    bins: list[list[int]] = [[] for _ in range(k)]
    load, used = [0.0] * k, [0] * k  # workload; tokens (packed: the sum; padded: rows x the longest)
    order = _longest_first(share, lengths)
    for i, row in enumerate(order):
        n = int(lengths[row])
        cost = work.row(n)
        best: tuple[tuple[float, float, int, int], float, int] | None = None  # (key, workload, tokens) after
        must_open = len(order) - i <= sum(1 for b in bins if not b)  # no micro-batch left empty while rows remain
        for b in range(k):
            rows_b = len(bins[b])
            if must_open and rows_b:
                continue
            if packed:
                after, tok = load[b] + cost, used[b] + n
            else:  # rows come longest first: a padded micro-batch's longest is its first row, its cost load / rows
                after = load[b] + load[b] / rows_b if rows_b else cost
                tok = used[b] + used[b] // rows_b if rows_b else n
                if rows_b and 0 < max_rows <= rows_b:
                    continue
            if rows_b and tok > budget:
                continue
            if caps is None:
                key = (0.0, after, rows_b, b)
            else:
                room = caps[b] - after
                key = (0.0, 0.0, 0, b) if room >= 0 else (1.0, -room, rows_b, b)
            if best is None or key < best[0]:
                best = (key, after, tok)
        if best is None:
            return None
        b = best[0][3]
        bins[b].append(row)
        load[b], used[b] = best[1], best[2]
    order = sorted(range(k), key=lambda b: (-load[b], bins[b][0] if bins[b] else math.inf))
    return [bins[b] for b in order]


def _fewest(share: list[int], lengths: Sequence[int], budget: int, packed: bool, max_rows: int) -> int:
    """A lower bound on the micro-batches ``share`` needs (0 for no rows)."""
    if not share:
        return 0
    lb = math.ceil(sum(int(lengths[r]) for r in share) / max(budget, 1))
    if not packed and max_rows > 0:
        lb = max(lb, math.ceil(len(share) / max_rows))
    return max(lb, 1)


def _water(shares: list[list[int]], lengths: Sequence[int], k: int, work: Workload) -> list[float]:
    """A target workload per index, heaviest first: the heaviest rank's total spread evenly over the k
    micro-batches, except that index j holds at least the j-th heaviest row of any rank (a row is not split)."""
    top = max(sum(work.row(int(lengths[i])) for i in s) for s in shares)
    rows = [sorted((work.row(int(lengths[i])) for i in s), reverse=True) for s in shares]
    caps: list[float] = []
    for j in range(k):
        floor = max((r[j] for r in rows if len(r) > j), default=0.0)
        caps.append(max(floor, (top - sum(caps)) / (k - j)))
    return caps


def _sorted_cut(share: list[int], lengths: Sequence[int], budget: int, max_rows: int) -> list[list[int]]:
    """The padded layout's cut of one share: rows longest first, a micro-batch grows while it has at most
    ``max_rows`` rows (> 0) and rows × its longest ≤ ``budget`` (a longer row goes alone), so that neighbours in
    length share a micro-batch and little of it is padding."""
    out: list[list[int]] = []
    for row in _longest_first(share, lengths):
        cur = out[-1] if out else None
        if cur and (max_rows <= 0 or len(cur) < max_rows) and (len(cur) + 1) * int(lengths[cur[0]]) <= budget:
            cur.append(row)
        else:
            out.append([row])
    return out


def _padded_shares(shares: list[list[int]], lengths: Sequence[int], budget: int, work: Workload,
                   max_rows: int) -> list[list[list[int]]]:
    """``cut_shares`` of the padded layout: each share's ``_sorted_cut``, the ranks with fewer micro-batches than
    the most splitting their costliest (halves of a sorted run stay sorted), empty slots only for a rank with fewer
    rows than that; heaviest first on every rank."""
    cuts = [_sorted_cut(share, lengths, budget, max_rows) for share in shares]
    k = max((len(c) for c in cuts), default=0)

    def cost(m: list[int]) -> float:
        return work.micro([int(lengths[i]) for i in m], packed=False)

    for c in cuts:
        while len(c) < k and any(len(m) > 1 for m in c):
            j = max((j for j in range(len(c)) if len(c[j]) > 1), key=lambda j: (cost(c[j]), -j))
            m = c.pop(j)
            c[j:j] = [m[: len(m) // 2], m[len(m) // 2:]]
        c.sort(key=lambda m: (-cost(m), m[0]))
        c.extend([] for _ in range(k - len(c)))
    return cuts


def cut_shares(shares: list[list[int]], lengths: Sequence[int], budget: int, work: Workload, packed: bool = True,
               max_rows: int = 0) -> list[list[list[int]]]:
    """Each rank's share cut into the same number k of micro-batches: the fewest (that the greedy cut finds)
    that keep every micro-batch within ``budget`` tokens (a row longer than it goes alone; ``max_rows`` > 0 caps rows, padded layout only),
    ordered heaviest first on every rank; a rank with fewer rows than k ends with empty lists. Padded
    (``packed=False``): ``_padded_shares``.

    Index j runs in lockstep on every rank, so the cut aims at a common profile rather than at equal micro-
    batches within a rank: where one rank's longest row makes its first micro-batch heavy, the others fill
    their first micro-batch as far and lighten the rest. Of the LPT cut and the cut toward that profile
    (``_water``, then toward the profile it reached) the one with the lower lockstep cost is kept."""
    if not packed:  # padding is the padded layout's cost: neighbours in length together, as its old planner did
        return _padded_shares(shares, lengths, budget, work, max_rows)
    max_rows = 0
    need = 0
    for share in shares:
        k = _fewest(share, lengths, budget, packed, max_rows)
        while k < len(share) and _cut(share, lengths, k, budget, work, packed, max_rows) is None:
            k += 1
        need = max(need, k)
    while True:  # a share that fits k micro-batches almost always fits more; step on in the rare case it does not
        cuts = [_cut(share, lengths, need, budget, work, packed, max_rows) for share in shares]
        if all(c is not None for c in cuts):
            break
        need += 1
    best = [c for c in cuts if c is not None]
    if need < 2:
        return best
    cost, caps = sum(slot_costs(best, lengths, work, packed)), _water(shares, lengths, need, work)
    for _ in range(3):
        tried = [_cut(share, lengths, need, budget, work, packed, max_rows, caps) for share in shares]
        if not all(c is not None for c in tried):
            break
        plan = [c for c in tried if c is not None]
        caps = slot_costs(plan, lengths, work, packed)
        if sum(caps) < cost:
            best, cost = plan, sum(caps)
    return best


def plan_step(lengths: Sequence[int], minibatches: Sequence[Sequence[int]], world: int, budget: int, work: Workload,
              packed: bool = True, max_rows: int = 0) -> list[list[list[int]]]:
    """Every rank's micro-batches over the step's ``minibatches``, mini-batch after mini-batch (each dealt and
    cut on its own; the same count on every rank, so index j is the same mini-batch on every rank)."""
    out: list[list[list[int]]] = [[] for _ in range(world)]
    for mb in minibatches:
        for r, slots in enumerate(cut_shares(deal(lengths, mb, world, work), lengths, budget, work, packed, max_rows)):
            out[r].extend(slots)
    return out


def slot_costs(plan: list[list[list[int]]], lengths: Sequence[int], work: Workload, packed: bool) -> list[float]:
    """Per index j: the most workload any rank's j-th micro-batch holds (what the lockstep makes every rank pay)."""
    slots = max((len(p) for p in plan), default=0)
    return [max(work.micro([int(lengths[i]) for i in p[j]], packed) if j < len(p) else 0.0 for p in plan)
            for j in range(slots)]


def lockstep(plan: list[list[list[int]]], lengths: Sequence[int], work: Workload, packed: bool) -> dict[str, float]:
    """The plan's cost in lockstep (sum over j of the slowest rank's j-th micro-batch), the ideal (the real
    tokens' total workload over the ranks), their ratio ``over_ideal``, ``slots`` per rank, ``padding_share``
    (padded layout: padding's share of the tokens run) and ``filler_share`` (empty slots' share of all slots)."""
    world = max(len(plan), 1)
    cost = float(sum(slot_costs(plan, lengths, work, packed)))
    micros = [[int(lengths[i]) for i in m] for p in plan for m in p]
    real = sum(work.row(n) for m in micros for n in m)
    run = sum(tokens(m, packed) for m in micros)
    slots = max((len(p) for p in plan), default=0)
    ideal = real / world
    return {"lockstep": cost, "ideal": ideal, "over_ideal": cost / ideal if ideal > 0 else 1.0, "slots": float(slots),
            "padding_share": 1.0 - sum(sum(m) for m in micros) / run if run else 0.0,
            "filler_share": sum(1 for m in micros if not m) / (world * slots) if slots else 0.0}


# ------------------------------------------------------------------------------------- synthetic lengths


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def capped_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for log X ~ N(mu, sigma²)."""
    lc = math.log(cap)
    return math.exp(mu + sigma * sigma / 2) * _phi((lc - mu - sigma * sigma) / sigma) + cap * (1 - _phi((lc - mu) / sigma))


def lognormal_mu(mean: float, sigma: float, cap: float) -> float:
    """The mu whose log-normal, capped at ``cap``, has mean ``mean`` (< cap) (bisection)."""
    if not 0 < mean < cap:
        raise ValueError(f"mean {mean} must be in (0, cap={cap})")
    lo, hi = math.log(mean) - 10 * sigma - 10, math.log(cap) + 10 * sigma + 10
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_mean(mid, sigma, cap) < mean else (lo, mid)
    return (lo + hi) / 2


def truncated_fraction(mu: float, sigma: float, cap: float) -> float:
    """P(X >= cap): the share of responses cut at the cap."""
    return 1.0 - _phi((math.log(cap) - mu) / sigma)


def sigma_for(mean: float, truncated: float, cap: float) -> float:
    """The spread at which responses of capped mean ``mean`` hit the cap ``truncated`` of the time (bisection;
    SIGMA when ``truncated`` is 0 or cannot be met)."""
    if truncated <= 0 or not 0 < mean < cap:
        return SIGMA

    def at(s: float) -> float:
        return truncated_fraction(lognormal_mu(mean, s, cap), s, cap)

    lo, hi = 0.05, 4.0
    if not at(lo) <= truncated <= at(hi):
        return SIGMA
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) < truncated else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Rows:
    """Synthetic rows: prompt and response tokens, and which responses hit the cap."""

    prompts: np.ndarray
    responses: np.ndarray
    truncated: np.ndarray
    mu: float
    sigma: float

    @property
    def lengths(self) -> list[int]:
        return [int(x) for x in self.prompts + self.responses]

    def params(self) -> dict[str, float]:
        """The distribution's parameters and what the draw gave."""
        return {"response_mu": round(self.mu, 4), "response_sigma": round(self.sigma, 4),
                "response_mean": round(float(self.responses.mean()), 1),
                "response_p50": float(np.median(self.responses)), "response_max": int(self.responses.max()),
                "truncated_fraction": round(float(self.truncated.mean()), 4),
                "prompt_mean": round(float(self.prompts.mean()), 1)}


def synthetic_lengths(n: int, mean: float, cap: int, sigma: float = SIGMA, prompt: float = 256.0,
                      seed: int = 0) -> Rows:
    """``n`` rows: prompts log-normal around ``prompt`` tokens (spread PROMPT_SIGMA), responses log-normal of
    spread ``sigma`` whose mean after capping at ``cap`` is ``mean``; deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    mu = lognormal_mu(mean, sigma, cap)
    responses = np.minimum(np.maximum(np.rint(rng.lognormal(mu, sigma, n)), 1), cap).astype(np.int64)
    pmu = math.log(max(prompt, 1.0)) - PROMPT_SIGMA ** 2 / 2
    prompts = np.maximum(np.rint(rng.lognormal(pmu, PROMPT_SIGMA, n)), 1).astype(np.int64)
    return Rows(prompts, responses, responses >= cap, mu, sigma)


def minibatches(n: int, mini_batches: int) -> list[list[int]]:
    """Rows 0..n-1 cut into ``mini_batches`` contiguous mini-batches (synthetic rows are already in random order)."""
    return [[int(i) for i in c] for c in np.array_split(np.arange(n), mini_batches) if len(c)]
