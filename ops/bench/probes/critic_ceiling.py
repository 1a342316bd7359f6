"""How far is a trainable critic from the oracle? Held-out explained variance of critic variants against the
chain task's oracle on the same fresh groups.

    .venv/bin/python -m ops.bench.probes.critic_ceiling [--config ops/configs/long.yaml] [--train-groups 128]
        [--fresh-groups 32] [--steps 20] [--grown DIR] [--cache FILE] [--only NAME ...] [key=value ...]

Samples G responses per prompt from the frozen base (``ops.bench.probes.critic_probe.sample_groups``), keeps a
training pool and a disjoint fresh set, and reads on the fresh set:

- ``oracle``: ``learner.oracle.ChainOracle`` (V = p^(step lines left), 0 after a mistake; p estimated on the
  pool), the ceiling of a critic that cannot foresee a slip;
- ``steps_only``: the same oracle blind to mistakes (it knows only the step count: p^(step count) throughout);
- each trainable critic, trained like value pretraining (``critic_probe.train_variant``, λ = 1 targets) for
  ``--steps`` updates: ``near_frozen`` (the critic long.yaml shipped before the paper-trained one: backbone
  lr 1e-5 with the surprise head), ``actor_lr`` and ``actor_lr_plain`` (backbone at the actor's lr, surprise
  head on / off), and with ``--grown DIR`` (a ``python -m learner.grow`` copy of the base) ``grown`` (that
  critic at the actor's lr, its inserted blocks at 10x: ``learner.critic_grown_lr_scale``).

Prints one JSON line: the oracle's and each variant's fresh EV (final and best), and each variant's share of
the oracle's EV. The EV is per token, of the Monte-Carlo return (the final reward), as value pretraining
reports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import protocol
from common.config import Config, load_config
from common.modeling import load_tokenizer, pad_token_id
from learner.batch import collate
from learner.dist import setup_distributed
from learner.losses import explained_variance
from learner.oracle import ChainOracle
from learner.value_pretrain import value_targets
from ops.bench.probes.critic_probe import sample_groups, train_variant
from ops.bench.suites.default_suite import SHIPPED_CRITIC

log = logging.getLogger("critic_ceiling")
REPO = Path(__file__).resolve().parents[3]


def variants(cfg: Config, grown: str | None) -> dict[str, list[str]]:
    """The trainable critics compared, as config overrides on top of the given config: each starts from the
    critic long.yaml shipped when this probe was measured (``SHIPPED_CRITIC``), so its figures still read."""
    lr = cfg.learner.actor_lr
    at_actor = [*SHIPPED_CRITIC, f"learner.critic_lr={lr}", f"value_pretrain.lr={lr}"]
    out = {"near_frozen": list(SHIPPED_CRITIC), "actor_lr": [*at_actor, "learner.value_head_surprise=true"],
           "actor_lr_plain": [*at_actor, "learner.value_head_surprise=false"]}
    if grown:
        out["grown"] = [*at_actor, f"model.critic_path={grown}", "learner.critic_grown_lr_scale=10"]
    return out


def oracle_evs(tok: Any, pool: list[protocol.SampleGroup], fresh: Any, gamma: float) -> dict[str, float]:
    """The oracle's and the steps-only oracle's EV on ``fresh``, p estimated on the pool."""
    pad = pad_token_id(tok)
    probe = ChainOracle(tok)
    probe.values(collate(pool, pad))
    p = probe.last_line_accuracy
    returns = value_targets(fresh, torch.zeros(fresh.mask.shape), gamma)
    out = {"line_accuracy": round(p, 4)}
    for name, sees in (("oracle", True), ("steps_only", False)):
        ev, _ = explained_variance(ChainOracle(tok, p, sees_mistakes=sees).values(fresh), returns, fresh.mask)
        out[name] = round(ev, 4)
    return out


def load_or_sample(cfg: Config, n: int, cache: str | None) -> list[protocol.SampleGroup]:
    if cache and Path(cache).is_file():
        frame = Path(cache).read_bytes()
        groups = protocol.decode_as(frame, protocol.BatchReply, max_frame_bytes=len(frame)).groups
        if len(groups) >= n:
            return groups[:n]
    groups = sample_groups(cfg, 0, n, cfg.run.seed)
    if cache:
        Path(cache).write_bytes(protocol.encode_batch_reply([protocol.encode(g) for g in groups], 0, 0))
    return groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops.bench.probes.critic_ceiling", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "ops/configs/long.yaml"), help="a chain-task config")
    ap.add_argument("--train-groups", type=int, default=128, help="groups in the training pool")
    ap.add_argument("--fresh-groups", type=int, default=32, help="fresh (unseen-prompt) groups for EV")
    ap.add_argument("--steps", type=int, default=20, help="critic updates per variant")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--grown", default=None, help="a learner.grow copy of the base: adds the grown variant")
    ap.add_argument("--only", action="append", default=[], help="run only these variants (repeatable)")
    ap.add_argument("--cache", default=None, help="reuse/store the sampled groups in this file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="config key=value for every variant")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("learner").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, list(args.overrides))
    if cfg.task.name != "chain":
        ap.error(f"the oracle reads the chain task's state; {args.config} has task.name={cfg.task.name}")
    t0 = time.perf_counter()
    groups = load_or_sample(cfg, args.train_groups + args.fresh_groups, args.cache)
    pool, fresh_groups = groups[: args.train_groups], groups[args.train_groups :]
    sample_s = time.perf_counter() - t0
    setup_distributed(cfg)
    tok = load_tokenizer(cfg.model.path)
    pad = pad_token_id(tok)
    fresh = collate(fresh_groups, pad)
    out: dict[str, Any] = {"bench": "critic_ceiling", "model": cfg.model.path, "train_groups": len(pool),
                           "fresh_groups": len(fresh_groups), "group_size": cfg.actors.group_size,
                           "reward_mean": round(float(np.mean([s.reward for g in groups for s in g.samples])), 4),
                           "sample_seconds": round(sample_s, 1), **oracle_evs(tok, pool, fresh, cfg.algo.gamma)}
    out["variants"] = {}
    for name, over in variants(cfg, args.grown).items():
        if args.only and name not in args.only:
            continue
        vcfg = load_config(args.config, [*args.overrides, *over])
        log.info("variant %s: %s", name, " ".join(over) or "config as given")
        res, _ = train_variant(vcfg, pool, fresh, args.steps, args.eval_every, pad)
        res["overrides"] = over
        res["share_of_oracle"] = round(res["final_fresh_ev"] / out["oracle"], 3) if out["oracle"] > 0 else None
        out["variants"][name] = res
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
