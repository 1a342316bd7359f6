"""The generation core shared by the rollout engine (``actors.rollout_server``) and in-process evaluation
(``learner.evaluate``): ``scheduler`` (continuous batching on one thread), ``model_runner`` (KV-cache
prefill/decode of Llama-style HF models), ``sampling`` (parameters, token sampler), ``weights`` (checkpoint
reading and checks for weight updates) and ``passes`` (a private scheduler run to completion)."""
