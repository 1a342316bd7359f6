"""Fingerprint: sha256 digests of what a refactor must not change, to compare two commits bit for bit.

    .venv/bin/python -m ops.bench.fingerprint [--only learner,rollout,wire] [--threads 1]

Prints one JSON line. Each part uses only stable public entry points, so the same file runs on an older
checkout (copy it there and run it with that checkout as the working directory):
- ``learner``: per ``LEARNER_VARIANTS`` config, one full step (critic, then actor) of ``learner.train.Learner``
  under DeepSpeed (one rank, CPU) on a tiny random Qwen2 and fixed synthetic groups; digests of every policy
  and critic tensor after it (fp32 bytes, name-sorted), of its statistics (sorted-key JSON, floats repr'd,
  without the wall-clock keys in ``volatile_stats``) and of each gradient as backward accumulates it.
- ``rollout``: ``python -m actors.rollout_server --random-seed 0`` on that model, fixed /generate requests
  posted in turn; the digest of the raw bodies in order, the timing values (``volatile_fields``) blanked.
- ``wire``: ``common.protocol.encode`` of one message of every type, built with keyword arguments.
Equal digests on two commits mean equal behaviour on these inputs; the part digests say where they differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import protocol  # noqa: E402
from common.config import load_config  # noqa: E402
from common.modeling import build_char_tokenizer, build_tiny_qwen2, save_hf  # noqa: E402
from common.protocol import Sample, SampleGroup  # noqa: E402
from learner.dist import exit_process  # noqa: E402
from learner.train import Learner  # noqa: E402

VOLATILE_STATS = ("time", "tokens_per_second", "phase_seconds", "step_seconds", "tokens_per_second_per_rank",
                  "phase_tokens_per_second", "phase_tflops_per_rank", "tflops_per_rank", "phase_mfu", "mfu",
                  "peak_tflops", "peak_tflops_measured")
VOLATILE_FIELDS = ("e2e_latency",)
LEARNER_OVERRIDES = ("learner.micro_batch_size=3", "learner.mini_batches=2", "learner.batch_groups=4",
                     "learner.actor_lr=1e-3", "learner.critic_lr=2e-3", "learner.grad_clip=1.0", "algo.alpha=0.5",
                     "learner.value_head_init_std=0.02", "metrics.prometheus=false")
# The step's branches: critic values before/after its update, coupled λ, GRPO, recomputed π_old.
LEARNER_VARIANTS: dict[str, tuple[str, ...]] = {
    "vapo": (), "pre_update": ("algo.actor_values=pre_update",), "coupled": ("algo.decoupled_gae=false",),
    "grpo_decoupled": ("algo.advantage=grpo", "learner.off_policy=decoupled"),
    "rollout_correction": ("learner.off_policy=rollout_correction",),
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tiny_model(root: Path) -> Path:
    """The tests' tiny model (1-layer Qwen2, hidden 32, char tokenizer, seed 0), saved under ``root``."""
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=256, seed=0)
    return save_hf(model, tok, root / "tiny")


def fixed_groups(n_groups: int = 4, group_size: int = 4, vocab: int = 60, seed: int = 3,
                 max_new_tokens: int = 12) -> list[Any]:
    """Random prompts and responses over token ids [3, vocab), reward 1 with probability 1/2; a response of
    ``max_new_tokens`` ends by 'length'. Its own generator: the data must not move with product code."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(3, 8, endpoint=True))).astype(np.int32)
        samples = []
        for _ in range(group_size):
            length = int(rng.integers(1, max_new_tokens, endpoint=True))
            out = rng.integers(3, vocab, size=length).astype(np.int32)
            logprobs = (-rng.random(length) * 3.0 - 0.05).astype(np.float32)
            samples.append(Sample(prompt_ids=prompt, output_ids=out, output_logprobs=logprobs,
                                  reward=float(rng.random() < 0.5),
                                  finish_reason="length" if length >= max_new_tokens else "stop",
                                  weight_version=0, response_length=length))
        groups.append(SampleGroup(group_id=f"g{seed}-{g}", prompt_id=f"p{g}", task="synthetic", actor_id=0,
                                  samples=samples, created_at=0.0))
    return groups


def tensors_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode() + b"\0" + state[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def stats_digest(stats: dict[str, Any]) -> str:
    """Sorted-key JSON with every float as its repr (json's own float format could change with Python)."""
    def canon(v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): canon(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [canon(x) for x in v]
        if isinstance(v, float):
            return repr(v)
        return v
    kept = {k: v for k, v in stats.items() if k not in VOLATILE_STATS}
    return sha(json.dumps(canon(kept), sort_keys=True).encode())


def watch_grads(modules: dict[str, torch.nn.Module]) -> dict[str, list[str]]:
    """Digest of each parameter's .grad each time backward has accumulated into it, in order."""
    seen: dict[str, list[str]] = {}
    for prefix, module in modules.items():
        for name, param in module.named_parameters():
            key = f"{prefix}.{name}"
            seen[key] = []

            def record(tensor: torch.Tensor, key: str = key) -> None:
                if tensor.grad is not None:
                    seen[key].append(sha(tensor.grad.detach().to(torch.float32).contiguous().numpy().tobytes()))
            param.register_post_accumulate_grad_hook(record)
    return seen


def learner_fingerprint(model_dir: Path, data_seed: int = 3, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One DeepSpeed learner step on ``fixed_groups(seed=data_seed)`` with config overrides ``extra``:
    digests of the models (critic "none" without one), statistics and gradients."""
    cfg = load_config(None, [f"model.path={model_dir}", *LEARNER_OVERRIDES, *extra])
    learner = Learner(cfg, None)
    models = {"policy": learner.policy.module}
    if learner.critic is not None:
        models["critic"] = learner.critic.module
    grads = watch_grads(models)
    stats = learner.step(fixed_groups(seed=data_seed, max_new_tokens=cfg.actors.max_new_tokens))
    grad_hash = hashlib.sha256()
    for key in sorted(grads):
        grad_hash.update(key.encode() + b"\0" + "".join(grads[key]).encode())
    return {
        "policy": tensors_digest(models["policy"].state_dict()),
        "critic": tensors_digest(models["critic"].state_dict()) if "critic" in models else "none",
        "stats": stats_digest(stats), "grads": grad_hash.hexdigest(), "grad_events": sum(map(len, grads.values())),
    }


GENERATE_REQUESTS: tuple[dict[str, Any], ...] = (
    {"rid": "greedy", "text": "12+34=", "return_logprob": True,
     "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}},
    {"rid": "stop", "text": "12+34=", "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,
                                                          "stop_token_ids": [16]}},
    {"rid": "t1", "input_ids": [5, 9, 14, 3, 22], "return_logprob": True,
     "sampling_params": {"temperature": 1.0, "max_new_tokens": 10}},
    {"rid": "n3", "text": ["7*8=", "hello"], "return_logprob": True,
     "sampling_params": {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "n": 3, "max_new_tokens": 6}},
    {"rid": "minp", "text": "abc", "sampling_params": {"temperature": 1.2, "min_p": 0.05, "max_new_tokens": 7,
                                                       "ignore_eos": True, "stop_token_ids": [5]}},
    {"rid": "lists", "text": ["x", "yz"], "return_logprob": [True, False], "return_text_in_logprobs": True,
     "sampling_params": [{"temperature": 0.0, "max_new_tokens": 4}, {"temperature": 1.0, "max_new_tokens": 5}]},
    {"rid": "bad", "text": "q", "sampling_params": {"temperature": -1.0}},
)


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def blank_volatile(body: bytes) -> bytes:
    """The body with each timing field's value replaced by null, every other byte as sent."""
    for name in VOLATILE_FIELDS:
        body = re.sub(rb'("' + name.encode() + rb'":\s*)-?[0-9][0-9.eE+-]*', rb"\1null", body)
    return body


def start_server(model_dir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """``python -m actors.rollout_server`` on a free port; returns it with the URL of its ready line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "actors.rollout_server", "--model-path", str(model_dir), "--port", "0",
           "--threads", "1", "--random-seed", "0", "--log-level", "warning"]
    with open(log_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # the server prints its ready line once listening; EOF means it exited
        if "ready on " in line:
            return proc, line.split("ready on ", 1)[1].split()[0]
    proc.wait()
    raise RuntimeError(f"rollout_server exited {proc.returncode}: {log_path.read_text()[-2000:]}")


def rollout_fingerprint(model_dir: Path, log_dir: Path) -> dict[str, Any]:
    proc, url = start_server(model_dir, log_dir / "rollout_server.log")
    try:
        replies = [post(url + "/generate", body) for body in GENERATE_REQUESTS]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    total = hashlib.sha256()
    parts = {}
    for body, (status, raw) in zip(GENERATE_REQUESTS, replies, strict=True):
        frame = str(status).encode() + b"\0" + blank_volatile(raw)
        total.update(frame)
        parts[body["rid"]] = sha(frame)[:16]
    return {"responses": total.hexdigest(), "parts": parts, "volatile_fields": list(VOLATILE_FIELDS),
            "seed": "server --random-seed 0 (per-request sampling_seed is refused)"}


def wire_messages() -> list[Any]:
    """One message of every protocol type, built with keyword arguments only."""
    groups = fixed_groups(n_groups=2, group_size=2)
    # The longest response, its first token from version 0 and the rest from 1 (an update mid-generation).
    sample = max(groups[1].samples, key=lambda s: s.response_length)
    spans = np.array([0, 1, 1, sample.response_length - 1], dtype=np.int64)
    spanned = protocol.Sample(prompt_ids=sample.prompt_ids, output_ids=sample.output_ids,
                              output_logprobs=sample.output_logprobs, reward=1.0, finish_reason="stop",
                              weight_version=0, response_length=sample.response_length, version_spans=spans)
    bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2, 3]]}
    return [
        groups[0], spanned,
        protocol.IngestAck(group_id="g", committed=True, duplicate=False, error=""),
        protocol.CreditRequest(actor_id=1, n=4),
        protocol.CreditGrant(n=3, learner_version=7),
        protocol.BatchRequest(learner_version=7, n_groups=2, timeout_ms=500),
        protocol.PositivesRequest(n=5),
        protocol.StatsRequest(),
        protocol.WeightUpdate(version=3, path="/tmp/w/v3", sha256="ab" * 32, created_at=1.5),
        protocol.WeightQuery(),
        protocol.PushJoin(actor_id=2, engine_start=123456),
        protocol.PushVersion(epoch=1, version=4),
        protocol.PushGroup(epoch=1, master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=3,
                           group_name="vapo", backend="gloo", buckets=[bucket]),
        protocol.PushDone(actor_id=2, epoch=1, version=-1, ok=True, pause_s=0.25, message=""),
        protocol.ErrorReply(reason="bad", message="no"),
        protocol.BatchReply(groups=groups, stale_dropped=1, filtered=2),
        protocol.PositivesReply(samples=[spanned]),
        protocol.StatsReply(stats={"depth": 3.0, "drops": 0.5}),
    ]


def wire_fingerprint() -> dict[str, Any]:
    total = hashlib.sha256()
    parts: dict[str, str] = {}
    roundtrip = True
    for msg in wire_messages():
        frame = protocol.encode(msg)
        total.update(frame)
        parts[f"{len(parts):02d}_{msg.TYPE}"] = sha(frame)[:16]
        roundtrip &= protocol.encode(protocol.decode(frame)) == frame
    frames = [protocol.encode(g) for g in fixed_groups(n_groups=2, group_size=2)]
    spliced = protocol.encode_batch_reply(frames, stale_dropped=1, filtered=2)
    total.update(spliced)
    parts["encode_batch_reply"] = sha(spliced)[:16]
    return {"frames": total.hexdigest(), "parts": parts, "decode_reencodes_equal": roundtrip}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="sha256 fingerprints of a learner step, rollout_server "
                                                 "replies and protocol frames, as one JSON line")
    parser.add_argument("--only", default="learner,rollout,wire", help="comma-separated parts to run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the learner step")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = args.only.split(",")
    out: dict[str, Any] = {"repo": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="fingerprint-") as tmp:
        model_dir = tiny_model(Path(tmp))
        if "wire" in parts:
            out["wire"] = wire_fingerprint()
        if "rollout" in parts:
            out["rollout"] = rollout_fingerprint(model_dir, Path(tmp))
        if "learner" in parts:
            out["learner"] = {name: learner_fingerprint(model_dir, extra=extra)
                              for name, extra in LEARNER_VARIANTS.items()}
            out["learner"]["volatile_stats"] = list(VOLATILE_STATS)

    out["code"] = str(Path(protocol.__file__).resolve().parents[1])  # which checkout was imported
    print(json.dumps(out, sort_keys=True), flush=True)
    if "learner" in parts:  # a live gloo group can abort interpreter finalisation; leave as a learner does

        exit_process(0)


if __name__ == "__main__":
    main()
