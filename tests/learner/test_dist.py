"""learner.dist on two real CPU ranks (torchrun, gloo; no DeepSpeed): the all-reduced whitening and explained
variance equal the one-process functions over both ranks' rows, frames arrive byte for byte, and
``learner.data.fetch`` hands rank 0 the groups its source decoded while rank 1 decodes the broadcast frames."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from learner import dist
from tests.learner.synth import child_env
from tests.ports import free_port, port_overrides

REPO = Path(__file__).resolve().parents[2]

HARNESS = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    torch.distributed.init_process_group("gloo")          # env:// from torchrun
    from learner import dist
    from learner.data import ListSource, fetch
    from learner.losses import explained_variance, masked_whiten
    from learner.synthetic import synth_groups

    me = dist.rank()
    assert dist.world_size() == 2
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    lengths = torch.tensor([0, 3, 9, 5, 1, 7])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    x = torch.randn(B, T, generator=g) * 3 + 1
    ret = torch.randn(B, T, generator=g)
    mine = torch.arange(me, B, 2)                          # rank 0: rows 0, 2, 4; rank 1: rows 1, 3, 5
    whole = masked_whiten(x, mask)
    torch.testing.assert_close(dist.global_whiten(x[mine], mask[mine]), whole[mine], rtol=0, atol=1e-6)
    ev, mean = dist.global_explained_variance(x[mine], ret[mine], mask[mine])
    ev1, mean1 = explained_variance(x, ret, mask)
    assert abs(ev - ev1) < 1e-12 and abs(mean - mean1) < 1e-12, (ev, ev1, mean, mean1)
    assert dist.global_explained_variance(x[mine], ret[mine], mask[mine]) != explained_variance(x[mine], ret[mine], mask[mine])

    frames = dist.broadcast_frames([b"first", b"", bytes(range(256))] if me == 0 else None)
    assert frames == [b"first", b"", bytes(range(256))], frames
    assert dist.broadcast_ints([-(1 << 40), 7] if me == 0 else None) == [-(1 << 40), 7]

    groups = synth_groups(3, 2, 40, seed=5, p_correct=1.0)
    for s in (s for grp in groups for s in grp.samples):
        s.finish_reason = "stop"                           # 6 finished positives (a truncated one is none)
    positives = [s for grp in synth_groups(2, 2, 40, seed=6) for s in grp.samples]
    src = ListSource(groups, positives) if me == 0 else None
    got, extra = fetch(src, 0, 3, 1.0, replay_fraction=0.5)      # 6 positives in the batch -> 3 replayed
    assert [grp.group_id for grp in got] == [grp.group_id for grp in groups] and len(extra) == 3
    for a, b in zip(got, groups):
        assert all(np.array_equal(s.output_ids, t.output_ids) and s.reward == t.reward
                   for s, t in zip(a.samples, b.samples))
    if me == 0:
        assert all(a is b for a, b in zip(got, groups))          # rank 0 keeps what its source decoded
    assert [np.asarray(s.output_ids).tolist() for s in extra] == [np.asarray(s.output_ids).tolist() for s in positives[:3]]
    sys.stdout.write(f"OK {{me}}\\n")
    sys.stdout.flush()
    from learner.dist import exit_process  # no interpreter finalisation: gloo's threads can abort it
    exit_process(0)
""")


def test_two_ranks_reduce_broadcast_and_fetch_alike(tmp_path: Path) -> None:
    h = tmp_path / "h.py"
    h.write_text(HARNESS.format())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(h)]
    p = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = p.stdout.splitlines()
    assert lines.count("OK 0") == 1 and lines.count("OK 1") == 1, p.stdout


def test_one_process_collectives_are_identities() -> None:
    # Without a process group (or with one of size 1) nothing is sent: the input comes back.
    assert dist.world_size() == 1 and dist.rank() == 0
    x = torch.tensor([1.0, 2.0], dtype=torch.float32)
    y = dist.all_reduce_sum(x)
    assert y.dtype == torch.float64 and y.tolist() == [1.0, 2.0] and y.data_ptr() != x.data_ptr()
    assert dist.broadcast_frames([b"a", b"bc"]) == [b"a", b"bc"]
    assert dist.broadcast_ints([3, -4]) == [3, -4]
    assert dist.broadcast_bytes(b"xyz") == b"xyz"
    assert dist.loss_scale_for_dp() == 1.0


MAIN_HARNESS = textwrap.dedent("""
    import sys
    import torch
    import learner.runner as runner_mod

    class Failing:
        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            return self

        def run(self):
            assert torch.distributed.is_initialized()
            raise RuntimeError("step failed")

    runner_mod.Runner = Failing
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        runner_mod.main(sys.argv[1:])
    except RuntimeError as e:
        print("RAISED", e)
    print("INITIALIZED", torch.distributed.is_initialized(), flush=True)
""")


def test_learner_main_destroys_its_process_group_even_when_a_step_fails(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A gloo group alive at interpreter exit aborts the process in about one exit in six (torch 2.13:
    # "terminate called without an active exception"), so a learner that finished would sometimes die of
    # SIGABRT and the launcher would report it failed. main() must tear the group down on every path.
    # In a process of its own: this one may hold a group other tests left for the next ones.
    h = tmp_path / "main.py"
    h.write_text(MAIN_HARNESS.format())
    p = subprocess.run([sys.executable, str(h), f"run.root={tmp_path}", "run.name=r", f"model.path={tiny_model_dir}",
                        "metrics.prometheus=false", "value_pretrain.enabled=false", *port_overrides()],
                       env=child_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "RAISED step failed" in p.stdout and "INITIALIZED False" in p.stdout, p.stdout
