"""Value pretraining (VAPO §3.1): fit the critic to λ = 1 Monte-Carlo targets with the policy frozen.

    python -m learner.value_pretrain [config.yaml] [key=value ...]     # standalone
    (``python -m learner`` runs it first when value_pretrain.enabled and no checkpoint exists)

The actors sample from the initial policy (nothing new is published while this runs, so every group is
version 0) and the buffer serves their groups. ``value_pretrain.eval_groups`` groups are held out first;
each step trains the critic on a fresh batch of ``value_pretrain.batch_groups`` groups (mini-batches
from learner.mini_batches, one epoch) and measures the explained variance of its values on the held-out
groups. It stops after ``value_pretrain.steps`` or when that explained variance has not improved for
``value_pretrain.patience`` steps, then saves the critic to ``<run dir>/critic_pretrained`` (HF backbone +
``value_head.safetensors``), where the RL learner picks it up. EV and loss go to metrics
(``vapo_learner_value_pretrain_*``) and ``metrics.jsonl``.

Deviation: the critic's own learning rate here is ``value_pretrain.lr``; with γ = 1 and λ = 1 the target
at every real token is the sample's final reward (never the actor's λ-return: that would feed the
critic's own errors back into its targets).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from common.cli import config_from_argv, setup_logging
from common.config import Config
from common.metrics import Metrics
from common.modeling import load_tokenizer, pad_token_id
from common.protocol import SampleGroup
from learner.advantages import gae, terminal_rewards
from learner.batch import collate_scored, fetch_usable, row_limits
from learner.data import DataSource, fetch
from learner.dist import global_explained_variance, rank
from learner.models import build_critic, collect, full_state_dict, release, save_critic
from learner.records import append_jsonl
from learner.update import MicroLimits, compute_values, critic_update, minibatch_rows, my_rows
from learner.weights import load_host_tensors

log = logging.getLogger("learner.value_pretrain")


def _targets(batch: Any, values: torch.Tensor, gamma: float) -> torch.Tensor:
    _, returns = gae(terminal_rewards(batch.scores, batch.mask), values, batch.mask, gamma, 1.0)
    return returns


def heldout_ev(critic: Any, batch: Any, gamma: float, mbs: MicroLimits | int) -> tuple[float, float]:
    """(explained variance, value mean) of the critic on ``batch`` (rows shared across ranks)."""
    everything = [torch.arange(batch.size)]
    rows = my_rows(everything, batch, mbs)
    values = compute_values(critic, batch, everything, mbs)
    return global_explained_variance(values[rows], _targets(batch, values, gamma)[rows], batch.mask[rows])


def _snapshot(critic: Any) -> dict[str, torch.Tensor] | None:
    """A host copy of the critic's full weights on rank 0 (None elsewhere); collective under ZeRO-3.

    Under ZeRO-3 the parameters are gathered a bounded group at a time and only rank 0 keeps a copy: a
    copy on every rank would cost the critic's whole size in host memory per rank at every improvement."""
    state = full_state_dict(critic, copy=True)
    return state if rank() == 0 else None


def pretrain_critic(cfg: Config, source: DataSource | None, out: Path | None = None,
                    metrics: Metrics | None = None) -> Path:
    """Run value pretraining and return the saved critic's directory (reused if it already exists)."""
    vp, lc = cfg.value_pretrain, cfg.learner
    out = out or cfg.run_dir / "critic_pretrained"
    if out.is_dir() and (out / "value_head.safetensors").is_file():
        log.info("value pretraining: reusing %s", out)
        return out
    m = metrics or Metrics("learner")
    pad = pad_token_id(load_tokenizer(cfg.model.path))
    critic = build_critic(cfg, lr=vp.lr)
    mbs = MicroLimits.from_config(lc)
    lim = row_limits(cfg)

    def usable(n: int) -> list[SampleGroup]:  # rows the learner cannot use are dropped, counted, asked for again
        def dropped(reason: str, k: int) -> None:
            m.unusable_samples.labels(reason=reason).inc(k)
            log.warning("value pretraining: dropped %d batch samples the learner cannot use: %s", k, reason)

        return fetch_usable(lambda k: fetch(source, 0, k, lc.batch_timeout_s), n, lim, dropped)[0]

    held = usable(vp.eval_groups)
    held_batch = collate_scored(held, pad, cfg)
    ev0, _ = heldout_ev(critic, held_batch, cfg.algo.gamma, mbs)
    best, since_best, step, best_step = ev0, 0, 0, 0
    # The critic that goes on to RL is the best one on the held-out groups, not the last: patience stops
    # after a run of non-improving steps, and those steps can have made it worse.
    best_state = _snapshot(critic)
    log.info("value pretraining: held-out EV %.4f before training", ev0)
    history: list[dict[str, Any]] = []
    while step < vp.steps and since_best < vp.patience:
        t0 = time.perf_counter()
        groups = usable(vp.batch_groups)
        batch = collate_scored(groups, pad, cfg)
        minibatches = minibatch_rows(batch.size, lc.mini_batches, cfg.run.seed + 7919, step)
        mine = my_rows(minibatches, batch, mbs)
        # λ = 1 targets do not depend on V: no value pass before the update; the training-batch explained
        # variance is read from the update's own forwards (each mini-batch before its own step).
        no_values = torch.zeros(batch.mask.shape)
        returns = _targets(batch, no_values, cfg.algo.gamma)
        seen = torch.zeros(batch.mask.shape)
        st = critic_update(critic, batch, minibatches=minibatches, returns=returns, old_values=no_values, epochs=1,
                           limits=mbs, value_clip=0.0, record=seen)
        train_ev, _ = global_explained_variance(seen[mine], returns[mine], batch.mask[mine])
        step += 1
        ev, vmean = heldout_ev(critic, held_batch, cfg.algo.gamma, mbs)
        if ev > best + 1e-4:
            best, since_best, best_step = ev, 0, step
            best_state = _snapshot(critic)
        else:
            since_best += 1
        rec = {"kind": "value_pretrain", "step": step, "loss": st["critic_loss"], "explained_variance": ev,
               "train_explained_variance": train_ev, "value_mean": vmean, "best_explained_variance": best,
               "grad_norm": st.get("critic_grad_norm", float("nan")), "seconds": time.perf_counter() - t0,
               "time": time.time()}
        history.append(rec)
        m.value_pretrain_step.set(step)
        m.value_pretrain_loss.set(st["critic_loss"])
        m.value_pretrain_explained_variance.set(ev)
        if rank() == 0:
            if cfg.metrics.jsonl:
                append_jsonl(cfg.run_dir / "metrics.jsonl", rec)
            log.info("value pretraining %d/%d: loss %.4f held-out EV %.4f (best %.4f) V̄ %.3f",
                     step, vp.steps, st["critic_loss"], ev, best, vmean)
    if best < vp.min_explained_variance:
        log.warning("value pretraining ended with explained variance %.4f < %.4f", best, vp.min_explained_variance)
    # The best weights go back into the engine (rank 0 holds them; under ZeRO-3 each gathered group is
    # handed to every rank's partition) and are saved from there, one group at a time: no rank builds a
    # second whole critic.
    if rank() == 0 and best_state is None:
        raise RuntimeError("value pretraining: rank 0 has no snapshot of the best critic")
    load_host_tensors(critic, best_state)
    best_state = None
    save_critic(critic, out)
    if rank() == 0:
        (out / "value_pretrain.json").write_text(json.dumps(
            {"steps": step, "best_step": best_step, "explained_variance": best, "initial_explained_variance": ev0}))
        log.info("value pretraining: saved the critic of step %d/%d (held-out EV %.4f) to %s", best_step, step, best, out)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
    # The RL learner builds its policy and critic next: this critic, its gradients and its optimizer
    # states must be gone first, not whenever a garbage collection happens to run.
    release(critic)
    del critic
    collect()
    return out


def main(argv: list[str] | None = None) -> int:
    from learner.data import BufferSource

    cfg = config_from_argv("learner.value_pretrain", __doc__ or "", argv)
    if isinstance(cfg, int):
        return cfg
    setup_logging(cfg.run.log_level)
    source = BufferSource(cfg.buffer.serve_addr, cfg.buffer.max_staleness, curve=cfg.buffer.curve) if rank() == 0 else None
    print(pretrain_critic(cfg, source))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
