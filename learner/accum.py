"""Statistics summed over micro-batches and data-parallel ranks (not a CLI): token-weighted means, plain
totals and maxima, reduced in one collective per kind at the end of a phase (``learner.update``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from learner.dist import all_reduce_sum, world_size


@dataclass
class Accum:
    """Token-weighted sums of statistics, all-reduced at the end of a phase."""

    sums: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: float, weight: float = 1.0) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value) * weight
        self.sums[name + "/w"] = self.sums.get(name + "/w", 0.0) + weight

    def peak(self, name: str, value: float) -> None:
        """A maximum over micro-batches and ranks (reported as 0 when no rank saw a value)."""
        self.peaks[name] = max(self.peaks.get(name, 0.0), float(value))

    def total(self, name: str, value: float) -> None:
        """A plain sum over micro-batches and ranks."""
        self.totals[name] = self.totals.get(name, 0.0) + float(value)

    def reduce(self) -> dict[str, float]:
        keys = sorted(k for k in self.sums if not k.endswith("/w"))
        rows = [[self.sums[k], self.sums[k + "/w"]] for k in keys] + [[self.totals[k], 1.0] for k in sorted(self.totals)]
        vec = all_reduce_sum(torch.tensor(rows or [[0.0, 0.0]], dtype=torch.float64))
        out = {k: float(vec[i, 0] / vec[i, 1]) if vec[i, 1] > 0 else 0.0 for i, k in enumerate(keys)}
        out.update({k: float(vec[len(keys) + i, 0]) for i, k in enumerate(sorted(self.totals))})
        if self.peaks:  # the same names on every rank (the caller declares them unconditionally)
            names = sorted(self.peaks)
            top = torch.tensor([self.peaks[k] for k in names], dtype=torch.float64)
            if world_size() > 1:
                torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
            out.update({k: float(top[i]) for i, k in enumerate(names)})
        return out
