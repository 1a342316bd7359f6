"""The continuous-batching scheduler of ``actors.rollout_server`` (and of in-process generation,
``common.generation.passes``): one thread, one model, one KV cache.

One background thread owns the model and a ``ModelRunner`` with ``max_batch_size`` KV-cache slots. Requests
arriving from any thread join a waiting queue; at every step boundary the thread admits waiting sequences
into free slots (one batched, right-padded prefill), then runs one batched decode step for every running
sequence, samples (``sampling.sample``), and retires sequences that hit EOS, a stop token or
``max_new_tokens``. Finished slots are compacted (the last running sequence moves into the hole) so the
decode step always works on a contiguous ``[:B]`` view of the cache.

Weight updates (``update_weights``) are validated off the scheduler thread (``weights.LiveWeights``), then
copied into the live model between two decode steps: never in the middle of a forward. Like SGLang, an
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from common.generation.model_runner import ModelRunner
from common.generation.sampling import RequestError, SamplingParams, sample, short_repr
from common.generation.weights import LiveWeights

log = logging.getLogger("vapo.engine")

PAUSE_MODES = ("abort", "retract", "in_place")


class SchedulerBusy(RuntimeError):
    """The waiting queue holds too many tokens to take this request (the server answers 503)."""


@dataclass
class Sequence:
    """One sample being generated (a request with n > 1 or a batch becomes several)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Sequence], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    retractions: int = 0
    created: float = field(default_factory=time.time)
    finished_at: float = 0.0
    # Slot bookkeeping: how many positions of this sequence's KV are in the cache.
    cached_len: int = 0
    # Tokens this sequence counts against ``max_queued_tokens`` while it waits (prompt + max_new_tokens).
    cost: int = 0

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids



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
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        model_ctx = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        self.context_length = min(context_length, model_ctx) if context_length > 0 else model_ctx
        self.max_batch_size = max_batch_size
        self.runner = ModelRunner(model, max_batch_size, self.context_length, self.device, reseat=reseat_weights)
        self.weight_version = weight_version
        self.eos_token_ids = set(eos_token_ids or ())
        self.scaled_logprobs = scaled_logprobs
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queued_tokens = max_queued_tokens or 16 * max_batch_size * self.context_length
        self.queued_tokens = 0
        self.on_death = on_death
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.metrics = metrics
        self.weights = LiveWeights(model)

        self._cv = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._commands: deque[tuple[Callable[[], Any], cf.Future]] = deque()
        self.running: list[Sequence] = []  # index == KV slot; touched only by the scheduler thread
        self.paused: str | None = None
        self._pending_update: tuple[dict[str, torch.Tensor], str | None, cf.Future] | None = None
        self._stop = False
        self.steps = 0
        self.last_step_at = time.time()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()
        self._set_version_metric()

    # ------------------------------------------------------------------ public API (any thread)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def num_waiting(self) -> int:
        with self._cv:
            return len(self._waiting)

    def validate_prompt(self, ids: Any, params: SamplingParams) -> list[int]:
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids cannot be empty.")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("input_ids must be a list of integers or a list of lists of integers.")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise RequestError(f"The input_ids {short_repr(ids)} contains values greater than the vocab size ({self.vocab_size}).")
        if len(ids) >= self.context_length:
            raise RequestError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                               f"({self.context_length} tokens).")
        if params.max_new_tokens < 0:  # None: up to the context length
            params.max_new_tokens = self.context_length - len(ids)
        if len(ids) + params.max_new_tokens > self.context_length:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} tokens. "
                f"You requested a total of {len(ids) + params.max_new_tokens} tokens: {len(ids)} tokens from the "
                f"input messages and {params.max_new_tokens} tokens for the completion. Please reduce the number "
                f"of tokens in the input messages or the completion to fit within the limit.")
        return ids

    def admissible(self, cost: int) -> None:
        """Raise ``SchedulerBusy`` unless ``cost`` more queued tokens fit under ``max_queued_tokens``: callers
        check this before they build a request's sequences, so an oversized request allocates nothing."""
        if cost > self.max_queued_tokens:
            raise RequestError(f"The request needs {cost} tokens (prompts x n x (input + max_new_tokens)), more "
                               f"than the server queues at once ({self.max_queued_tokens}, --max-queued-tokens).")
        if self.queued_tokens + cost > self.max_queued_tokens:
            raise SchedulerBusy(f"The server is busy: {self.queued_tokens} tokens are queued and this request needs "
                             f"{cost} more (limit {self.max_queued_tokens}, --max-queued-tokens). Retry later.")

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
                    self._waiting.append(s)
                    self.queued_tokens += s.cost
            self._cv.notify_all()
        for s in done_now:
            s.finished_at = time.time()
            s.on_done(s)

    def call(self, fn: Callable[[], Any]) -> cf.Future:
        """Run ``fn`` on the scheduler thread at the next step boundary."""
        fut: cf.Future = cf.Future()
        with self._cv:
            self._commands.append((fn, fut))
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
        requests to finish (new ones wait behind it); while paused it applies at once.
        """
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

        def arm() -> None:
            if self._pending_update is not None:
                self._pending_update[2].set_result((False, "Superseded by a newer weight update."))
            self._pending_update = (sd, weight_version, fut)

        self.call(arm)
        return fut

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ scheduler thread

    def _apply_update(self) -> None:
        assert self._pending_update is not None
        sd, version, fut = self._pending_update
        self._pending_update = None
        self.weights.install(sd)
        if version is not None:
            self.weight_version = version
        self._set_version_metric()
        msg = "Succeeded to update model weights."
        fut.set_result((True, msg))
        log.info("weights updated (version %s)", self.weight_version)

    def _set_version_metric(self) -> None:
        if self.metrics is not None:
            try:
                self.metrics.weight_version.set(float(self.weight_version))
            except ValueError:
                pass

    def _abort(self, rids: set[str] | None, message: str, prefix: str | None = None) -> int:
        def hit_by(s: Sequence) -> bool:
            if prefix is not None:
                return s.rid.startswith(prefix)
            return rids is None or s.rid in rids

        hit = 0
        with self._cv:
            keep: deque[Sequence] = deque()
            for s in self._waiting:
                if hit_by(s):
                    s.finish = {"type": "abort", "message": message, "status_code": None, "err_type": None}
                    self.queued_tokens -= s.cost
                    self._done(s)
                    hit += 1
                else:
                    keep.append(s)
            self._waiting = keep
        gone = {i for i, s in enumerate(self.running) if hit_by(s)}
        for i in gone:
            self.running[i].finish = {"type": "abort", "message": message, "status_code": None, "err_type": None}
            self._done(self.running[i])
        self._compact(gone)
        return hit + len(gone)

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(None, "Aborted by pause_generation.")
        elif mode == "retract":
            with self._cv:
                for s in reversed(self.running):
                    s.retractions += 1
                    s.cached_len = 0
                    self._waiting.appendleft(s)
                    self.queued_tokens += s.cost
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

    def _admission_blocked(self) -> bool:
        return self.paused is not None or self._pending_update is not None

    def _has_work(self) -> bool:
        if self._commands:
            return True
        if self._pending_update is not None and (self.paused is not None or not self.running):
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
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut in commands:
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # report to the caller, keep serving
                        fut.set_exception(e)
                if self._pending_update is not None and (self.paused is not None or not self.running):
                    self._apply_update()
                if self.paused is None:
                    with torch.inference_mode():
                        self._step()
        except BaseException as e:  # the server reports unhealthy; every caller gets an answer
            self.error = e
            log.exception("engine thread died")
            with self._cv:
                pending = self.running + list(self._waiting)
                self._waiting.clear()
                self.queued_tokens = 0
                commands = list(self._commands)
                self._commands.clear()
            self.running = []
            for s in pending:
                s.finish = {"type": "abort", "message": f"engine error: {e}", "status_code": 500, "err_type": None}
                self._done(s)
            for _, fut in commands:
                fut.set_exception(RuntimeError(f"engine died: {e}"))
            if self._pending_update is not None:
                self._pending_update[2].set_result((False, f"engine died: {e}"))
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
                wait_until = self._waiting[0].created + self.batch_wait_s
                while time.time() < wait_until and len(self._waiting) < self.max_batch_size and not self._commands:
                    self._cv.wait(timeout=max(0.0, wait_until - time.time()))
            free = self.max_batch_size - len(self.running)
            batch: list[Sequence] = []
            tokens = 0
            while self._waiting and len(batch) < free:
                ctx = len(self._waiting[0].prompt_ids) + len(self._waiting[0].output_ids)
                if batch and tokens + ctx > self.max_prefill_tokens:
                    break
                s = self._waiting.popleft()
                self.queued_tokens -= s.cost
                batch.append(s)
                tokens += ctx
            return batch

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
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            p = s.params
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                s.finish = {"type": "stop", "matched": tok}
            elif len(s.output_ids) >= p.max_new_tokens or s.cached_len >= self.context_length:
                s.finish = {"type": "length", "length": len(s.output_ids)}
            if s.finish is not None:
                finished.add(start + j)
        if self.metrics is not None:
            self.metrics.generated_tokens.inc(len(seqs))


def new_rid() -> str:
    return uuid.uuid4().hex
