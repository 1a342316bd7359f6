"""Two CPU ranks (torchrun or the DeepSpeed launcher, gloo, real subprocesses) give the same update as one rank on the same batch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.train import Learner
from tests.learner.synth import child_env, synth_groups
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]

OVERRIDES = ["learner.batch_groups=4", "learner.mini_batches=2", "learner.micro_batch_size=3",
             "learner.actor_lr=1e-3", "learner.critic_lr=2e-3", "algo.alpha=0.5", "metrics.prometheus=false",
             "learner.value_head_init_std=0.02"]

HARNESS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import torch
    from safetensors.torch import save_file
    from common.config import load_config
    from learner.data import ListSource
    from learner.engines import rank
    from learner.train import Learner
    from tests.learner.synth import child_env, synth_groups

    model, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    cfg = load_config(None, [f"model.path={{model}}", *{overrides!r}])
    src = ListSource(synth_groups(4, 4, 60, seed=21)) if rank() == 0 else None
    learner = Learner(cfg, src)
    learner.step()                                        # fetched on rank 0, broadcast to rank 1
    learner.step(synth_groups(1, 3, 60, seed=22))         # 3 rows: rank 1 has none in one mini-batch
    if rank() == 0:
        sd = {{"p." + k: v.clone().contiguous() for k, v in learner.policy.module.state_dict().items()}}
        sd.update({{"c." + k: v.clone().contiguous() for k, v in learner.critic.module.state_dict().items()}})
        save_file(sd, out)
""")


def _one_rank(model: Path) -> dict[str, torch.Tensor]:
    from common.config import load_config
    from learner.data import ListSource

    cfg = load_config(None, [f"model.path={model}", *OVERRIDES])
    learner = Learner(cfg, ListSource(synth_groups(4, 4, 60, seed=21)))
    learner.step()
    learner.step(synth_groups(1, 3, 60, seed=22))
    sd = {"p." + k: v.clone() for k, v in learner.policy.module.state_dict().items()}
    sd.update({"c." + k: v.clone() for k, v in learner.critic.module.state_dict().items()})
    return sd


def _two_ranks(model: Path, tmp_path: Path, shm: bool, deepspeed_launcher: bool) -> dict[str, torch.Tensor]:
    harness = tmp_path / "dist_harness.py"
    harness.write_text(HARNESS.format(repo=str(REPO), overrides=OVERRIDES))
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
    return load_file(str(out))


def _compare(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor]) -> None:
    assert one.keys() == two.keys()
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    # Adam steps of size ~lr = 1e-3: a wrong normaliser or rank share shows as ~1e-3, reduction order as ~1e-6.
    assert diff < 2e-5, diff


def test_two_ranks_equal_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    two = _two_ranks(tiny_model_dir, tmp_path, shm=False, deepspeed_launcher=False)
    _compare(_one_rank(tiny_model_dir), two)


@pytest.mark.slow
def test_two_ranks_deepspeed_launcher_with_shm_allreduce(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Same under the DeepSpeed launcher, with DeepSpeed's shared-memory all-reduce op (JIT-built once into
    TORCH_EXTENSIONS_DIR: ~80 s the first time, which is why this is slow)."""
    two = _two_ranks(tiny_model_dir, tmp_path, shm=True, deepspeed_launcher=True)
    _compare(_one_rank(tiny_model_dir), two)
