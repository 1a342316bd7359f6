"""rollout_server: a small real inference engine that serves SGLang's native HTTP API (CPU, or CUDA).

    python -m actors.rollout_server --model-path ops/bases/addition-tiny --port 30000 [--device cpu]

The rollout engine of ``engine.kind = rollout_server`` (config section ``engine``): each actor starts one
(``process.RolloutServerProcess``) and talks to it exactly as it talks to SGLang. Modules:
``__main__`` (command line, ready line), ``http`` (SGLang-shaped requests and responses), ``body`` (request
bodies within limits, error shapes), ``guard`` (admin API key, body census before parsing), ``control``
(weight load from disk, pause, continue, flush, abort), ``dist_update`` (SGLang's weight-update group, its
begin/end session and ``/update_weights_from_distributed`` over gloo), ``process`` (a worker's child server). The generation core
it serves with is shared with in-process evaluation and lives in ``common.generation``: ``scheduler``
(continuous batching on one thread), ``model_runner`` (KV-cache prefill/decode of Llama-style HF models),
``sampling`` (parameters, token sampler), ``weights`` (checkpoint reading and checks for weight updates).

``--imitate-sglang`` (test mode, ``engine.imitate_sglang``): behave as the released SGLang 0.5.23 does where
it differs: ``/health`` is ``/health_generate`` (a one-token generation polled once a second, 503 after
SGLANG_HEALTH_CHECK_TIMEOUT, blocked while paused or loading weights); after a completed load the cache
flush is refused while requests run or wait (always with ``--refuse-flush``) and the update answers 400
with the new weights live and ``/model_info``'s version unmoved (from disk, and on a distributed update
with ``flush_cache``); outputs carry ``meta_info.weight_versions``
(``[{"version", "start", "end"}]``); ``/metrics`` only with ``--enable-metrics``; no ``/get_weight_version``.
If the scheduler thread dies, the process exits with code 1 (its supervisor restarts it) instead of
answering 503 forever.

Deviations from SGLang, on purpose:
- Output logprobs default to log_softmax(logits) at temperature 1 (``--logprobs original``), what the
  learner recomputes; SGLang returns that only with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` and otherwise the
  temperature-scaled log_softmax(logits / T) (``--logprobs scaled``). At temperature 1 both agree.
- ``meta_info.output_weight_version_spans`` (extension, ``[[version, n_tokens], ...]`` in token order) says
  which weights produced each output token, so a request that straddled an in-place weight update can be
  stamped with the oldest version;
  ``meta_info.weight_version`` keeps SGLang's meaning (the version served when the response was built).
- ``/init_weights_update_group`` takes ``backend`` ``nccl`` as gloo (a CPU engine); outside the imitation a
  bucket posted while generation runs is received at once and applied once the running requests end
  (SGLang waits before it receives); ``GET /weights_digest`` (extension) hashes the served parameters.
- No streaming, no stop strings, no penalties, no prefix cache; those requests get a 400.
"""
