"""One rollout worker: prompts → G samples with behaviour logprobs → verified, version-stamped groups → buffer.

Launch: ``python -m actors [config.yaml] [key=value ...] --actor-id I`` (see ``actors.__main__``).

Per worker, on one asyncio loop:

- **Prompts** come from ``get_task(cfg.task).train_prompt(index)`` for this actor's shard
  ``index = actor_id + k·num_actors``; ``actors.cursor`` records which k are done under
  ``<run dir>/actors/cursor-<id>.json`` so a restart neither repeats nor skips a prompt.
- **Generation**: ``actors.prompts_in_flight`` loops each take one buffer credit (``AsyncGroupSender.acquire``,
  before generating, so a full buffer makes actors wait instead of producing groups that would be thrown
  away), wait until the engine serves the grant's learner version (the learner publishes a version before
  it asks for the batch the grant is for, but the grant can overtake the ``WeightUpdate``; a group started
  on older weights could be born stale), ask the engine for ``n = G`` samples of the prompt with
  ``return_logprob``, verify every response (``Task.verify`` on ``decode_response``), and send the
  ``SampleGroup`` (ack after the buffer's LMDB commit; ``group_id = a<actor>-p<index>``, so re-sends and
  re-generations are stored once).
- **Version stamp**: each sample carries the oldest weight version among its tokens (``GenerateOutput.
  min_weight_version``: rollout_server reports per-token versions; SGLang's ``meta_info.weight_version``
  otherwise); the group's version is the minimum over its samples.
- **Engine and weights** (``actors.engine_link.EngineLink``): starting or reaching the engine
  (``engine.kind``), restarting it (at most ``engine.max_restarts`` times, then the worker exits 1) or
  waiting for it, and loading each newer verified ``WeightUpdate`` (``actors.weight_sync``). Prompts wait
  while the link's gate is closed; those in flight when an engine died are generated again.
  ``/generate`` calls time out after ``actors.generate_timeout_s`` (0 = derived from
  ``actors.max_new_tokens``).

On start the worker prints ``ACTOR READY {json}`` and on exit ``ACTOR DONE {json}`` (counters) to stdout,
and keeps ``<run dir>/actors/worker-<id>.json`` (pids, engine URL, weight version) up to date.

Deviations: a group interrupted by an abort is regenerated whole (all G samples on the new weights) rather
than only its unfinished samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from actors.cursor import PromptCursor, group_id_for
from actors.engine_link import EngineLink, EngineLinkError, engine_url
from actors.rollout_server.process import EngineStartError
from actors.weight_sync import WeightWatcher
from buffer.client import AsyncGroupSender
from common.config import Config
from common.metrics import Metrics
from common.protocol import FINISH_REASONS, Sample, SampleGroup
from common.security import client_curve_keys
from common.sglang_client import GenerateOutput, SGLangError
from common.tasks import Prompt, decode_response, encode_prompt, get_task

log = logging.getLogger("vapo.actors.worker")
REPORT_EVERY_S = 10.0


def emit_tagged(tag: str, obj: dict[str, Any]) -> None:
    """Print ``TAG {json}`` as one write: sibling workers share their parent's stdout pipe, unbuffered under
    ``PYTHONUNBUFFERED``, where ``print``'s separate newline write lets two workers' lines run together."""
    sys.stdout.write(f"{tag} {json.dumps(obj)}\n")
    sys.stdout.flush()


class WorkerError(RuntimeError):
    """A condition the worker cannot recover from (engine restarts exhausted, bad engine output)."""


def generate_timeout_s(cfg: Config) -> float:
    """``actors.generate_timeout_s``, or with 0 the time a ``max_new_tokens`` generation needs at the
    slowest decode rate still counted as progress: a fixed constant would abandon (and resubmit, forever)
    every long generation."""
    a = cfg.actors
    return a.generate_timeout_s or a.generate_timeout_base_s + a.max_new_tokens / a.min_tokens_per_s


class RolloutWorker:
    def __init__(self, cfg: Config, actor_id: int) -> None:
        if not 0 <= actor_id < cfg.actors.num_actors:
            raise WorkerError(f"--actor-id {actor_id} outside [0, actors.num_actors={cfg.actors.num_actors})")
        self.cfg, self.actor_id = cfg, actor_id
        try:
            engine_url(cfg, actor_id)  # fail before any startup work when the engine address is missing
        except EngineLinkError as e:
            raise WorkerError(str(e)) from None
        if cfg.engine.kind == "rollout_server" and not (Path(cfg.model.path) / "config.json").is_file():
            raise WorkerError(f"model.path {cfg.model.path} is not an HF model directory (no config.json); "
                              "build the embedded base model with `python -m learner.sft [config]`")
        self.a = cfg.actors
        self.metrics = Metrics("actor")
        self.label = str(actor_id)
        self.state_dir = cfg.run_dir / "actors"
        self.link: EngineLink | None = None  # made in run(), with the weight watcher
        self.fatal: str | None = None
        self.metrics_port: int | None = None
        self.counts = {"groups": 0, "samples": 0, "tokens": 0, "positives": 0, "resubmits": 0, "engine_restarts": 0,
                       "weight_syncs": 0, "weight_sync_failures": 0, "skipped": 0, "duplicates": 0, "not_served": 0}
        self.credit_wait_s = 0.0
        self.weight_wait_s = 0.0
        self.generate_timeout_s = generate_timeout_s(cfg)
        self._version_changed = asyncio.Event()  # replaced (and the old one set) on every version change
        self.in_flight = 0
        self._started = time.monotonic()

    # ------------------------------------------------------------------ small helpers

    def _m(self, name: str, **labels: str) -> Any:
        return getattr(self.metrics, name).labels(actor=self.label, **labels)

    @property
    def version(self) -> int:
        """The weight version the engine serves (0 before it is reached)."""
        return self.link.version if self.link is not None else 0

    def _engine_changed(self) -> None:
        """The engine's served version moved (or a version was refused): record it, wake held prompts."""
        self._write_state()
        ev, self._version_changed = self._version_changed, asyncio.Event()
        ev.set()

    def _write_state(self) -> None:
        link = self.link
        state = {"actor_id": self.actor_id, "pid": os.getpid(), "engine_pid": link.pid if link else None,
                 "engine_url": link.url if link else None, "weight_version": self.version,
                 "model_path": link.model_path if link else self.cfg.model.path, "metrics_port": self.metrics_port}
        path = self.state_dir / f"worker-{self.actor_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)

    def stop(self) -> None:
        self._stop.set()

    def _fail(self, why: str) -> None:
        log.error("actor %d: %s", self.actor_id, why)
        self.fatal = self.fatal or why
        self._stop.set()

    def summary(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self._started
        link = self.link
        return {"actor_id": self.actor_id, **self.counts, "weight_version": self.version,
                "refused_versions": sorted(link.refused) if link else [], "prompts_done": self.cursor.completed,
                "credit_wait_s": round(self.credit_wait_s, 3), "weight_wait_s": round(self.weight_wait_s, 3),
                "elapsed_s": round(elapsed, 3),
                "weight_sync_latency_s": [round(x, 4) for x in link.sync_latencies] if link else [],
                "engine_pid": link.pid if link else None, "fatal": self.fatal}

    # ------------------------------------------------------------------ main

    async def run(self) -> int:
        """Run until stopped (SIGTERM/SIGINT), ``actors.max_prompts`` is reached, or a fatal error; exit code."""
        self._stop = asyncio.Event()
        self._all_done = asyncio.Event()  # actors.max_prompts prompts are done
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        cfg = self.cfg
        self.task = get_task(cfg.task)
        self.cursor = PromptCursor(self.state_dir / f"cursor-{self.actor_id}.json", self.actor_id,
                                   self.a.num_actors, limit=self.a.max_prompts)
        if self.cursor.finished():
            log.info("actor %d: all %d prompts of actors.max_prompts are done", self.actor_id, self.a.max_prompts)
            emit_tagged("ACTOR DONE", self.summary())
            return 0
        if cfg.metrics.prometheus:
            port = self.a.metrics_base_port + self.actor_id if self.a.metrics_base_port > 0 else 0
            try:
                self.metrics_port = self.metrics.serve(port, cfg.metrics.host)
            except OSError as e:
                raise WorkerError(f"cannot serve /metrics on {cfg.metrics.host}:{port}: {e}") from e
        for name in ("samples", "tokens", "groups_sent", "groups_resent", "credit_wait_seconds", "weight_wait_seconds",
                     "engine_restarts", "prompts_skipped", "weight_sync_seconds", "generation_seconds", "weight_version",
                     "samples_per_second", "prompts_in_flight"):
            self._m(name)  # every series exists (zero) from the start, so dashboards show it before the first event
        curve = client_curve_keys(cfg.buffer.curve, "actor")
        self.watcher = WeightWatcher(cfg.learner.publish_addr, cfg.learner.query_addr, curve=curve,
                                     poll_s=self.a.weight_poll_s, query_timeout_s=self.a.weight_query_timeout_s)
        self.sender = AsyncGroupSender(cfg.buffer.ingest_addr, self.actor_id, curve=curve,
                                       ack_timeout_s=self.a.send_timeout_s)
        self.link = link = EngineLink(cfg, self.actor_id, self.watcher, generate_timeout_s=self.generate_timeout_s,
                                      counts=self.counts, metric=self._m, on_change=self._engine_changed,
                                      on_fatal=self._fail, stopping=self._stop.is_set)
        tasks: list[asyncio.Task[Any]] = []
        try:
            await self.watcher.query()
            def tokenizer() -> Any:
                from common.modeling import load_tokenizer  # imported here: transformers loads in this thread

                return load_tokenizer(cfg.model.path)

            # The engine boots (seconds) while this process imports transformers for the tokenizer.
            self.tokenizer, _ = await asyncio.gather(asyncio.to_thread(tokenizer), link.connect())
            link.gate.set()
            emit_tagged("ACTOR READY", {"actor_id": self.actor_id, "pid": os.getpid(), "engine_url": link.url,
                                        "engine_pid": link.pid,
                                        "metrics_port": self.metrics_port, "weight_version": self.version,
                                        "prompts_done": self.cursor.completed})
            tasks = [loop.create_task(self.watcher.run(), name="weights"),
                     loop.create_task(link.sync_loop(), name="sync"),
                     loop.create_task(link.supervise(), name="supervise"),
                     loop.create_task(self._report_loop(), name="report"),
                     loop.create_task(link.watch_health(), name="health")]
            if cfg.learner.weight_transport == "distributed":  # the learner broadcasts; disk is the fallback
                from actors.weight_push_client import PushMember

                member = PushMember(link, cfg.learner.push_addr, self.a.push_pause, curve=curve)
                tasks.append(loop.create_task(member.run(), name="push"))
            n_core = len(tasks)
            self.watcher.changed.set()  # apply anything newer than what the engine started with
            prompts = [loop.create_task(self._prompt_loop(), name=f"prompt-{i}") for i in range(self.a.prompts_in_flight)]
            tasks += prompts
            if self.cursor.finished():
                self._all_done.set()
            waiters = {loop.create_task(self._stop.wait()), loop.create_task(self._all_done.wait())}
            pending = set(tasks)
            while not (self._stop.is_set() or self._all_done.is_set()):
                done, pending = await asyncio.wait(pending | waiters, return_when=asyncio.FIRST_COMPLETED)
                pending -= waiters
                for t in done - waiters:  # prompt loops return normally once the cursor is exhausted
                    exc = None if t.cancelled() else t.exception()
                    if exc is not None:
                        log.error("task %s failed", t.get_name(), exc_info=exc)
                        self._fail(f"task {t.get_name()} failed: {type(exc).__name__}: {exc}")
                    elif t in tasks[:n_core]:
                        self._fail(f"task {t.get_name()} ended unexpectedly")
            for w in waiters:
                w.cancel()
        except (WorkerError, EngineLinkError, EngineStartError, SGLangError) as e:
            self._fail(str(e))
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await self._shutdown()
        emit_tagged("ACTOR DONE", self.summary())
        return 1 if self.fatal else 0

    async def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            await self.sender.close()
        with contextlib.suppress(Exception):
            self.watcher.close()
        if self.link is not None:
            await self.link.close()

    # ------------------------------------------------------------------ prompts

    async def _prompt_loop(self) -> None:
        while not self._stop.is_set():
            if self.cursor.exhausted():
                return
            t0 = time.monotonic()
            grant = await self.sender.acquire(1)
            waited = time.monotonic() - t0
            self.credit_wait_s += waited
            self._m("credit_wait_seconds").inc(waited)
            await self._await_weights(grant.learner_version)
            k = self.cursor.take()
            if k is None:
                return  # the unused credit lapses after buffer.credit_ttl_s
            self.in_flight += 1
            self._m("prompts_in_flight").set(self.in_flight)
            try:
                group = await self._generate_group(k)
                if group is None:
                    self.cursor.complete(k)
                    if self.cursor.finished():
                        self._all_done.set()
                    continue
                resent = self.sender.resent
                ack = await self.sender.send(group)
                self.cursor.complete(k)
                self._record(group, ack, self.sender.resent - resent)
                if self.cursor.finished():
                    self._all_done.set()
            except BaseException:
                self.cursor.release(k)
                raise
            finally:
                self.in_flight -= 1
                self._m("prompts_in_flight").set(self.in_flight)
        return

    async def _await_weights(self, needed: int) -> None:
        """Hold a granted prompt until the engine serves weights ``>= needed`` (the grant's learner version).

        Only a version that has been announced and not refused is waited for (one that was never published,
        with ``learner.weights_every > 1``, is not), and never longer than ``actors.weight_wait_s``. A grant
        that overtook its ``WeightUpdate`` triggers an immediate ``WeightQuery`` rather than waiting for the
        next poll.
        """
        if self.version >= needed or self.a.weight_wait_s <= 0:
            return
        t0 = time.monotonic()
        latest = self.watcher.latest
        if latest is None or latest.version < needed:
            await self.watcher.query()  # the PUB message is on its way or was dropped: ask
            latest = self.watcher.latest
        if latest is None:
            return
        target = min(needed, latest.version)
        deadline = t0 + self.a.weight_wait_s
        # The sync loop loads only the newest announced update: while that one is refused, nothing moves.
        while self.version < target and self.watcher.latest.version not in self.link.refused:
            changed = self._version_changed
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("actor %d: still serving v%d %.0f s after a grant for learner v%d; generating anyway "
                            "(actors.weight_wait_s)", self.actor_id, self.version, self.a.weight_wait_s, needed)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)
        waited = time.monotonic() - t0
        self.weight_wait_s += waited
        self._m("weight_wait_seconds").inc(waited)

    def _record(self, group: SampleGroup, ack: Any, resent: int) -> None:
        rewards = [s.reward for s in group.samples]
        n_pos = sum(1 for r in rewards if r >= self.cfg.buffer.positive_reward)  # the buffer's and learner's test too
        tokens = sum(s.response_length for s in group.samples)
        self.counts["groups"] += 1
        self.counts["samples"] += len(rewards)
        self.counts["tokens"] += tokens
        self.counts["positives"] += n_pos
        self.counts["duplicates"] += int(bool(ack.duplicate))
        if ack.error:  # committed but never served: "stale" or "filtered:<why>"
            self.counts["not_served"] += 1
            self._m("groups_not_served", reason=ack.error.split(":", 1)[0]).inc()
        self._m("groups_sent").inc()
        self._m("samples").inc(len(rewards))
        self._m("tokens").inc(tokens)
        self._m("reward_mean").set(sum(rewards) / len(rewards))
        self._m("positives_rate").set(n_pos / len(rewards))
        if resent > 0:
            self._m("groups_resent").inc(resent)

    async def _generate_group(self, k: int) -> SampleGroup | None:
        """G verified samples of this actor's k-th prompt; None if the engine refuses the prompt."""
        index = self.cursor.index(k)
        prompt = self.task.train_prompt(index)
        ids = encode_prompt(self.tokenizer, prompt)
        sp: dict[str, Any] = {"n": self.a.group_size, "temperature": self.a.temperature, "top_p": self.a.top_p,
                              "top_k": self.a.top_k, "max_new_tokens": self.a.max_new_tokens}
        failures = 0
        link = self.link
        assert link is not None
        while True:
            await link.gate.wait()
            client, v_before = link.client, self.version
            assert client is not None
            t0 = time.monotonic()
            try:
                outs = await client.generate(ids, sp, return_logprob=True, timeout_s=self.generate_timeout_s)
            except SGLangError as e:
                if e.status is not None and 400 <= e.status < 500:
                    log.error("actor %d: engine refused prompt %d (%s): %s; skipping it", self.actor_id, index,
                              prompt.prompt_id, e.message)
                    self.counts["skipped"] += 1
                    self._m("prompts_skipped").inc()
                    return None
                failures += 1
                self.counts["resubmits"] += 1
                self._m("resubmits", reason="engine_error").inc()
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
                self.counts["resubmits"] += 1
                self._m("resubmits", reason="abort").inc()
                continue  # aborted for a weight update: generate the whole group again on the new weights
            self._m("generation_seconds").observe(time.monotonic() - t0)
            v_now = min(v_before, self.version)
            samples = [self._sample(prompt, ids, o, v_now) for o in outs]
            return SampleGroup(group_id=group_id_for(self.actor_id, index), prompt_id=prompt.prompt_id,
                               task=self.task.name, actor_id=self.actor_id, samples=samples, created_at=time.time())

    def _sample(self, prompt: Prompt, prompt_ids: list[int], o: GenerateOutput, fallback_version: int) -> Sample:
        if o.output_logprobs is None or any(not math.isfinite(x) for x in o.output_logprobs):
            raise WorkerError(f"engine returned no or non-finite output logprobs (rid {o.rid}); behaviour logprobs are required")
        version = o.weight_version_int
        if version is None:  # SGLang started without --weight-version: what this worker loaded
            version = fallback_version
        verdict = self.task.verify(prompt, decode_response(self.tokenizer, o.output_ids))
        spans = None
        if o.version_spans and len(o.version_spans) > 1 and min(v for v, _ in o.version_spans) == version:
            spans = np.asarray([x for pair in o.version_spans for x in pair], dtype=np.int64)  # tokens of several versions
        return Sample(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            output_ids=np.asarray(o.output_ids, dtype=np.int32),
            output_logprobs=np.asarray(o.output_logprobs, dtype=np.float32),
            reward=float(verdict.reward),
            finish_reason=o.finish_reason if o.finish_reason in FINISH_REASONS else "stop",
            weight_version=int(version),
            response_length=len(o.output_ids),
            version_spans=spans,
        )

    # ------------------------------------------------------------------ progress

    async def _report_loop(self) -> None:
        last_t, last_samples = time.monotonic(), 0
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            now = time.monotonic()
            rate = (self.counts["samples"] - last_samples) / max(now - last_t, 1e-9)
            last_t, last_samples = now, self.counts["samples"]
            self._m("samples_per_second").set(rate)
            log.info("actor %d: %d groups, %.1f samples/s, weights v%d, positives %.3f, in flight %d, restarts %d",
                     self.actor_id, self.counts["groups"], rate, self.version,
                     self.counts["positives"] / max(self.counts["samples"], 1), self.in_flight,
                     self.counts["engine_restarts"])


def run_worker(cfg: Config, actor_id: int) -> int:
    try:
        return asyncio.run(RolloutWorker(cfg, actor_id).run())
    except WorkerError as e:
        log.error("actor %d: %s", actor_id, e)
        return 1


__all__ = ["RolloutWorker", "WorkerError", "run_worker"]
