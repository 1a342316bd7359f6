"""The process group a learner builds: host tensors always have a backend, and one process opens no port.

A CUDA learner used to get an NCCL-only group while the learner's own collectives (token counts, the
broadcast batch) send host tensors, so every multi-GPU run failed at its first collective with "No backend
type associated with device type cpu". NCCL cannot run here; the CUDA backend string is checked as torch
parses it, and the same two-device-type shape (gloo standing in for NCCL) runs the real collectives on
2 CPU ranks.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch.distributed.distributed_c10d import BackendConfig

from learner.dist import process_group_backend
from tests.learner.synth import child_env
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def test_cuda_backend_has_a_host_tensor_backend() -> None:
    cuda = BackendConfig(torch.distributed.Backend(process_group_backend("cuda"))).get_device_backend_map()
    assert cuda == {"cpu": "gloo", "cuda": "nccl"}
    assert process_group_backend("cpu") == "gloo"


HARNESS = textwrap.dedent("""
    import os
    import sys
    import torch
    import learner.dist as dist
    from common.config import load_config

    cfg = load_config(None, [])
    if len(sys.argv) > 1:  # the CUDA layout, with gloo standing in for NCCL on this CPU-only machine
        dist.process_group_backend = lambda device: "cpu:gloo,cuda:gloo"
    dist.setup_distributed(cfg)
    store = torch.distributed.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # torch wraps the store it was given in a PrefixStore
        store = store.underlying_store
    pg = torch.distributed.group.WORLD
    total = dist.all_reduce_sum(torch.tensor([dist.rank() + 1.0]))
    data = dist.broadcast_bytes(b"batch-bytes" if dist.rank() == 0 else None)
    # One write per rank: two ranks share this pipe.
    sys.stdout.write(f"STORE {{type(store).__name__}}\\nCPU_BACKEND {{type(pg._get_backend(torch.device('cpu'))).__name__}}\\n"
                     f"RESULT {{float(total[0])}} {{data.decode()}}\\n"
                     f"BLOCKING_WAIT {{os.environ.get('TORCH_NCCL_BLOCKING_WAIT')}}\\n")
    sys.stdout.flush()
    dist.exit_process(0)  # no interpreter finalisation: gloo's threads can abort it
""")


def _run(tmp_path: Path, ranks: int, cuda_layout: bool) -> list[str]:
    h = tmp_path / "h.py"
    h.write_text(HARNESS.format())
    extra = ["cuda-layout"] if cuda_layout else []
    if ranks == 1:
        cmd = [sys.executable, str(h), *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), str(h), *extra]
    p = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1", VAPO_DS_SHM="0"), capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.splitlines()


def test_two_ranks_with_the_cuda_layout_reduce_host_tensors(tmp_path: Path) -> None:
    out = _run(tmp_path, 2, cuda_layout=True)
    assert out.count("RESULT 3.0 batch-bytes") == 2  # 1 + 2 summed on both ranks; rank 0's bytes on both
    assert out.count("CPU_BACKEND ProcessGroupGloo") == 2


def test_ranks_on_one_host_meet_in_a_file(tmp_path: Path, monkeypatch) -> None:
    # ops/launch.py names the file for a one-host learner: no TCP store listening on every interface.
    monkeypatch.setenv("VAPO_STORE_FILE", str(tmp_path / "store"))
    out = _run(tmp_path, 2, cuda_layout=False)
    assert out.count("STORE FileStore") == 2 and out.count("RESULT 3.0 batch-bytes") == 2


def test_one_process_uses_an_in_process_store(tmp_path: Path) -> None:
    # No TCPStore: a lone learner must not listen on a network port that no config key sets.
    out = _run(tmp_path, 1, cuda_layout=False)
    assert "STORE HashStore" in out and "RESULT 1.0 batch-bytes" in out
    # Given its value before any NCCL thread runs: the weight-update group changes it for a moment only
    # (common.weight_bucket.seed_nccl_env), torch's default for the learner's own groups.
    assert "BLOCKING_WAIT 0" in out
