"""Benchmark: host memory of building a ZeRO-3 policy and critic, the old way against the new, in one run.

    .venv/bin/python -m ops.bench.zero_build [--hidden 768] [--layers 12] [--vocab 32000] [--ranks 2]

Prints one JSON line. A random Qwen2 (default ~110M parameters, tied embeddings, fp32) is saved once; then,
for each path, ``--ranks`` CPU ranks (torchrun, gloo, real subprocesses) build, one after the other:

1. a critic engine as value pretraining does (``build_critic``, DeepSpeed ZeRO-3), then let it go: ``new``
   releases it (``learner.models.release`` + ``collect``), ``old`` drops the reference as the code did;
   ``pretrain_critic_left_over_full_model`` = what stays resident afterwards / the full model's fp32 bytes;
2. the policy module, then the critic module, each partitioned by ZeRO-3. ``new``: ``load_policy_module`` /
   ``load_critic_module`` with the partitioned build (``deepspeed.zero.Init``, rank 0 streams the weights
   in a group at a time); ``old``: ``from_pretrained`` on every rank, then the partitioning that
   ``deepspeed.initialize`` applied to such a module (``deepspeed.zero.Init(module=...)``).
   ``peak_rise_over_full_model`` = each rank's peak RSS rise while building one module (from just before
   it) / that module's full fp32 bytes; the figure is the largest over ranks and the two modules.

Step 2 stops at partitioned modules: DeepSpeed's optimizer states (fp32 master and gradient partitions)
live in GPU memory on a GPU learner, scale with 1/ranks, and ``common/placement.py`` already counts them;
on this CPU-only bench they would be host memory and hide the transient under test. With N ranks the
partitions alone are 1/N of the model, so the floor is ~0.5 for 2 ranks; the old path holds the whole
model per rank (≥ 1) plus ``from_pretrained``'s own copies.

Measurement: as ops/bench/memory.py, glibc's ``MALLOC_MMAP_THRESHOLD_=65536`` makes RSS follow live tensors,
the kernel's high-water mark is reset before each build (``/proc/self/clear_refs`` ← 5) and VmHWM read after.
Target: new ``peak_rise_over_full_model`` ≤ 0.75 (old ~2), new ``pretrain_critic_left_over_full_model`` ≤ 0.1.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common.config import load_config
from common.ports import free_port

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def make_model(out: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random fp32 Qwen2 in ``out``; returns its parameter count."""
    import torch  # noqa: PLC0415 - measured: loaded inside the figures' window
    from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: PLC0415 - measured: loaded inside the figures' window

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      max_position_embeddings=512, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _measure(build: Any) -> tuple[Any, float]:
    """``build()`` and its peak RSS rise in bytes, from just before it."""
    gc.collect()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    out = build()
    return out, (_status_kib("VmHWM") - before) * 1024.0


def _old_module(cfg: Any, kind: str) -> Any:
    """The code before the partitioned build: the whole model on this rank, then ZeRO-3's conversion."""
    import deepspeed  # noqa: PLC0415 - measured: loaded inside the figures' window

    from learner.models import ds_config, load_critic_module, load_policy_module  # noqa: PLC0415 - measured: loaded inside the figures' window

    m = load_policy_module(cfg.model.path) if kind == "policy" else load_critic_module(cfg)
    deepspeed.zero.Init(module=m, config_dict_or_path=ds_config(cfg, cfg.learner.grad_clip))
    return m


def child(path: str, model: str, out: str) -> None:
    """One rank of one path (run under torchrun): writes rank<r>.json into ``out``."""
    import torch  # noqa: PLC0415 - measured: loaded inside the figures' window

    torch.set_num_threads(1)

    import transformers.models.qwen2.modeling_qwen2  # noqa: F401,PLC0415 - measured: loaded inside the figures' window

    from learner import models  # noqa: PLC0415 - measured: loaded inside the figures' window
    from learner.dist import exit_process, rank, setup_distributed  # noqa: PLC0415 - measured: loaded inside the figures' window

    cfg = load_config(None, [f"model.path={model}", "learner.zero_stage=3", "learner.precision=fp32",
                             "model.dtype=float32", "metrics.prometheus=false"])
    setup_distributed(cfg)
    from learner.partitioned import checkpoint_index  # noqa: PLC0415 - measured: loaded inside the figures' window

    models.PARTITIONED_BUILD = path == "new"
    # The checkpoint's tensors in fp32: the policy's parameters, and (tied embeddings) the critic's too.
    full_bytes = 4.0 * sum(e.numel for e in checkpoint_index(Path(model)).values())
    base = _status_kib("VmRSS")

    def pretrain() -> None:
        engine = models.build_critic(cfg)
        if path == "new":
            models.release(engine)
            del engine
            models.collect()

    _measure(pretrain)
    left = (_status_kib("VmRSS") - base) * 1024.0
    def build(kind: str) -> Any:
        if path == "old":
            return _old_module(cfg, kind)
        if kind == "policy":
            return models.load_policy_module(model, partition=cfg)
        return models.load_critic_module(cfg, partitioned=True)

    held = []
    rise = {}
    for kind in ("policy", "critic"):
        m, r = _measure(lambda k=kind: build(k))
        held.append(m)  # the learner keeps both: the critic is built beside the partitioned policy
        rise[kind] = r / full_bytes
    (Path(out) / f"rank{rank()}.json").write_text(json.dumps(
        {"rise": rise, "pretrain_left": left / full_bytes, "full_bytes": full_bytes}))
    exit_process(0)  # no interpreter finalisation: gloo's threads can abort a rank that finished


def run_path(path: str, model: Path, ranks: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "VAPO_DS_SHM": "0"}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "VAPO_STORE_FILE"):
            env.pop(k, None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), "-m", "ops.bench.zero_build", "--child", path, str(model), out]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
        if p.returncode != 0:
            raise RuntimeError(f"{path}: exit {p.returncode}\n{p.stderr[-4000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]


def bench(hidden: int, layers: int, vocab: int, ranks: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "model"
        n = make_model(model, hidden, layers, vocab)
        res = {path: run_path(path, model, ranks) for path in ("old", "new")}
    out: dict[str, Any] = {"bench": "zero_build", "params_m": round(n / 1e6, 1), "ranks": ranks,
                           "full_model_mib": round(n * 4 / 2**20, 1)}
    for path, ranks_out in res.items():
        out[path] = {
            "peak_rise_over_full_model": round(max(max(r["rise"].values()) for r in ranks_out), 3),
            "per_rank": [{k: round(v, 3) for k, v in r["rise"].items()} for r in ranks_out],
            "pretrain_critic_left_over_full_model": round(max(r["pretrain_left"] for r in ranks_out), 3),
        }
    out["new_over_old"] = round(out["new"]["peak_rise_over_full_model"] / out["old"]["peak_rise_over_full_model"], 3)
    out["target_met"] = out["new"]["peak_rise_over_full_model"] <= 0.75
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(*[a for a in argv[1:] if not a.startswith("--local")])
        return 0
    ap = argparse.ArgumentParser(prog="python -m ops.bench.zero_build", description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ranks", type=int, default=2)
    a = ap.parse_args(argv)
    print(json.dumps(bench(a.hidden, a.layers, a.vocab, a.ranks)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
