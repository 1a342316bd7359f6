"""Base policy bootstrap: supervised fine-tuning of a tiny Qwen2 on an imperfect teacher's traces.

    python -m learner.sft [config.yaml] [key=value ...]      # e.g. python -m learner.sft ops/configs/default.yaml

Builds the character tokenizer and a tiny Qwen2 (``common.modeling``), trains it with next-token loss on
the response tokens of the task's teacher traces (``Task.teacher_response``: the embedded ``addition`` and
``chain`` tasks have one) for training prompts, where the teacher makes a wrong step (a column sum, a
chain line) with probability ``model.bootstrap.teacher_error_rate``. The result is
imperfect on purpose: it samples (temperature 1) mistakes at about that rate per column while its greedy
answers are mostly right, which leaves RL room to sharpen the policy. Finally it evaluates the model on
the held-out split and saves it with ``save_pretrained`` (atomic) to ``model.path``, with its bootstrap
stats in ``vapo_info.json``.

Deterministic given ``model.bootstrap.seed`` and ``model.bootstrap.threads`` (1 and 2 threads round
differently): the run stops after
``max_steps``; ``seconds`` is only a safety cap (hitting it makes the result depend on machine speed and
is reported as such). Not part of the VAPO paper, which starts from a pretrained LLM.

Measured (ops/configs/default.yaml: 0.60M parameters, 800 steps x 64 traces, 12% teacher errors, 2 threads):
held-out avg@8 0.451 sampled / 0.949 greedy, responses 9-74 tokens. ops/configs/long.yaml (chain task,
400 steps x 32 traces, 3% slips per line): ~7 min at 0.95 steps/s, avg@4 0.41 / greedy 0.84 on 64 prompts. On 2 cores shared with other jobs
(load 4-5) the SFT ran 757 s at 1.06 steps/s. The only low-load measurement (load ~1.7, 20 steps) gave
4.5 steps/s, i.e. about 3 min for 800 steps; an idle machine was not available to confirm it.
"""

from __future__ import annotations

import os

# libgomp busy-waits between parallel regions by default; on a CPU shared with other processes that made
# 2-thread SFT 3x slower than 1 thread (0.37 vs 1.02 steps/s measured), passive waiting made it faster
# (1.21 steps/s). It must be set before torch loads libgomp; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common import provenance
from common.config import Config, ConfigError, load_config, to_dict
from common.modeling import build_char_tokenizer, build_tiny_qwen2, save_hf
from common.tasks import Prompt, Task, encode_prompt, get_task, stable_hash
from learner.evaluate import evaluate

MANIFEST = "manifest.json"  # beside the weights: checksum, command, config, machine, held-out figures


def make_example(tokenizer: Any, task: Task, prompt: Prompt, seed: int, error_rate: float) -> tuple[list[int], int]:
    """(token ids of prompt + teacher response + EOS, number of prompt tokens) for one training prompt."""
    rng = random.Random(stable_hash(seed, "teacher", prompt.index))
    response = task.teacher_response(prompt, rng, error_rate)
    p_ids = encode_prompt(tokenizer, prompt)
    r_ids = tokenizer.encode(response, add_special_tokens=False)
    return p_ids + list(r_ids) + [tokenizer.eos_token_id], len(p_ids)


class BatchMaker:
    """Deterministic SFT batches with length grouping.

    The examples of ``group`` consecutive steps (training prompts ``[m*group*B, (m+1)*group*B)``) are
    sorted by length and cut into ``group`` batches, taken in a seeded order. Batches then hold similar
    lengths, which removes most padding (responses range from 9 to 70 tokens), while every ``group`` steps
    still see the same mix of lengths (HF Trainer's ``group_by_length`` does the same). Off by default
    (``group=1``): on this task it made steps ~1.5x cheaper but learning per step much slower (loss 0.41
    vs 0.09 after 400-475 steps), a net loss.
    """

    def __init__(self, tokenizer: Any, task: Task, batch_size: int, seed: int, error_rate: float,
                 group: int = 1) -> None:
        self.tok, self.task, self.bsz, self.seed, self.err, self.group = tokenizer, task, batch_size, seed, error_rate, group
        self._block: tuple[int, list[list[tuple[list[int], int, int]]]] | None = None

    def _make_block(self, m: int) -> list[list[tuple[list[int], int, int]]]:
        first = m * self.group * self.bsz
        rows = []
        for idx in range(first, first + self.group * self.bsz):
            seq, plen = make_example(self.tok, self.task, self.task.train_prompt(idx), self.seed, self.err)
            rows.append((seq, plen, idx))
        rows.sort(key=lambda r: (len(r[0]), r[2]))
        batches = [rows[i * self.bsz : (i + 1) * self.bsz] for i in range(self.group)]
        random.Random(stable_hash(self.seed, "batch-order", m)).shuffle(batches)
        return batches

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(input_ids [B,T] right-padded, loss mask [B,T-1] on response targets, prompt indices)."""
        m = step // self.group
        if self._block is None or self._block[0] != m:
            self._block = (m, self._make_block(m))
        examples = self._block[1][step % self.group]
        width = max(len(seq) for seq, _, _ in examples)
        ids = torch.full((len(examples), width), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(examples), width - 1), dtype=torch.float32)
        for i, (seq, plen, _) in enumerate(examples):
            ids[i, : len(seq)] = torch.tensor(seq)
            # Target position t predicts token t+1: train on response tokens and the EOS only.
            mask[i, plen - 1 : len(seq) - 1] = 1.0
        return ids, mask, [idx for _, _, idx in examples]


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(total - warmup, 1)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _base_model(cfg: Config, tokenizer: Any) -> torch.nn.Module:
    """The tiny Qwen2 of ``model.bootstrap``, freshly initialised (seeded), on ``run.device``."""
    b = cfg.model.bootstrap
    model = build_tiny_qwen2(
        len(tokenizer), hidden_size=b.hidden_size, num_layers=b.num_layers, num_heads=b.num_heads,
        num_kv_heads=b.num_kv_heads, intermediate_size=b.intermediate_size,
        max_position_embeddings=b.max_position_embeddings, seed=b.seed,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    if cfg.run.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("run.device=cuda but torch sees no CUDA device")
        # The base differs from a CPU-built one (other kernels): record, do not mix. The ignore: transformers'
        # wrapper of PreTrainedModel.to types its first argument as the model.
        model = model.to("cuda")  # type: ignore[arg-type]
    return model


def _sft_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One optimizer step on the masked (response-token) NLL of a batch; returns the loss."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none"
    ).view_as(mask)
    loss = (nll * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def train(cfg: Config, log: Any = print, stop_after: int | None = None) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """Run the SFT; returns (model, tokenizer, stats). Does not save. ``stop_after``: end after that many
    steps of the ``max_steps`` schedule (a check build: the same learning-rate schedule, cut short)."""
    b = cfg.model.bootstrap
    torch.set_num_threads(b.threads)
    task = get_task(cfg.task)
    if type(task).teacher_response is Task.teacher_response:
        raise ValueError(f"learner.sft bootstraps the embedded synthetic tasks (addition, chain), not {task.name!r}; "
                         "for other tasks point model.path at a pretrained HF model")
    tokenizer = build_char_tokenizer()
    model = _base_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    device = next(model.parameters()).device
    torch.manual_seed(b.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=b.lr, betas=(0.9, 0.98), weight_decay=b.weight_decay)
    warmup = max(1, int(b.warmup_fraction * b.max_steps))
    model.train()
    log(f"sft: {n_params:,} parameters, up to {b.max_steps} steps x {b.batch_size} traces "
        f"(teacher error rate {b.teacher_error_rate:.0%}, cap {b.seconds:.0f} s, {b.threads} threads)")
    t0 = time.perf_counter()
    last_log = t0
    tokens = 0
    ema: float | None = None
    step = 0
    hit_cap = False
    batches = BatchMaker(tokenizer, task, b.batch_size, b.seed, b.teacher_error_rate, b.length_group)
    last = min(b.max_steps, stop_after or b.max_steps)
    while step < last:
        if time.perf_counter() - t0 >= b.seconds:
            hit_cap = True
            break
        ids, mask, _ = batches(step)
        ids, mask = ids.to(device), mask.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, b.max_steps, b.lr, warmup, b.min_lr_ratio)
        loss = _sft_step(model, opt, ids, mask)
        tokens += int(mask.sum())
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        now = time.perf_counter()
        if now - last_log >= b.log_every_s or step == last:
            el = now - t0
            log(f"sft: step {step}/{b.max_steps}  loss {ema:.4f}  {step / el:.2f} steps/s  "
                f"{tokens / el:,.0f} tok/s  {el:.0f}s")
            last_log = now
    seconds = time.perf_counter() - t0
    if hit_cap:
        log(f"sft: WARNING stopped by the {b.seconds:.0f} s cap at step {step}/{b.max_steps}; "
            "the result now depends on machine speed (raise model.bootstrap.seconds or lower max_steps)")
    stats = {
        "parameters": n_params,
        "steps": step,
        "max_steps": b.max_steps,
        "stop_after": stop_after,
        "stopped_by_time_cap": hit_cap,
        "sft_seconds": round(seconds, 2),
        "steps_per_s": round(step / max(seconds, 1e-9), 3),
        "response_tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        "final_loss_ema": ema,
        "threads": b.threads,
        "device": str(device),
    }
    return model, tokenizer, stats


def manifest_for(path: str | Path, stats: dict[str, Any], command: str) -> dict[str, Any]:
    """The ``manifest.json`` of a built base: name, checksum, the command and config that built it, the
    machine (``common.provenance``) and the held-out figures of the closing evaluation."""
    out = Path(path)
    ev = stats.get("eval") or {}
    machine = provenance.collect(None, {"bootstrap": stats["threads"]})
    return {
        "name": out.name,
        "sha256": provenance.base_checksum(out),
        "bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
        "command": command,
        "config": {"task": stats["task"], "bootstrap": stats["bootstrap"], "device": stats["device"],
                   "max_new_tokens": stats.get("max_new_tokens")},
        "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine,
        "sft": {k: stats[k] for k in ("parameters", "steps", "stop_after", "stopped_by_time_cap", "sft_seconds", "steps_per_s",
                                      "final_loss_ema", "total_seconds") if k in stats},
        "heldout": {"k": ev.get("k"), f"avg@{ev.get('k')}": ev.get("avg_at_k"), "greedy": ev.get("greedy_accuracy"),
                    "n_prompts": ev.get("n_prompts"),
                    "response_length": [ev.get("min_response_length"), ev.get("max_response_length")]},
    }


def write_manifest(path: str | Path, manifest: dict[str, Any]) -> Path:
    """Write ``<path>/manifest.json`` (tmp file + rename: a reader never sees half of it)."""
    f = Path(path) / MANIFEST
    tmp = f.with_name(f.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.rename(f)
    return f


def run(cfg: Config, log: Any = print, command: str = "", stop_after: int | None = None) -> dict[str, Any]:
    """Train, evaluate on the held-out split, save to ``cfg.model.path`` with its ``manifest.json``;
    returns the saved stats."""
    t_all = time.perf_counter()
    model, tokenizer, stats = train(cfg, log, stop_after)
    b = cfg.model.bootstrap
    task = get_task(cfg.task)
    if b.eval_k > 0:
        log(f"sft: evaluating on {len(task.eval_prompts())} held-out prompts x {b.eval_k} samples ...")
        report = evaluate(model, tokenizer, task, k=b.eval_k, max_new_tokens=cfg.actors.max_new_tokens,
                          temperature=1.0, seed=b.seed)
        stats["eval"] = report
        log(f"sft: held-out sampled avg@{b.eval_k} {report['avg_at_k']:.3f}  greedy {report['greedy_accuracy']:.3f}  "
            f"response length {report['min_response_length']}-{report['max_response_length']} "
            f"(mean {report['mean_response_length']:.1f})  [{report['seconds']:.1f} s]")
    stats["total_seconds"] = round(time.perf_counter() - t_all, 2)
    stats["task"] = to_dict(cfg.task)
    stats["bootstrap"] = to_dict(b)
    model.eval().to("cpu")
    stats["max_new_tokens"] = cfg.actors.max_new_tokens
    out = save_hf(model, tokenizer, cfg.model.path, extra={"bootstrap": stats})
    write_manifest(out, manifest_for(out, stats, command or "python -m learner.sft (called as a library)"))
    log(f"sft: saved {out} ({stats['sft_seconds']:.0f} s of SFT, {stats['total_seconds']:.0f} s total)")
    return stats


def record_check(base: Path, built: Path, overrides: list[str], stop_after: int | None = None) -> None:
    """Store the short check build ``built`` (its overrides and held-out figures) in ``base``'s manifest."""
    check = json.loads((built / MANIFEST).read_text())
    m = json.loads((base / MANIFEST).read_text())
    m["rebuild_check"] = {"overrides": [o for o in overrides if not o.startswith("model.path=")], "stop_after": stop_after,
                          "command": check["command"], "sha256": check["sha256"], "heldout": check["heldout"],
                          "sft": check["sft"], "machine": check["machine"]}
    write_manifest(base, m)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m learner.sft",
        description="Bootstrap the embedded base policy: SFT a tiny Qwen2 on an imperfect teacher's "
        "step-by-step traces of the task (addition or chain), evaluate it on the held-out split and save it (HF format) to "
        "model.path. Settings: model.bootstrap.* (see python -m common.config --help).",
    )
    ap.add_argument("config", nargs="?", default=None, help="config YAML (default: built-in defaults)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.bootstrap.max_steps=100")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when model.path already holds a model")
    ap.add_argument("--stop-after", type=int, default=None, metavar="N",
                    help="end after N steps of the model.bootstrap.max_steps schedule (a shorter check build of a base)")
    ap.add_argument("--record-check", metavar="BASE_DIR", default=None,
                    help="this is a short check build of BASE_DIR (e.g. fewer max_steps): store its command and "
                    "held-out figures as BASE_DIR/manifest.json's rebuild_check, which the rebuild test compares with")
    args = ap.parse_args(argv)
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not Path(path).is_file():
        path, overrides = None, [path, *overrides]
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"sft: config error: {e}", file=sys.stderr)
        return 2
    if args.if_missing and (Path(cfg.model.path) / "config.json").is_file():
        print(f"sft: {cfg.model.path} exists; nothing to do (--if-missing)")
        return 0
    try:
        command = shlex.join(["python", "-m", "learner.sft", *(sys.argv[1:] if argv is None else argv)])
        stats = run(cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True), command=command,
                    stop_after=args.stop_after)
    except ValueError as e:
        print(f"sft: {e}", file=sys.stderr)
        return 2
    if args.record_check:
        record_check(Path(args.record_check), Path(cfg.model.path), overrides, args.stop_after)
    summary = {k: v for k, v in stats.items() if k not in ("task", "bootstrap", "eval")}
    if "eval" in stats:
        ev = stats["eval"]
        summary.update({f"avg@{ev['k']}": ev["avg_at_k"], "greedy_accuracy": ev["greedy_accuracy"],
                        "response_length": [ev["min_response_length"], ev["max_response_length"]]})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
