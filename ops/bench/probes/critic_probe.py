"""Research probe: how much reward variance can the critic explain on fresh groups of the base policy?

    .venv/bin/python -m ops.bench.probes.critic_probe [--model DIR] [--train-groups 256] [--fresh-groups 64]
        [--variant name:key=value,key=value ...] [--plot docs/critic_values.png] [key=value ...]

Samples G responses per training prompt from the frozen base policy (learner.evaluate's batched KV-cache
sampler, temperature ``actors.temperature``), verifies them with the task, and keeps a training pool and a
disjoint fresh set (different prompts, never trained on). Each variant then builds a critic with the
project's own code (``learner.models.build_critic``: backbone initialised from the policy + fp32
value head) and trains it like ``learner.value_pretrain`` does (``learner.update.critic_update`` on
batches of ``value_pretrain.batch_groups`` groups cut from the pool, cycling over it, λ = 1 targets).
Every ``--eval-every`` steps it records the explained variance (EV) on the fresh set and on the batch it is
about to train on. The baseline is the first variant (the config as given); the others override config keys
(``value_pretrain.lr``, ``learner.critic_warmup_steps``, ``learner.value_head_init_std``, ...) and the probe
keys ``steps`` (critic updates) and ``pool`` (groups of the pool used; fewer = more epochs).

``--plot`` draws V(s_t) along a few failed and successful fresh responses with the best variant's critic
(the first wrong column should show as a drop). Prints one JSON line: per variant the EV curve and its best
and final fresh EV, plus the ratio best-variant / baseline final fresh EV.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from common import protocol
from common.config import Config, load_config
from common.modeling import load_tokenizer, pad_token_id
from common.tasks import decode_response, encode_prompt, get_task
from common.tasks.addition import teacher_response
from learner.batch import collate
from learner.dist import global_explained_variance, setup_distributed
from learner.evaluate import generate
from learner.forwards import compute_values
from learner.models import build_critic, load_policy_module
from learner.schedule import minibatch_rows
from learner.update import critic_update
from learner.value_pretrain import heldout_ev, value_targets

log = logging.getLogger("critic_probe")


def sample_groups(cfg: Config, first_index: int, n_groups: int, seed: int) -> list[protocol.SampleGroup]:
    """``n_groups`` groups of ``actors.group_size`` verified samples of training prompts from the base policy."""
    task = get_task(cfg.task)
    tok = load_tokenizer(cfg.model.path)
    model = load_policy_module(cfg.model.path).eval()
    prompts = [task.train_prompt(first_index + i) for i in range(n_groups)]
    ids = [encode_prompt(tok, p) for p in prompts]
    out = generate(model, ids, cfg.actors.group_size, cfg.actors.max_new_tokens, cfg.actors.temperature,
                   [tok.eos_token_id], batch_size=512, seed=seed)
    groups = []
    for p, pid, resp in zip(prompts, ids, out, strict=True):
        samples = []
        for r in resp:
            if not r:
                r = [tok.eos_token_id]
            reward = task.verify(p, decode_response(tok, r)).reward
            fin = "stop" if r[-1] == tok.eos_token_id else "length"
            samples.append(protocol.Sample(prompt_ids=np.asarray(pid, np.int32), output_ids=np.asarray(r, np.int32),
                                           output_logprobs=np.zeros(len(r), np.float32), reward=float(reward),
                                           finish_reason=fin, weight_version=0, response_length=len(r)))
        groups.append(protocol.SampleGroup(group_id=p.prompt_id, prompt_id=p.prompt_id, task=task.name, actor_id=0,
                                           samples=samples, created_at=time.time()))
    return groups


def train_variant(cfg: Config, pool: list[protocol.SampleGroup], fresh: Any, steps: int, eval_every: int,
                  pad: int) -> tuple[dict[str, Any], Any]:
    torch.manual_seed(cfg.run.seed)
    vp, lc = cfg.value_pretrain, cfg.learner
    critic = build_critic(cfg, lr=vp.lr)
    mbs = lc.micro_batch_size
    ev0, _ = heldout_ev(critic, fresh, cfg.algo.gamma, mbs)
    curve: list[dict[str, float]] = [{"step": 0, "fresh_ev": round(ev0, 4)}]
    best = (ev0, 0)
    rng = np.random.default_rng(cfg.run.seed)
    order: list[int] = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        if len(order) < vp.batch_groups:  # a new epoch over the pool
            order += rng.permutation(len(pool)).tolist()
        take, order = order[: vp.batch_groups], order[vp.batch_groups :]
        batch = collate([pool[i] for i in take], pad)
        mbr = minibatch_rows(batch.size, lc.mini_batches, cfg.run.seed + 7919, step)
        rows = torch.arange(batch.size)
        old = compute_values(critic, batch, rows, mbs)
        returns = value_targets(batch, old, cfg.algo.gamma)
        train_ev, _ = global_explained_variance(old, returns, batch.mask)
        critic_update(critic, batch, minibatches=mbr, returns=returns, old_values=old, epochs=lc.ppo_epochs, limits=mbs)
        if step % eval_every == 0 or step == steps:
            ev, vmean = heldout_ev(critic, fresh, cfg.algo.gamma, mbs)
            curve.append({"step": step, "fresh_ev": round(ev, 4), "batch_ev": round(train_ev, 4),
                          "value_mean": round(vmean, 3)})
            if ev > best[0]:
                best = (ev, step)
            log.info("step %d fresh EV %.4f batch EV %.4f V̄ %.3f (%.0f s)", step, ev, train_ev, vmean,
                     time.perf_counter() - t0)
    res = {"curve": curve, "final_fresh_ev": curve[-1]["fresh_ev"], "best_fresh_ev": round(best[0], 4),
           "best_step": best[1], "seconds": round(time.perf_counter() - t0, 1)}
    return res, critic


def plot_values(critic: Any, fresh_groups: list[protocol.SampleGroup], fresh: Any, cfg: Config, path: Path) -> dict[str, Any]:
    """V(s_t) along 3 failed and 2 successful fresh responses (longest first, ≥ 3 columns), and the mean
    value change at the first wrong column line of every failed response whose trace we can check."""
    import matplotlib  # noqa: PLC0415 - plots only; the Agg backend is chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - plots only; the Agg backend is chosen first


    tok = load_tokenizer(cfg.model.path)
    task = get_task(cfg.task)
    values = compute_values(critic, fresh, torch.arange(fresh.size), cfg.learner.micro_batch_size)
    samples = [(g, s) for g in fresh_groups for s in g.samples]
    drops, rows_info = [], []
    for i, (g, s) in enumerate(samples):
        idx = int(g.prompt_id.split(":")[-1])
        prompt = task.train_prompt(idx)
        text = [decode_response(tok, [int(t)]) for t in s.output_ids]
        first_bad = _first_wrong_digit(prompt, text)
        n = len(s.output_ids)
        v = values[i, :n].numpy()
        rows_info.append((i, s.reward, first_bad, n))
        if s.reward < 1 and first_bad is not None and 0 < first_bad < n - 1:
            # V(s_t) is the value before token t: the wrong digit is token first_bad, so it shows at first_bad+1.
            drops.append(float(v[first_bad + 1] - v[first_bad]))
    fails = sorted([r for r in rows_info if r[1] < 1 and r[2] is not None], key=lambda r: -r[3])[:3]
    wins = sorted([r for r in rows_info if r[1] >= 1], key=lambda r: -r[3])[:2]
    fig, axes = plt.subplots(len(fails) + len(wins), 1, figsize=(11, 2.1 * (len(fails) + len(wins))), squeeze=False)
    for ax, (i, reward, first_bad, n) in zip(axes[:, 0], fails + wins, strict=False):
        g, s = samples[i]
        chars = [decode_response(tok, [int(t)]) for t in s.output_ids]
        ax.plot(range(n), values[i, :n].numpy(), marker=".", color="tab:red" if reward < 1 else "tab:green")
        if first_bad is not None and reward < 1:
            ax.axvline(first_bad + 0.5, color="k", ls="--", lw=0.8)
        ax.set_xticks(range(n))
        ax.set_xticklabels([c if c != "\n" else "⏎" for c in chars], fontsize=6)
        ax.set_ylim(-0.1, 1.1)
        ax.set_ylabel("V(s_t)")
        prompt_text = task.train_prompt(int(g.prompt_id.split(":")[-1])).text.strip()
        ax.set_title(f"{prompt_text}  reward {reward:.0f}" + (" (dashed: first wrong digit)" if reward < 1 else ""),
                     fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    d = np.asarray(drops) if drops else np.zeros(1)
    return {"plot": str(path), "failed_checked": len(drops), "mean_value_change_at_first_wrong_digit": round(float(d.mean()), 4),
            "fraction_dropping": round(float((d < 0).mean()), 3)}


def _first_wrong_digit(prompt: Any, chars: list[str]) -> int | None:
    """Token index where the response first leaves the correct trace (a wrong column sum, carry or copied
    operand digit); None when it never does (or only by stopping early/late)."""
    want = teacher_response(prompt)
    text = "".join(chars)
    for j, (a, b) in enumerate(zip(text, want, strict=False)):
        if a != b:
            return j if j < len(chars) else None
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="ops/configs/default.yaml")
    ap.add_argument("--model", default=None, help="base policy dir (default: the config's model.path)")
    ap.add_argument("--train-groups", type=int, default=256, help="groups in the training pool")
    ap.add_argument("--fresh-groups", type=int, default=64, help="fresh (unseen-prompt) groups for EV")
    ap.add_argument("--steps", type=int, default=50, help="critic updates per variant")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--cache", default=None, help="reuse/store sampled groups in this protocol-bytes file")
    ap.add_argument("--variant", action="append", default=[],
                    help="name:key=value,key=value (config keys, or steps=N / pool=N); repeatable")
    ap.add_argument("--plot", default=None, help="PNG of V(s_t) along fresh responses (best variant)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--critic", default=None,
                    help="a saved critic (e.g. runs/<name>/critic_pretrained): no training, report its EV on fresh "
                         "groups of prompts from --first-index on and --plot its values")
    ap.add_argument("--first-index", type=int, default=0,
                    help="first training-prompt index sampled (use a large one so --critic sees unseen prompts)")
    ap.add_argument("overrides", nargs="*", help="config key=value for every variant")
    return ap.parse_args(argv)


def load_groups(args: argparse.Namespace, cfg: Config, n_all: int) -> list[protocol.SampleGroup]:
    """The sampled groups: read from ``--cache`` when it exists, else sampled (and stored there if given)."""
    if args.cache and Path(args.cache).is_file():
        frame = Path(args.cache).read_bytes()
        return protocol.decode_as(frame, protocol.BatchReply, max_frame_bytes=len(frame)).groups
    groups = sample_groups(cfg, args.first_index, n_all, cfg.run.seed)
    if args.cache:
        Path(args.cache).write_bytes(protocol.encode_batch_reply([protocol.encode(g) for g in groups], 0, 0))
    return groups


def score_critic(args: argparse.Namespace, cfg: Config, fresh_groups: list[protocol.SampleGroup], fresh: Any,
                 rewards: list[float]) -> dict[str, Any]:
    """``--critic``: the saved critic's EV on the fresh groups (and its values plotted), no training."""
    critic = build_critic(cfg, args.critic)
    ev, vmean = heldout_ev(critic, fresh, cfg.algo.gamma, cfg.learner.micro_batch_size)
    out = {"bench": "critic_probe", "critic": args.critic, "fresh_groups": args.fresh_groups,
           "first_index": args.first_index, "base_reward_mean": round(float(np.mean(rewards)), 4),
           "fresh_ev": round(ev, 4), "value_mean": round(vmean, 4)}
    if args.plot:
        out["plot"] = plot_values(critic, fresh_groups, fresh, cfg, Path(args.plot))
    return out


def compare_variants(args: argparse.Namespace, cfg: Config, overrides: list[str], pool_all: list[protocol.SampleGroup],
                     fresh: Any, pad: int) -> tuple[dict[str, Any], str | None, float, Any]:
    """Train the baseline and each ``--variant`` on the pool: (results by variant, best variant, its final fresh
    EV, its critic)."""
    variants = [("baseline", "")] + [tuple(v.split(":", 1)) if ":" in v else (v, "") for v in args.variant]
    results: dict[str, Any] = {}
    best_name, best_critic, best_ev = None, None, -1e9
    for name, spec in variants:
        kv = [x for x in spec.split(",") if x]
        steps = next((int(x.split("=")[1]) for x in kv if x.startswith("steps=")), args.steps)
        pool_n = next((int(x.split("=")[1]) for x in kv if x.startswith("pool=")), len(pool_all))
        vcfg = load_config(args.config, overrides + [x for x in kv if not x.startswith(("steps=", "pool="))])
        log.info("variant %s: %s (steps %d, pool %d)", name, spec or "config as given", steps, pool_n)
        res, critic = train_variant(vcfg, pool_all[:pool_n], fresh, steps, args.eval_every, pad)
        res["spec"] = spec
        results[name] = res
        if res["final_fresh_ev"] > best_ev:
            best_name, best_critic, best_ev = name, critic, res["final_fresh_ev"]
    return results, best_name, best_ev, best_critic


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("learner").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    over = list(args.overrides) + ([f"model.path={args.model}"] if args.model else [])
    cfg = load_config(args.config, over)
    if not Path(cfg.model.path).is_dir():
        print(f"model {cfg.model.path} not found (python -m learner.sft {args.config})", file=sys.stderr)
        return 2
    n_all = args.train_groups + args.fresh_groups
    t0 = time.perf_counter()
    groups = load_groups(args, cfg, n_all)
    if len(groups) < n_all:
        print(f"cache holds {len(groups)} groups < {n_all}", file=sys.stderr)
        return 2
    sample_s = time.perf_counter() - t0
    pool_all, fresh_groups = groups[: args.train_groups], groups[args.train_groups : n_all]

    setup_distributed(cfg)
    pad = pad_token_id(load_tokenizer(cfg.model.path))
    fresh = collate(fresh_groups, pad)
    rewards = [s.reward for g in groups[:n_all] for s in g.samples]
    log.info("sampled %d groups in %.0f s, mean reward %.3f", n_all, sample_s, float(np.mean(rewards)))
    if args.critic:
        print(json.dumps(score_critic(args, cfg, fresh_groups, fresh, rewards)))
        return 0
    results, best_name, best_ev, best_critic = compare_variants(args, cfg, over, pool_all, fresh, pad)
    out: dict[str, Any] = {
        "bench": "critic_probe", "model": cfg.model.path, "train_groups": args.train_groups,
        "fresh_groups": args.fresh_groups, "group_size": cfg.actors.group_size,
        "base_reward_mean": round(float(np.mean(rewards)), 4), "sample_seconds": round(sample_s, 1),
        "variants": results, "best_variant": best_name,
        "ratio_best_vs_baseline_final_fresh_ev": round(best_ev / results["baseline"]["final_fresh_ev"], 3)
        if results["baseline"]["final_fresh_ev"] > 0 else None,
    }
    if args.plot and best_critic is not None:
        out["plot"] = plot_values(best_critic, fresh_groups, fresh, cfg, Path(args.plot))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
