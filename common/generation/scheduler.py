"""The continuous-batching scheduler of ``actors.rollout_server`` (and of in-process generation,
``common.generation.passes``): one thread, one model, one KV cache.

One background thread owns the model and a ``ModelRunner`` with ``max_batch_size`` KV-cache slots. Requests
arriving from any thread join a waiting queue (``waiting.WaitQueue``); at every step boundary the thread admits waiting sequences
into free slots (one batched, right-padded prefill), then runs one batched decode step for every running
sequence, samples (``sampling.sample``), and retires sequences that hit EOS, a stop token or
``max_new_tokens``. Finished slots are compacted (the last running sequence moves into the hole) so the
decode step always works on a contiguous ``[:B]`` view of the cache.

Weight updates (``update_weights``) are validated off the scheduler thread (``weights.LiveWeights``), then
copied into the live model (``weights.WeightUpdates``) between two decode steps: never in the middle of a forward. Like SGLang, an
update waits for the running requests to finish on the old weights unless generation is paused
(``pause("in_place" | "retract")``), in which case it applies at once and the paused requests continue on
the new weights; every output token records the weight version that produced it.

``common.generation.passes.generate_batch(model, jobs, ...)`` runs a private scheduler over a model to
completion and returns the outputs: in-process generation (``learner.evaluate``) through the same decode loop
the server uses.

Deviations from SGLang: no radix/prefix cache (``flush_cache`` only checks that the scheduler is idle), no
chunked prefill, no streaming, no stop strings, no penalties.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from common.generation.model_runner import ModelRunner, hf_config
from common.generation.sampling import RequestError, SamplingParams, sample, validate_prompt
from common.generation.waiting import Commands, SchedulerBusy, Sequence, WaitQueue, aborted
from common.generation.weights import LiveWeights, WeightUpdates

# The waiting queue's types are part of this module's interface (the server and in-process generation).
__all__ = ["PAUSE_MODES", "Scheduler", "SchedulerBusy", "Sequence", "new_rid"]

log = logging.getLogger("vapo.engine")

PAUSE_MODES = ("abort", "retract", "in_place")


class Scheduler:
    """Continuous batching over one model on a thread of its own; thread-safe ``submit`` / control calls."""

    def __init__(self, model: torch.nn.Module, *, max_batch_size: int = 256, context_length: int = 0,
                 weight_version: str = "default", eos_token_ids: set[int] | None = None, seed: int = 0,
                 scaled_logprobs: bool = False, batch_wait_ms: float = 0.0, metrics: Any = None,
                 max_prefill_tokens: int = 16384, max_queued_tokens: int = 0,
                 on_death: Callable[[BaseException], None] | None = None, reseat_weights: bool = True) -> None:
        """``max_queued_tokens``: most prompt + max_new_tokens tokens waiting for a slot (0 = 16 x slots x
        context length); past it ``submit`` raises ``SchedulerBusy``. ``on_death``: called (scheduler thread)
        with the exception when the scheduler thread dies, so the server can exit instead of answering 503 forever.
        ``reseat_weights``: see ``ModelRunner`` (False leaves the model's parameters where they are)."""
        self.model = model.eval()
        self.device = next(model.parameters()).device
        cfg = hf_config(model)
        self.vocab_size = int(cfg.vocab_size)
        model_ctx = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        self.context_length = min(context_length, model_ctx) if context_length > 0 else model_ctx
        self.max_batch_size = max_batch_size
        self.runner = ModelRunner(model, max_batch_size, self.context_length, self.device, reseat=reseat_weights)
        self.eos_token_ids = set(eos_token_ids or ())
        self.scaled_logprobs = scaled_logprobs
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.max_prefill_tokens = max_prefill_tokens
        self._waiting = WaitQueue(max_queued_tokens or 16 * max_batch_size * self.context_length)
        self.on_death = on_death
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.metrics = metrics
        self.weights = LiveWeights(model)
        self.updates = WeightUpdates(self.weights, weight_version, metrics)

        self._cv = threading.Condition()
        self._commands = Commands()
        self.running: list[Sequence] = []  # index == KV slot; touched only by the scheduler thread
        self.paused: str | None = None
        self._stop = False
        self.steps = 0
        self.last_step_at = time.time()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API (any thread)

    @property
    def weight_version(self) -> str:
        """The version of the weights being served (each output token records the one that produced it)."""
        return self.updates.version

    @property
    def max_queued_tokens(self) -> int:
        return self._waiting.max_queued_tokens

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def num_waiting(self) -> int:
        with self._cv:
            return len(self._waiting)

    def validate_prompt(self, ids: Any, params: SamplingParams) -> list[int]:
        return validate_prompt(ids, params, self.vocab_size, self.context_length)

    def admissible(self, cost: int) -> None:
        """Raise ``SchedulerBusy`` unless ``cost`` more queued tokens fit under ``max_queued_tokens``: callers
        check this before they build a request's sequences, so an oversized request allocates nothing."""
        self._waiting.admissible(cost)

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences; each one's ``on_done`` is called from the scheduler thread when it finishes.
        Raises ``SchedulerBusy`` when they would push the queue past ``max_queued_tokens``."""
        if not self.alive:
            raise RuntimeError("engine is not running")
        done_now = []
        with self._cv:
            for s in seqs:
                s.cost = len(s.prompt_ids) + max(s.params.max_new_tokens, 0)
            self.admissible(sum(s.cost for s in seqs))
            for s in seqs:
                if s.params.max_new_tokens == 0:  # prefill-only in SGLang; nothing to generate here
                    s.finish = {"type": "length", "length": 0}
                    done_now.append(s)
                else:
                    self._waiting.push(s)
            self._cv.notify_all()
        for s in done_now:
            s.finished_at = time.time()
            s.on_done(s)

    def call(self, fn: Callable[[], Any]) -> cf.Future:
        """Run ``fn`` on the scheduler thread at the next step boundary."""
        with self._cv:
            fut = self._commands.put(fn)
            self._cv.notify_all()
        return fut

    def abort(self, rids: set[str] | None, message: str = "Aborted by request.", prefix: str | None = None) -> cf.Future:
        """Abort the given request ids (None = all; or those starting with ``prefix``, as SGLang matches a
        batch rid): they finish with finish_reason abort. The future resolves to how many were aborted."""
        return self.call(lambda: self._abort(rids, message, prefix))

    def pause(self, mode: str) -> cf.Future:
        if mode not in PAUSE_MODES:
            raise RequestError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        return self.call(lambda: self._pause(mode))

    def resume(self) -> cf.Future:
        return self.call(self._resume)

    def flush_cache(self) -> cf.Future:
        """SGLang refuses to flush while requests run or wait; there is no prefix cache to drop here."""
        return self.call(lambda: not self.running and not self._waiting)

    def update_weights(self, model_path: str, weight_version: str | None) -> cf.Future:
        """Validate a safetensors checkpoint now (caller's thread), apply it between decode steps.

        The future resolves to (success, message). While generation runs, the update waits for the running
        requests to finish (new ones wait behind it); while paused it applies at once."""
        try:
            sd = self.weights.read(model_path)
        except Exception as e:
            fut: cf.Future = cf.Future()
            fut.set_result((False, f"Failed to update weights: {e}."))
            return fut
        return self.apply_weights(sd, weight_version)

    def read_weights(self, model_path: str) -> dict[str, torch.Tensor]:
        """Read and validate a checkpoint (caller's thread); raises on any problem. ``apply_weights`` then
        installs it: a caller that gave up waiting for the read simply never applies it."""
        return self.weights.read(model_path)

    def apply_weights(self, sd: dict[str, torch.Tensor], weight_version: str | None) -> cf.Future:
        """Install validated weights between decode steps; the future resolves to (success, message)."""
        fut: cf.Future = cf.Future()
        self.call(lambda: self.updates.arm(sd, weight_version, fut))
        return fut

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ scheduler thread

    def _abort(self, rids: set[str] | None, message: str, prefix: str | None = None) -> int:
        def hit_by(s: Sequence) -> bool:
            return s.rid.startswith(prefix) if prefix is not None else rids is None or s.rid in rids

        with self._cv:
            waiting = self._waiting.remove(hit_by)
            for s in waiting:
                s.finish = aborted(message)
                self._done(s)
        gone = {i for i, s in enumerate(self.running) if hit_by(s)}
        for i in gone:
            self.running[i].finish = aborted(message)
            self._done(self.running[i])
        self._compact(gone)
        return len(waiting) + len(gone)

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(None, "Aborted by pause_generation.")
        elif mode == "retract":
            with self._cv:
                self._waiting.retract(self.running)
            self.running = []
        self.paused = mode

    def _resume(self) -> None:
        self.paused = None

    def _done(self, s: Sequence) -> None:
        s.finished_at = time.time()
        if self.metrics is not None:
            self.metrics.requests.labels(status=s.finish["type"] if s.finish else "unknown").inc()
        try:
            s.on_done(s)
        except Exception:  # a callback must never kill the scheduler
            log.exception("on_done callback failed")

    def _compact(self, finished: set[int]) -> None:
        for idx in sorted(finished, reverse=True):
            last = len(self.running) - 1
            if idx != last:
                moved = self.running[last]
                self.runner.move(last, idx, moved.cached_len)
                self.running[idx] = moved
            self.running.pop()

    def _update_due(self) -> bool:
        """A weight update waits and may go in now: generation is paused or nothing runs."""
        return self.updates.pending is not None and (self.paused is not None or not self.running)

    def _admission_blocked(self) -> bool:
        return self.paused is not None or self.updates.pending is not None

    def _has_work(self) -> bool:
        if self._commands:
            return True
        if self._update_due():
            return True
        if self.paused is not None:
            return False
        return bool(self.running) or (bool(self._waiting) and not self._admission_blocked())

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._has_work():
                        self._cv.wait()
                    if self._stop:
                        break
                    commands = self._commands.take()
                Commands.run(commands)
                if self._update_due():
                    self.updates.apply()
                if self.paused is None:
                    with torch.inference_mode():
                        self._step()
        except BaseException as e:  # the server reports unhealthy; every caller gets an answer
            self.error = e
            log.exception("engine thread died")
            with self._cv:
                pending = self.running + self._waiting.drain()
                commands = self._commands.take()
            self.running = []
            for s in pending:
                s.finish = aborted(f"engine error: {e}", 500)
                self._done(s)
            for _, fut in commands:
                fut.set_exception(RuntimeError(f"engine died: {e}"))
            self.updates.fail(f"engine died: {e}")
            if self.on_death is not None:
                try:
                    self.on_death(e)
                except Exception:
                    log.exception("on_death callback failed")

    def _admit(self) -> list[Sequence]:
        with self._cv:
            if self._admission_blocked() or not self._waiting:
                return []
            if not self.running and self.batch_wait_s > 0:
                # Idle: give concurrent requests a moment to arrive so they share the first prefill.
                wait_until = self._waiting.first().created + self.batch_wait_s
                while time.time() < wait_until and len(self._waiting) < self.max_batch_size and not self._commands:
                    self._cv.wait(timeout=max(0.0, wait_until - time.time()))
            return self._waiting.take(self.max_batch_size - len(self.running), self.max_prefill_tokens)

    def _step(self) -> None:
        t0 = time.perf_counter()
        new = self._admit()
        finished: set[int] = set()
        if new:
            slot0 = len(self.running)
            contexts = [s.context for s in new]
            self.running.extend(new)  # before the forward, so a failure still answers them
            logits = self.runner.prefill(slot0, contexts)
            for s, c in zip(new, contexts, strict=True):
                s.cached_len = len(c)
            self._append(slot0, logits, finished)
        # Decode every running sequence that did not just get its token from the prefill.
        decode_upto = len(self.running) if not new else slot0
        if decode_upto > 0:
            seqs = self.running[:decode_upto]
            logits = self.runner.decode([s.output_ids[-1] for s in seqs], [s.cached_len for s in seqs])
            for s in seqs:
                s.cached_len += 1
            self._append(0, logits, finished, upto=decode_upto)
        for i in finished:
            self._done(self.running[i])
        self._compact(finished)
        self.steps += 1
        self.last_step_at = time.time()
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(self.running) + len(finished))
            self.metrics.running_sequences.set(len(self.running))
            self.metrics.queued_sequences.set(len(self._waiting))
            self.metrics.step_seconds.observe(time.perf_counter() - t0)

    def _append(self, start: int, logits: torch.Tensor, finished: set[int], upto: int | None = None) -> None:
        seqs = self.running[start:upto if upto is not None else len(self.running)]
        toks, lps = sample(logits, [s.params for s in seqs], self.generator, self.scaled_logprobs)
        version = self.weight_version
        for j, (s, tok, lp) in enumerate(zip(seqs, toks, lps, strict=True)):
            if s.record(tok, lp, version, self.eos_token_ids, self.context_length):
                finished.add(start + j)
        if self.metrics is not None:
            self.metrics.generated_tokens.inc(len(seqs))


def new_rid() -> str:
    return uuid.uuid4().hex
