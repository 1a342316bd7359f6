"""``python -m actors.rollout_server --model-path DIR [--port N] [...]``: load the model, serve it.

Flags are named like ``sglang.launch_server``'s (``--help`` lists them). Once listening, the server prints
one line to stdout, ``rollout_server ready on http://HOST:PORT model=... params=... device=... slots=...
context=... weight_version=... load_s=...``, which supervisors (``process.RolloutServerProcess``) read for
the URL. Exit codes: 0 after SIGTERM/SIGINT; 1 when the scheduler thread died (its supervisor restarts
it) or the model cannot be loaded or served; 2 for a bad command line.

Control endpoints (weight updates, pause, continue, abort, flush) need the admin API key when one is
set (``--admin-api-key``, as SGLang's flag, or the ``VAPO_ENGINE_ADMIN_API_KEY`` environment variable,
which is how a worker passes it: a command line is readable by every user of the machine). A
non-loopback ``--host`` needs ``--bind-protection`` (``engine.bind_protection``) all the same: /generate
stays open.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
from aiohttp import web

from actors.rollout_server.http import Server
from actors.rollout_server.process import ADMIN_KEY_ENV
from common.config import EngineConfig
from common.generation.sampling import DEFAULT_MAX_N
from common.generation.scheduler import Scheduler
from common.metrics import Metrics
from common.security import is_loopback_host, url_host

log = logging.getLogger("vapo.rollout_server")

BIND_PROTECTIONS = ("firewall", "private_network", "auth_proxy")


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()
    p = argparse.ArgumentParser(
        prog="python -m actors.rollout_server",
        description="Serve an HF causal LM through SGLang's native HTTP API (/generate, /update_weights_from_disk, "
                    "/pause_generation, ...) with continuous batching on CPU or CUDA. Flags are named like "
                    "sglang.launch_server's.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-path", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: --model-path)")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="no tokenizer: input_ids only, no 'text' in outputs")
    p.add_argument("--host", default=d.host, help="bind address")
    p.add_argument("--port", type=int, default=d.base_port, help="port (0 = pick a free one; printed on the ready line)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="compute device")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="parameter dtype")
    p.add_argument("--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int,
                   default=d.max_batch_size, help="most sequences decoded together (KV-cache slots)")
    p.add_argument("--context-length", type=int, default=d.context_length,
                   help="longest prompt + response (0 = the model's max_position_embeddings)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="most prompt tokens in one batched prefill")
    p.add_argument("--batch-wait-ms", type=float, default=d.batch_wait_ms,
                   help="when idle, wait this long for concurrent requests to share the first prefill")
    p.add_argument("--threads", type=int, default=d.threads, help="torch intra-op threads (CPU)")
    p.add_argument("--weight-version", default="default", help="initial weight version (SGLang's --weight-version)")
    p.add_argument("--random-seed", type=int, default=0, help="sampling RNG seed")
    p.add_argument("--logprobs", default=d.logprobs, choices=("original", "scaled"),
                   help="original: log_softmax(logits) (what the learner recomputes; SGLang with "
                        "SGLANG_RETURN_ORIGINAL_LOGPROB=1); scaled: log_softmax(logits / temperature) (SGLang default)")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="largest sampling_params.n (400 above)")
    p.add_argument("--max-queued-tokens", type=int, default=0,
                   help="most prompt + max_new_tokens tokens waiting for a slot; a request past it gets 503 "
                        "(0 = 16 x --max-batch-size x context length)")
    p.add_argument("--max-prompts-per-request", type=int, default=0,
                   help="most prompts in one /generate, counted in the raw body before it is parsed "
                        "(400 above; 0 = 16 x --max-batch-size)")
    p.add_argument("--admin-api-key", default=None,
                   help=f"Bearer key the control endpoints require (SGLang's flag; default: ${ADMIN_KEY_ENV}; "
                        "empty = none)")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="largest request body (413 above)")
    p.add_argument("--http-read-timeout-s", type=float, default=60.0,
                   help="a request body must arrive within this (408 otherwise)")
    p.add_argument("--http-idle-timeout-s", type=float, default=75.0,
                   help="close a connection that sends no complete request for this long (slow clients included)")
    p.add_argument("--weight-load-timeout-s", type=float, default=d.weight_load_timeout_s,
                   help="/update_weights_from_disk: reading and checking the checkpoint must finish within this")
    p.add_argument("--bind-protection", default="", choices=("", *BIND_PROTECTIONS),
                   help="required when --host is not a loopback address: how the port is protected "
                        "(/generate is open to anyone who reaches it; the control API needs the admin API key), "
                        "as engine.bind_protection")
    p.add_argument("--imitate-sglang", action="store_true",
                   help="test mode: behave as real SGLang 0.5.23 does where it differs (slow /health that blocks "
                        "while paused or loading, 400 after a load whose cache flush is refused, meta_info."
                        "weight_versions, /metrics only with --enable-metrics, no /get_weight_version)")
    p.add_argument("--enable-metrics", action="store_true", help="--imitate-sglang: serve /metrics (as SGLang's flag)")
    p.add_argument("--refuse-flush", action="store_true",
                   help="test mode: every post-load cache flush is refused (SGLang answers 400 with the new weights live)")
    p.add_argument("--log-level", default="info", help="logging level")
    return p


async def _serve(args: argparse.Namespace) -> None:
    from common.modeling import load_model, load_tokenizer  # noqa: PLC0415 - transformers, only once serving (not for --help)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    torch.set_num_threads(max(1, args.threads))
    t0 = time.time()
    log.info("loading %s (%s, %s)", args.model_path, args.device, args.dtype)
    model = load_model(args.model_path, dtype=args.dtype, device=args.device)
    tok_path = args.tokenizer_path or args.model_path
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(tok_path)
    eos: set[int] = set()
    for src in (model.config, getattr(model, "generation_config", None)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        eos.update([e] if isinstance(e, int) else list(e or []))
    metrics = Metrics("engine")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_death(e: BaseException) -> None:  # scheduler thread: a dead scheduler must not serve 503 forever
        loop.call_soon_threadsafe(stop.set)

    scheduler = Scheduler(model, max_batch_size=args.max_batch_size, context_length=args.context_length,
                          weight_version=args.weight_version, eos_token_ids=eos, seed=args.random_seed,
                          scaled_logprobs=args.logprobs == "scaled", batch_wait_ms=args.batch_wait_ms,
                          metrics=metrics, max_prefill_tokens=args.max_prefill_tokens,
                          max_queued_tokens=args.max_queued_tokens, on_death=on_death)
    server = Server(scheduler, tokenizer, args.model_path, tok_path, metrics, max_n=args.max_n,
                    weight_load_timeout_s=args.weight_load_timeout_s, imitate_sglang=args.imitate_sglang,
                    enable_metrics=args.enable_metrics, refuse_flush=args.refuse_flush,
                    admin_api_key=args.admin_api_key, max_prompts=args.max_prompts_per_request)
    gc.freeze()  # the model, tokenizer and imports never become garbage: keep them out of every GC pass
    # handler_cancellation: a client that disconnects (or times out) cancels its handler, which aborts its
    # sequences so they stop holding KV-cache slots. keepalive_timeout also closes a connection that never
    # completes a request (aiohttp arms it at connect), which is what ends a slow-loris client.
    runner = web.AppRunner(server.app(args.max_body_bytes, args.http_read_timeout_s), access_log=None,
                           handler_cancellation=True, keepalive_timeout=args.http_idle_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]  # the bound port when --port is 0 (the one site's first socket)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"rollout_server ready on http://{url_host(args.host)}:{port} model={args.model_path} params={n_params} "
          f"device={args.device} slots={args.max_batch_size} context={scheduler.context_length} "
          f"weight_version={scheduler.weight_version} load_s={time.time() - t0:.1f}", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(runner.cleanup(), 10.0)
    scheduler.shutdown()
    if scheduler.error is not None:
        raise SchedulerDied(f"engine thread died: {type(scheduler.error).__name__}: {scheduler.error}")


class SchedulerDied(RuntimeError):
    """The scheduler thread failed: the process exits 1 so that its supervisor restarts it."""


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.admin_api_key is None:
        args.admin_api_key = os.environ.get(ADMIN_KEY_ENV, "")
    if not is_loopback_host(args.host) and not args.bind_protection:
        control = ("its control API (/update_weights_from_disk, /pause_generation, ...) takes only the admin API key"
                   if args.admin_api_key else "its control API (/update_weights_from_disk, /pause_generation, ...) "
                   f"is open too: no --admin-api-key or {ADMIN_KEY_ENV} is set")
        raise SystemExit(f"rollout_server: --host {args.host} is not a loopback address and the generation API "
                         f"(/generate) has no authentication: anyone who reaches the port can generate ({control}); "
                         f"bind 127.0.0.1, or state how the port is protected with --bind-protection "
                         f"{{{','.join(BIND_PROTECTIONS)}}} (config key engine.bind_protection)")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.max_batch_size < 1:
        raise SystemExit("--max-batch-size must be >= 1")
    for flag, path in (("--model-path", args.model_path), ("--tokenizer-path", args.tokenizer_path)):
        if path is not None and not (Path(path) / "config.json" if flag == "--model-path" else Path(path)).exists():
            raise SystemExit(f"rollout_server: {flag} {path!r} is not an HF model directory (no config.json); "
                             f"build the embedded base with `python -m learner.sft` or pass an existing checkpoint")
    try:
        asyncio.run(_serve(args))
    except (OSError, RuntimeError, ValueError) as e:
        raise SystemExit(f"rollout_server: {e}") from e
    finally:
        # A weight read stuck in a daemon thread (or in the kernel) must not hold the exit: interpreter
        # shutdown would wait on nothing else, but flush what the logs hold first.
        logging.shutdown()


if __name__ == "__main__":
    main()

