"""An engine's side of a distributed weight push, through SGLang's own API (``actors.sglang_client``).

- ``join_group(client, body)``: ``/init_weights_update_group`` with the body the learner's
  ``WeightPusher.open_group`` made for this engine (it blocks until every member has joined).
- ``receive_push(client, buckets, version, pause)``: one version, bucket by bucket, each
  ``/update_weights_from_distributed`` posted while the learner broadcasts that bucket
  (``load_format="flattened_bucket"``; ``weight_version`` only with the last bucket, so the engine's
  version moves when the whole version is in; ``flush_cache`` only there too). ``pause``:
  ``in_place`` (running requests keep their KV cache and continue on the new weights; SGLang refuses to
  flush the cache while they exist, so no flush is asked for) or ``retract`` (they are re-queued and
  recomputed; the cache is flushed) around the buckets, then ``/continue_generation``; ``abort`` aborts
  them first; ``none`` pauses nothing (SGLang then loads each bucket only once the running requests end:
  the drain this path exists to avoid).

A failure (the engine or the group died, a bucket refused) raises ``SGLangError``; the engine then serves
whatever it had (possibly a partial mix, as SGLang warns), so the caller must load the version from disk
before it generates again.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from actors.sglang_client import SGLangClient, SGLangError

PAUSE_MODES = ("in_place", "retract", "abort", "none")


@dataclass
class PushReport:
    """What one engine's side of a push took."""

    pause_s: float = 0.0  # generation paused: from /pause_generation sent to /continue_generation answered
    receive_s: float = 0.0  # the bucket posts, first sent to last answered


async def join_group(client: SGLangClient, body: dict[str, Any], timeout_s: float | None = None) -> str:
    return await client.init_weights_update_group(
        body["master_address"], body["master_port"], body["rank_offset"], body["world_size"],
        group_name=body.get("group_name", "weight_update_group"), backend=body.get("backend", "nccl"),
        timeout_s=timeout_s)


async def _post_buckets(client: SGLangClient, buckets: list[dict[str, Any]], version: int | str, flush: bool,
                        group_name: str, timeout_s: float | None) -> None:
    for i, b in enumerate(buckets):
        last = i == len(buckets) - 1
        await client.update_weights_from_distributed(
            b["names"], b["dtypes"], b["shapes"], weight_version=version if last else None,
            flush_cache=flush and last, load_format="flattened_bucket", group_name=group_name, timeout_s=timeout_s)


async def receive_push(client: SGLangClient, buckets: list[dict[str, Any]], version: int | str,
                       pause: str = "in_place", group_name: str = "weight_update_group",
                       timeout_s: float | None = None) -> PushReport:
    """Receive and load one pushed version (see the module docstring); SGLangError on any failure."""
    if pause not in PAUSE_MODES:
        raise ValueError(f"pause {pause!r}: one of {PAUSE_MODES}")
    rep = PushReport()
    t0 = time.perf_counter()
    if pause == "none":
        await _post_buckets(client, buckets, version, True, group_name, timeout_s)
        rep.receive_s = time.perf_counter() - t0
        return rep
    await client.pause_generation(pause)
    try:
        t1 = time.perf_counter()
        await _post_buckets(client, buckets, version, pause != "in_place", group_name, timeout_s)
        rep.receive_s = time.perf_counter() - t1
    finally:
        with contextlib.suppress(SGLangError):
            await client.continue_generation()
        rep.pause_s = time.perf_counter() - t0
    return rep


__all__ = ["PAUSE_MODES", "PushReport", "join_group", "receive_push"]
