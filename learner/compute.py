"""What one learner step cost in token passes, for comparisons at equal total compute (not a CLI).

A token pass is one token through one model, forward or backward; a backward costs about twice a forward,
so ``ops.bench.compute_axes`` weighs them 1 and 2. Counted over the whole batch (every rank's rows
together), prompt and response tokens alike, padding not: what the step's phases ran, read from the phases
that were timed. Activation-checkpointing recomputation (one more forward per backward) is not counted,
the same for every method of a comparison.

- critic: the value pass (``values``), the critic update (``critic_update``: forward and backward per
  epoch), the post-update value pass (``fresh_values``);
- policy: the proximal pass (``proximal``), the actor update (``actor_update``: forward and backward per
  epoch; replayed positives included, they feed the NLL).

Value pretraining's critic passes are counted by ``learner.value_pretrain`` in its own records.
"""

from __future__ import annotations

from typing import Any

from learner.batch import Batch


def batch_tokens(batch: Batch) -> int:
    """Prompt + response tokens of every row (what one forward of the batch processes)."""
    return int((batch.prompt_lengths + batch.lengths).sum())


def step_token_passes(batch: Batch, phases: dict[str, float], epochs: int, value_pass: bool) -> dict[str, Any]:
    """``{policy,critic}_{forward,backward}_tokens`` of one step whose timed phases are ``phases`` (``values``
    is timed even when it computes no value: ``value_pass`` says whether it did), and the response tokens
    of its real (not replayed) rows: the generation the step trained on."""
    n = batch_tokens(batch)
    fwd_only = {"critic": int(value_pass) + int("fresh_values" in phases),
                "policy": int("proximal" in phases)}
    trained = {"critic": epochs if "critic_update" in phases else 0,
               "policy": epochs if "actor_update" in phases else 0}
    out: dict[str, Any] = {"response_tokens": int(batch.lengths[~batch.is_replay].sum())}
    for model in ("policy", "critic"):
        out[f"{model}_forward_tokens"] = n * (fwd_only[model] + trained[model])
        out[f"{model}_backward_tokens"] = n * trained[model]
    return out
