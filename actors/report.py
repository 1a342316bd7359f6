"""What a rollout worker reports: its ``ACTOR READY`` / ``ACTOR DONE`` lines on stdout, the counters of its
``ACTOR DONE`` line, and the metric series it shows from the start.

Not a CLI; used by ``actors.worker``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any


def emit_tagged(tag: str, obj: dict[str, Any]) -> None:
    """Print ``TAG {json}`` as one write: sibling workers share their parent's stdout pipe, unbuffered under
    ``PYTHONUNBUFFERED``, where ``print``'s separate newline write lets two workers' lines run together."""
    sys.stdout.write(f"{tag} {json.dumps(obj)}\n")
    sys.stdout.flush()


@dataclasses.dataclass
class GroupCounts:
    """What this worker's prompts came to, for its ``ACTOR DONE`` line (the engine link keeps its own)."""

    groups: int = 0
    samples: int = 0
    tokens: int = 0
    positives: int = 0
    resubmits: int = 0
    skipped: int = 0
    duplicates: int = 0
    not_served: int = 0
    reward_errors: int = 0  # reward calls that failed (scored 0) or were out of range (clipped), every kind


@dataclasses.dataclass
class LinkCounts:
    """What the engine link did, for the ``ACTOR DONE`` line (``EngineLink.counts`` gathers it from the
    parts that count: the supervisor its restarts, the weight follower its loads, refusals and pushes)."""

    engine_restarts: int = 0
    weight_loads: int = 0  # versions loaded from disk
    weight_sync_failures: int = 0  # versions refused (verification or the engine's load)
    weight_pushes: int = 0  # versions received by distributed push
    push_pause_ms: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by name; the push counters only once a push arrived (as they always appeared)."""
        out = dataclasses.asdict(self)
        if not self.weight_pushes:
            del out["weight_pushes"], out["push_pause_ms"]
        return out


# The counters on the ACTOR DONE line in the order they always had (the link's between the worker's own).
_DONE_ORDER = ("groups", "samples", "tokens", "positives", "resubmits", "engine_restarts", "weight_loads",
               "weight_sync_failures", "skipped", "duplicates", "not_served", "weight_pushes", "push_pause_ms",
               "reward_errors")
# Every series exists (zero) from the start, so dashboards show it before the first event.
ZEROED_METRICS = ("samples", "tokens", "groups_sent", "groups_resent", "credit_wait_seconds", "weight_wait_seconds",
                  "engine_restarts", "prompts_skipped", "weight_sync_seconds", "generation_seconds", "weight_version",
                  "samples_per_second", "prompts_in_flight")


def done_counters(counts: GroupCounts, link_counts: LinkCounts) -> dict[str, int]:
    """The worker's and its engine link's counters, in the ACTOR DONE line's order."""
    merged = {**dataclasses.asdict(counts), **link_counts.as_dict()}
    return {name: merged[name] for name in _DONE_ORDER if name in merged}


__all__ = ["ZEROED_METRICS", "GroupCounts", "LinkCounts", "done_counters", "emit_tagged"]
