"""Two CPU ranks (torchrun or the DeepSpeed launcher, gloo, real subprocesses) give the same update as one
rank on the same batch; under ZeRO-3 they run the same number of forwards whatever their rows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.synthetic import synth_groups
from learner.train import Learner
from tests.learner.synth import child_env
from tests.learner.train_fixtures import zero3_data
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]

OVERRIDES = ["learner.batch_groups=4", "learner.mini_batches=2", "learner.micro_batch_size=3",
             "learner.actor_lr=1e-3", "learner.critic_lr=2e-3", "algo.alpha=0.5", "metrics.prometheus=false",
             "learner.value_head_init_std=0.02"]

HARNESS = textwrap.dedent("""
    import json, sys
    import torch
    from safetensors.torch import save_file
    from common.config import load_config
    from learner.data import ListSource
    from learner.dist import rank
    from learner.train import Learner
    from learner.synthetic import synth_groups
    from tests.learner.synth import child_env

    model, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    GRADS = {grads!r}
    cfg = load_config(None, [f"model.path={{model}}", *{overrides!r}])
    src = ListSource(synth_groups(4, 4, 60, seed=21)) if rank() == 0 else None
    learner = Learner(cfg, src)
    s1 = learner.step()                                   # fetched on rank 0, broadcast to rank 1
    s2 = learner.step(synth_groups(1, 3, 60, seed=22))    # 3 rows: rank 1 has none in one mini-batch
    if rank() == 0:
        sd = {{"p." + k: v.clone().contiguous() for k, v in learner.policy.module.state_dict().items()}}
        sd.update({{"c." + k: v.clone().contiguous() for k, v in learner.critic.module.state_dict().items()}})
        save_file(sd, out)
        with open(out + ".stats.json", "w") as fh:
            json.dump([{{k: s[k] for k in GRADS}} for s in (s1, s2)], fh)
    from learner.dist import exit_process  # no interpreter finalisation: gloo's threads can abort it
    exit_process(0)
""")

# Gradient norms before clipping, per step (mean over its mini-batches): AdamW moves parameters by ~lr
# whatever the gradient's scale, so a lost or doubled normaliser (world size, token count) shows in these
# and hardly in the parameters.
GRADS = ("actor_grad_norm", "critic_grad_norm")


# K_v critic mini-batches dealt apart from the actor's: with value clipping the pre-update values every rank
# computed for the actor's deal must reach the rank that trains on each row; without, the EV is read from the
# critic update's own rows.
CRITIC_UPDATES = {"actor_cut": [], "kv_clipped": ["learner.critic_updates=3", "algo.value_clip=0.2"],
                  "kv": ["learner.critic_updates=3"]}
STATS = (*GRADS, "value_explained_variance")


def _one_rank(model: Path, extra: list[str]) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    from common.config import load_config
    from learner.data import ListSource

    cfg = load_config(None, [f"model.path={model}", *OVERRIDES, *extra])
    learner = Learner(cfg, ListSource(synth_groups(4, 4, 60, seed=21)))
    stats = [learner.step(), learner.step(synth_groups(1, 3, 60, seed=22))]
    sd = {"p." + k: v.clone() for k, v in learner.policy.module.state_dict().items()}
    sd.update({"c." + k: v.clone() for k, v in learner.critic.module.state_dict().items()})
    return sd, [{k: s[k] for k in STATS} for s in stats]


def _two_ranks(model: Path, tmp_path: Path, shm: bool, deepspeed_launcher: bool,
               extra: list[str]) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    import json

    harness = tmp_path / "dist_harness.py"
    harness.write_text(HARNESS.format(overrides=[*OVERRIDES, *extra], grads=STATS))
    out = tmp_path / "two_ranks.safetensors"
    env = child_env(OMP_NUM_THREADS="1", VAPO_DS_SHM="1" if shm else "0")
    if deepspeed_launcher:  # adds --local_rank=N to our arguments; ~15 s slower to start than torchrun
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(harness), str(model), str(out)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(harness), str(model), str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    return load_file(str(out)), json.loads(Path(f"{out}.stats.json").read_text())


def _compare(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor],
             grads_one: list[dict[str, float]] | None = None, grads_two: list[dict[str, float]] | None = None) -> None:
    assert one.keys() == two.keys()
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    # Adam steps of size ~lr = 1e-3: a wrong rank share shows as ~1e-3, reduction order as ~1e-6; a uniform
    # gradient scale hardly shows here (Adam divides it out), hence the gradient norms below.
    assert diff < 2e-5, diff
    if grads_one is not None and grads_two is not None:
        assert len(grads_one) == len(grads_two)
        for a, b in zip(grads_one, grads_two, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (k, a[k], b[k])


@pytest.mark.parametrize("critic_cut", list(CRITIC_UPDATES))
def test_two_ranks_equal_one_rank(tiny_model_dir: Path, tmp_path: Path, critic_cut: str) -> None:
    extra = CRITIC_UPDATES[critic_cut]
    two, g2 = _two_ranks(tiny_model_dir, tmp_path, shm=False, deepspeed_launcher=False, extra=extra)
    one, g1 = _one_rank(tiny_model_dir, extra)
    assert all("value_explained_variance" in g for g in g1 + g2)
    _compare(one, two, g1, g2)


@pytest.mark.slow
def test_two_ranks_deepspeed_launcher_with_shm_allreduce(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Same under the DeepSpeed launcher, with DeepSpeed's shared-memory all-reduce op (JIT-built once into
    TORCH_EXTENSIONS_DIR: ~80 s the first time, which is why this is slow)."""
    two, g2 = _two_ranks(tiny_model_dir, tmp_path, shm=True, deepspeed_launcher=True, extra=[])
    one, g1 = _one_rank(tiny_model_dir, [])
    _compare(one, two, g1, g2)


# ZeRO-3: every forward gathers parameters across ranks, so both ranks must run exactly as many forwards
# (and LM-head chunks) in every phase. Very unequal rows (one group of 120-150-token responses, four of
# 1-8), an odd row count, replayed positives, a token budget and small LM-head chunks make the ranks' own
# work differ; the fillers must even the counts out. Activation checkpointing runs under ZeRO-3 here too, and
# the critic's own K_v = 3 mini-batches (a row count a rank can lack) with a value pass (value clipping).
ZERO3 = ["learner.zero_stage=3", "learner.batch_groups=5", "learner.mini_batches=2", "learner.micro_batch_size=2",
         "learner.critic_updates=3", "algo.value_clip=0.2",
         "learner.micro_batch_tokens=300", "learner.logits_chunk_elements=480", "nll.replay_fraction=0.5",
         "learner.actor_lr=1e-3", "learner.critic_lr=2e-3", "algo.alpha=0.5", "metrics.prometheus=false",
         "learner.value_head_init_std=0.02", "learner.activation_checkpointing=true"]

ZERO3_HARNESS = textwrap.dedent("""
    import json, sys
    from safetensors.torch import save_file
    from common.config import load_config
    from learner.data import ListSource
    from learner.dist import rank
    from learner.models import full_state_dict
    from learner.train import Learner
    from tests.learner.train_fixtures import zero3_data

    model, out, overrides = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    cfg = load_config(None, [f"model.path={{model}}", *json.loads(overrides)])
    groups, positives, odd = zero3_data()
    learner = Learner(cfg, ListSource(groups, positives=positives) if rank() == 0 else None)
    counts = {{"policy": 0, "critic": 0, "lm_head": 0}}
    def counter(key):
        def hook(*_):
            counts[key] += 1
        return hook
    learner.policy.module.register_forward_pre_hook(counter("policy"))
    learner.critic.module.register_forward_pre_hook(counter("critic"))
    learner.policy.module.get_output_embeddings().register_forward_pre_hook(counter("lm_head"))
    s1 = learner.step()                                   # fetched on rank 0 (+ replayed positives)
    s2 = learner.step(odd)                                # 3 rows: one mini-batch has a single row
    sd = {{"p." + k: v.clone().contiguous() for k, v in full_state_dict(learner.policy).items()}}
    sd.update({{"c." + k: v.clone().contiguous() for k, v in full_state_dict(learner.critic).items()}})
    if rank() == 0:
        save_file(sd, out)
    with open(out + f".counts{{rank()}}.json", "w") as fh:
        json.dump({{**counts, "replay_positives": s1["replay_positives"]}}, fh)
    with open(out + f".stats{{rank()}}.json", "w") as fh:
        json.dump([{{k: s[k] for k in ("actor_grad_norm", "critic_grad_norm")}} for s in (s1, s2)], fh)
    from learner.dist import exit_process  # no interpreter finalisation: gloo's threads can abort it
    exit_process(0)
""")


def test_zero3_two_ranks_unequal_rows_run_equal_forwards_and_equal_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json

    from common.config import load_config
    from learner.data import ListSource

    harness = tmp_path / "zero3_harness.py"
    harness.write_text(ZERO3_HARNESS.format())
    out = tmp_path / "zero3.safetensors"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(harness), str(tiny_model_dir), str(out), json.dumps(ZERO3)]
    # A mismatched collective hangs rather than fails (the code before the fillers hung here): the timeout is
    # the failure mode, and it must take the ranks with it (they are torchrun's children, not ours).
    p = subprocess.Popen(cmd, env=child_env(OMP_NUM_THREADS="1", VAPO_DS_SHM="0"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError("2-rank ZeRO-3 run did not finish in 400 s: ranks ran unmatched collectives") from None
    assert p.returncode == 0, (stdout[-2000:], stderr[-4000:])
    c0, c1 = (json.loads(Path(f"{out}.counts{r}.json").read_text()) for r in (0, 1))
    assert c0 == c1 and c0["replay_positives"] > 0 and min(c0.values()) > 0, (c0, c1)

    groups, positives, odd = zero3_data()
    cfg = load_config(None, [f"model.path={tiny_model_dir}", *[o for o in ZERO3 if "zero_stage" not in o]])
    one = Learner(cfg, ListSource(groups, positives=positives))
    g1 = [{k: s[k] for k in GRADS} for s in (one.step(), one.step(odd))]
    ref = {"p." + k: v for k, v in one.policy.module.state_dict().items()}
    ref.update({"c." + k: v for k, v in one.critic.module.state_dict().items()})
    _compare(ref, load_file(str(out)), g1, json.loads(Path(f"{out}.stats0.json").read_text()))
