"""The oracle critic (``algo.critic=oracle``): values from the chain task's own state, VAPO's ceiling.

At each state of a chain-task response the oracle knows how many step lines are left and whether the
response has already left the correct trace (one wrong line makes the answer wrong), and it cannot foresee
a slip: V(s_t) = p ** (step lines left) on an intact prefix, 0 after a mistake (``common.tasks.chain``).
p, the chance of writing a line right, is ``algo.oracle_line_accuracy`` or, at 0, the batch's own rate:
1 − first mistakes / (lines right before them + first mistakes), the policy's current slip rate.

The learner hands these values to the actor's advantages in place of the critic's; the critic still trains
and reports its explained variance beside the oracle's (``oracle_explained_variance``), so one run shows
how far the trainable critic is from the ceiling. Not a CLI.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from common.tasks.chain import correct_trace, line_outcome, lines_left
from learner.batch import Batch


class ChainOracle:
    """V(s_t) ``[B, T]`` of a batch of chain-task rows from their token ids."""

    def __init__(self, tokenizer: Any, line_accuracy: float = 0.0, sees_mistakes: bool = True) -> None:
        self.tokenizer = tokenizer
        self.line_accuracy = line_accuracy
        # False: the step-count-only baseline. Blind to mistakes, it knows no more at line j than at the start:
        # the response succeeds if all its lines are right, p^(step count), at every state.
        self.sees_mistakes = sees_mistakes
        self.eos = tokenizer.eos_token_id
        self._pieces: dict[int, str] = {}
        self.last_line_accuracy = line_accuracy

    def piece(self, token: int) -> str:
        if token not in self._pieces:
            self._pieces[token] = "" if token == self.eos else self.tokenizer.decode([token], skip_special_tokens=True)
        return self._pieces[token]

    def _rows(self, batch: Batch) -> list[tuple[str, list[str], bool]]:
        """(correct trace, text of each response token, whether the EOS came) per row."""
        out = []
        for b in range(batch.size):
            p, n = int(batch.prompt_lengths[b]), int(batch.lengths[b])
            prompt = self.tokenizer.decode(batch.input_ids[b, :p].tolist(), skip_special_tokens=True)
            ids = batch.response_ids[b, :n].tolist()
            out.append((correct_trace(prompt), [self.piece(t) for t in ids], self.eos in ids))
        return out

    def estimate_line_accuracy(self, rows: list[tuple[str, list[str], bool]]) -> float:
        right = mistakes = 0
        for trace, pieces, stopped in rows:
            text = "".join(pieces)
            r, m = line_outcome(trace, text, stopped)
            right, mistakes = right + r, mistakes + m
        return 1.0 - mistakes / max(right + mistakes, 1)

    def values(self, batch: Batch) -> Tensor:
        """Oracle V(s_t) for every real response token (0 on padding); replayed rows included."""
        rows = self._rows(batch)
        real = [row for row, replay in zip(rows, batch.is_replay.tolist(), strict=True) if not replay]
        p = self.line_accuracy if self.line_accuracy > 0 else self.estimate_line_accuracy(real or rows)
        self.last_line_accuracy = p
        out = torch.zeros(batch.mask.shape, dtype=torch.float32)
        for b, (trace, pieces, _) in enumerate(rows):
            if not self.sees_mistakes:  # success needs every line right, whichever are written: p^(all lines)
                out[b, : len(pieces)] = p ** lines_left(trace, 0)
                continue
            written = 0  # characters of the trace written so far, all of them right
            for t, piece in enumerate(pieces):
                out[b, t] = p ** lines_left(trace, written)  # = oracle_value(trace, prefix, p), in O(lines)
                if trace[written:written + len(piece)] != piece:
                    break  # left the trace: this and every later state is worth 0 (the zeros already there)
                written += len(piece)
        return out * batch.mask

    def stats(self, value_stats: dict[str, float]) -> dict[str, float]:
        """``Learner.value_stats`` of the oracle's values renamed, with the line accuracy they used."""
        return {"oracle_explained_variance": value_stats["value_explained_variance"],
                "oracle_value_mean": value_stats["value_mean"], "oracle_line_accuracy": self.last_line_accuracy}


__all__ = ["ChainOracle"]
