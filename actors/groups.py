"""A worker's groups: one prompt through the engine into G verified, version-stamped samples, and what the
groups the buffer acknowledged came to.

``GroupMaker.make(index)`` asks the engine (through the worker's ``actors.engine_link.EngineLink``, whose
gate it waits on) for ``n = actors.group_size`` samples of the task's train prompt ``index`` with
``return_logprob``; an engine error is resubmitted after a back-off (the link is told: the engine may be
gone), a 4xx refusal skips the prompt, a group with an aborted sample (a weight update with
``actors.weight_sync = abort``) is generated again whole. The group's responses are scored together by the
task (``Task.verify_batch``; on a thread when ``Task.verify_blocks``, i.e. a reward pool's round trip, so the
loop keeps serving the engine, the buffer and the weights meanwhile); a failed reward call is counted
(``reward_errors`` by kind) and its reward function's extra figures are shown (``reward_extra``). Each sample
is stamped with the oldest weight version among its tokens (``actors.samples``). ``record`` counts a group
the buffer acknowledged in the maker's ``counts`` (``GroupCounts``, which the worker reads for its
``ACTOR DONE`` line) and metrics.

Not a CLI; used by ``actors.worker``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from actors.cursor import group_id_for
from actors.engine import Engine
from actors.report import GroupCounts
from actors.samples import engine_sample, has_behaviour_logprobs
from common.config import Config
from common.protocol import IngestAck, SampleGroup
from common.sglang_client import GenerateOutput, SGLangError
from common.tasks import Prompt, Task, Verdict, decode_response, encode_prompt

log = logging.getLogger("vapo.actors.worker")
# Label values an actor gives a series whose values come from users' data (reward_extra's figure names,
# data_source): a value per row would grow Prometheus without bound.
MAX_LABEL_VALUES = 32
OTHER_SOURCE = "other"  # data_source sources past the first MAX_LABEL_VALUES count under this


def bounded_label(seen: set[str], value: str) -> str | None:
    """``value`` if it is among ``seen`` or fits under ``MAX_LABEL_VALUES`` (then kept in ``seen``); else None."""
    if value in seen or len(seen) < MAX_LABEL_VALUES:
        seen.add(value)
        return value
    return None


class WorkerError(RuntimeError):
    """A condition the worker cannot recover from (engine restarts exhausted, bad engine output)."""


class ServedEngine(Protocol):
    """What a group maker needs of the engine link (``actors.engine_link.EngineLink`` is one)."""

    @property
    def gate(self) -> asyncio.Event:
        """Set while the engine accepts requests."""

    @property
    def client(self) -> Engine | None: ...

    @property
    def version(self) -> int:
        """The weight version the engine serves."""

    @property
    def owned(self) -> bool:
        """The engine is the worker's own child (it cannot lose our weights without our noticing)."""

    def report_trouble(self) -> None:
        """A request failed or came back on older weights: the link checks the engine."""


class GroupMaker:
    """One worker's prompts into groups (see the module docstring): ``link`` is the worker's engine link,
    ``tokenizer`` the model's (``common.modeling.load_tokenizer``); ``metric(name, **labels)`` this actor's
    series of ``vapo_actor_<name>``. It owns ``counts``, what its groups came to."""

    def __init__(self, cfg: Config, actor_id: int, task: Task, link: ServedEngine, tokenizer: Any,
                 metric: Callable[..., Any], *, generate_timeout_s: float) -> None:
        self.actors_cfg, self.actor_id, self.task = cfg.actors, actor_id, task
        self.link, self.tokenizer = link, tokenizer
        self.positive_reward = cfg.buffer.positive_reward
        self.counts, self.metric = GroupCounts(), metric
        self.generate_timeout_s = generate_timeout_s
        self.extra_names: set[str] = set()
        self.sources: set[str] = set()  # data_source labels given so far

    def record(self, group: SampleGroup, ack: IngestAck, resent: int) -> None:
        """Count a group the buffer acknowledged (``resent``: how many times it was sent again)."""
        rewards = [s.reward for s in group.samples]
        n_pos = sum(1 for r in rewards if r >= self.positive_reward)  # the buffer's and learner's test too
        tokens = sum(s.response_length for s in group.samples)
        self.counts.groups += 1
        self.counts.samples += len(rewards)
        self.counts.tokens += tokens
        self.counts.positives += n_pos
        self.counts.duplicates += int(bool(ack.duplicate))
        if ack.error:  # committed but never served: "stale" or "filtered:<why>"
            self.counts.not_served += 1
            self.metric("groups_not_served", reason=ack.error.split(":", 1)[0]).inc()
        self.metric("groups_sent").inc()
        self.metric("samples").inc(len(rewards))
        self.metric("tokens").inc(tokens)
        self.metric("reward_mean").set(sum(rewards) / len(rewards))
        self.metric("positives_rate").set(n_pos / len(rewards))
        if resent > 0:
            self.metric("groups_resent").inc(resent)

    async def make(self, index: int) -> SampleGroup | None:
        """G verified samples of the task's train prompt ``index``; None if the engine refuses the prompt."""
        prompt = self.task.train_prompt(index)
        ids = encode_prompt(self.tokenizer, prompt)
        sp: dict[str, Any] = {"n": self.actors_cfg.group_size, "temperature": self.actors_cfg.temperature, "top_p": self.actors_cfg.top_p,
                              "top_k": self.actors_cfg.top_k, "max_new_tokens": self.actors_cfg.max_new_tokens}
        failures = 0
        link = self.link
        while True:
            await link.gate.wait()
            client, v_before = link.client, link.version
            assert client is not None
            t0 = time.monotonic()
            try:
                outs = await client.generate(ids, sp, return_logprob=True, timeout_s=self.generate_timeout_s)
            except SGLangError as e:
                if e.status is not None and 400 <= e.status < 500:
                    log.error("actor %d: engine refused prompt %d (%s): %s; skipping it", self.actor_id, index,
                              prompt.prompt_id, e.message)
                    self.counts.skipped += 1
                    self.metric("prompts_skipped").inc()
                    return None
                failures += 1
                self.counts.resubmits += 1
                self.metric("resubmits", reason="engine_error").inc()
                link.report_trouble()
                if failures % 10 == 1:
                    log.warning("actor %d: generate failed (%s); will resubmit", self.actor_id, e)
                # Back off while the supervisor notices a dead engine (its exit or /health) and restarts it.
                await asyncio.sleep(min(0.05 * 2 ** min(failures, 6), 2.0))
                continue
            reported = [o.weight_version_int for o in outs if o.weight_version_int is not None]
            if not link.owned and reported and min(reported) < v_before:
                link.report_trouble()  # an engine we do not own lost our weights: re-sync (samples stay honest)
            if any(o.finish_reason == "abort" for o in outs):
                self.counts.resubmits += 1
                self.metric("resubmits", reason="abort").inc()
                continue  # aborted for a weight update: generate the whole group again on the new weights
            self.metric("generation_seconds").observe(time.monotonic() - t0)
            v_now = min(v_before, link.version)
            verdicts = await self._score(prompt, outs)
            samples = [engine_sample(ids, o, v_now, vd.reward) for o, vd in zip(outs, verdicts, strict=True)]
            self._by_source(prompt, [vd.reward for vd in verdicts])
            return SampleGroup(group_id=group_id_for(self.actor_id, index), prompt_id=prompt.prompt_id,
                               task=self.task.name, actor_id=self.actor_id, samples=samples, created_at=time.time())

    def _by_source(self, prompt: Prompt, rewards: list[float]) -> None:
        """A scored group's figures under its data_source (a dataset mixing sources is judged per source)."""
        source = bounded_label(self.sources, prompt.data_source or self.task.name) or OTHER_SOURCE
        self.sources.add(source)
        self.metric("source_samples", data_source=source).inc(len(rewards))
        self.metric("source_positives", data_source=source).inc(sum(r >= self.positive_reward for r in rewards))
        self.metric("source_reward_mean", data_source=source).set(sum(rewards) / len(rewards))

    async def _score(self, prompt: Prompt, outs: list[GenerateOutput]) -> list[Verdict]:
        """The task's verdicts on a group's responses, its reward errors and extra figures counted."""
        for o in outs:
            if not has_behaviour_logprobs(o):
                raise WorkerError(f"engine returned no or non-finite output logprobs (rid {o.rid}); behaviour logprobs are required")
        texts = [decode_response(self.tokenizer, o.output_ids) for o in outs]
        if self.task.verify_blocks(prompt):
            verdicts = await asyncio.to_thread(self.task.verify_batch, prompt, texts)
        else:
            verdicts = self.task.verify_batch(prompt, texts)
        extra: dict[str, list[float]] = {}
        for vd in verdicts:
            if vd.error:
                self.counts.reward_errors += 1
                self.metric("reward_errors", kind=vd.error).inc()
            for name, value in vd.extra.items():
                extra.setdefault(name, []).append(value)
        for name, values in extra.items():
            if bounded_label(self.extra_names, name) is not None:  # names past the bound are not shown
                self.metric("reward_extra", figure=name).set(sum(values) / len(values))
        return verdicts


__all__ = ["GroupMaker", "ServedEngine", "WorkerError"]
