"""The engine interface: what a rollout worker needs from its inference engine, and its two implementations.

``Engine`` is the one protocol the actor side (``actors.engine_link``, ``actors.weight_follower``,
``actors.engine_supervisor``, ``actors.weight_push_client``, ``actors.worker``) talks to an engine through:

- **generate**: ``generate`` (n samples per prompt with behaviour logprobs and per-token weight versions);
- **follow weights**: ``update_weights_from_disk``; the distributed push's ``init_weights_update_group``,
  ``begin_weight_update``, ``update_weights_from_distributed``, ``end_weight_update``,
  ``destroy_weights_update_group``; ``get_weight_version`` (the version the last successful update set)
  and ``served_weight_version`` (the version generation runs with now);
- **pause/continue**: ``pause_generation(mode)``, ``continue_generation``, ``flush_cache``;
- **health**: ``health`` (a liveness verdict), ``probe(updating)`` (one health-watch probe, valid while
  the caller updates the engine's weights), ``wait_healthy``.

Both implementations speak SGLang's native HTTP API through ``common.sglang_client.SGLangClient`` and differ
only where the real servers do (SGLang 0.5.23 as run by the ``sglang`` live tests, and
``actors.rollout_server``):

- ``SGLangEngine`` (``engine.kind = sglang`` and ``external``, and a rollout_server run with
  ``engine.imitate_sglang``): SGLang has no ``/get_weight_version``, and ``/model_info``'s version is the
  tokenizer manager's, which an update whose cache flush was refused does not move; the version the
  scheduler generates with is read from a one-token greedy generation's ``meta_info.weight_version``.
- ``RolloutServerEngine`` (a worker's own ``actors.rollout_server``): the served version is its
  ``/get_weight_version`` (the scheduler's own), without running a generation.

Common to both: ``/health`` cannot be trusted while the caller pauses or loads weights (SGLang's runs a
generation, which cannot run then; rollout_server answers 503 while paused), so ``probe(updating=True)``
asks ``/model_info``, which the HTTP front end answers throughout.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from common.sglang_client import GenerateOutput, SGLangClient, SGLangError


@runtime_checkable
class Engine(Protocol):
    """One inference engine as a rollout worker uses it (see the module docstring)."""

    kind: str  # "sglang" or "rollout_server": whose behaviour the implementation follows
    base_url: str

    async def generate(self, input_ids: list[list[int]] | list[int],
                       sampling_params: dict[str, Any] | list[dict[str, Any]], return_logprob: bool = True,
                       rid: str | list[str] | None = None, timeout_s: float | None = None) -> list[GenerateOutput]:
        """Samples for one prompt or a batch, prompt-major (``n`` per prompt)."""
        ...

    async def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,
                                       abort_all_requests: bool = False, load_format: str | None = None,
                                       timeout_s: float | None = None) -> str:
        """Load a weights directory as ``weight_version``; SGLangError on refusal."""
        ...

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl", timeout_s: float | None = None) -> str:
        """Join the learner's weight-update process group."""
        ...

    async def begin_weight_update(self, timeout_s: float | None = None) -> str:
        """Open the weight-update session a distributed update runs in."""
        ...

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              weight_version: int | str | None = None, flush_cache: bool = True,
                                              abort_all_requests: bool = False,
                                              load_format: str | None = "flattened_bucket",
                                              group_name: str = "weight_update_group",
                                              timeout_s: float | None = None) -> str:
        """Receive one broadcast bucket from the group's rank 0 and load it."""
        ...

    async def end_weight_update(self, timeout_s: float | None = None) -> str:
        """Close the weight-update session."""
        ...

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> str:
        """Leave a weight-update group."""
        ...

    async def pause_generation(self, mode: str = "abort") -> None:
        """Pause generation: ``abort``, ``retract`` or ``in_place``."""
        ...

    async def continue_generation(self) -> None:
        """Resume generation after ``pause_generation``."""
        ...

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; False when the engine refused because requests run or wait."""
        ...

    async def health(self, timeout_s: float = 30.0) -> bool:
        """True when the engine answers its health check within ``timeout_s``."""
        ...

    async def probe(self, updating: bool, timeout_s: float) -> bool:
        """One health-watch probe; ``updating``: the caller is pausing or loading the engine right now."""
        ...

    async def wait_healthy(self, timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        """Until ``health`` passes; SGLangError after ``timeout_s``."""
        ...

    async def get_weight_version(self) -> str | None:
        """The version the last successful update set."""
        ...

    async def served_weight_version(self, timeout_s: float | None = 60.0) -> str | None:
        """The version generation runs with now (the truth after an update that answered an error)."""
        ...

    async def close(self) -> None:
        """Release the connections."""
        ...


class _NativeEngine(SGLangClient):
    """What both implementations share: SGLang's native API, and the probe that holds during an update."""

    kind = ""

    async def probe(self, updating: bool, timeout_s: float) -> bool:
        if not updating:
            return await self.health(timeout_s)
        try:
            await self.model_info(timeout_s)
        except SGLangError:
            return False
        return True


class SGLangEngine(_NativeEngine):
    """A real SGLang server (or one imitating it): the served version comes from a one-token generation."""

    kind = "sglang"


class RolloutServerEngine(_NativeEngine):
    """vapo's own ``actors.rollout_server``: the served version is its ``/get_weight_version``."""

    kind = "rollout_server"

    async def served_weight_version(self, timeout_s: float | None = 60.0) -> str | None:
        return await self.get_weight_version_route(timeout_s)


def engine_class(kind: str, imitate_sglang: bool) -> type[SGLangEngine] | type[RolloutServerEngine]:
    """The implementation for ``engine.kind``: a rollout_server that imitates SGLang is treated as SGLang."""
    return RolloutServerEngine if kind == "rollout_server" and not imitate_sglang else SGLangEngine


__all__ = ["Engine", "RolloutServerEngine", "SGLangEngine", "engine_class"]
