"""``ops/slurm/vapo.sbatch`` outside Slurm: what it hands ``ops/launch.sh`` for an allocation, with
``scontrol`` and ``getent`` answering as a cluster's would (the rehearsal, ``ops/rehearse.sh``, submits it to a
real Slurm)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _sbatch(tmp_path: Path, node_addr: str, getent: str, gpus: str | None, *args: str,
            restarts: str | None = None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" = "show hostnames" ]; then printf "n0\\nn1\\nn2\\n"; exit 0; fi\n'
        f'if [ "$1 $2" = "show node" ]; then echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1"; '
        f'echo "   NodeAddr={node_addr} NodeHostName=$3 Version=22.05.8"; exit 0; fi\n'
        "exit 1\n")
    (bin_dir / "getent").write_text(f"#!/bin/sh\nprintf '{getent}'\n")
    submit = tmp_path / "submit"
    (submit / "ops").mkdir(parents=True)
    (submit / "ops" / "launch.sh").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    for f in (bin_dir / "scontrol", bin_dir / "getent", submit / "ops" / "launch.sh"):
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(submit),
           "SLURM_JOB_NODELIST": "n[0-2]"}
    env.pop("SLURM_GPUS_ON_NODE", None)
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = gpus
    env.pop("SLURM_RESTART_COUNT", None)
    if restarts is not None:
        env["SLURM_RESTART_COUNT"] = restarts
    return subprocess.run(["bash", str(ROOT / "ops" / "slurm" / "vapo.sbatch"), "cfg.yaml", *args], env=env,
                          capture_output=True, text=True, timeout=30)


def test_host_0_address_comes_from_slurms_node_addr(tmp_path: Path) -> None:
    p = _sbatch(tmp_path, "10.1.0.7", "127.0.1.1 STREAM n0\\n", "8", "learner.total_steps=3")
    assert p.returncode == 0, p.stderr
    args = p.stdout.splitlines()
    assert args[0] == "cfg.yaml"
    assert "placement.hosts=[n0,n1,n2]" in args and "placement.master_addr=10.1.0.7" in args
    assert "buffer.ingest_addr=tcp://10.1.0.7:5555" in args and "placement.gpus_per_host=8" in args
    # the weight push's too: learner rank 0 binds them only after value pretraining (no placeholder left)
    assert "learner.push_addr=tcp://10.1.0.7:5559" in args and "learner.push_master_address=10.1.0.7" in args
    assert args[-1] == "learner.total_steps=3"  # the user's overrides come last, so they win


def test_host_0_address_falls_back_to_getent_without_loopback(tmp_path: Path) -> None:
    # NodeAddr = the host name (slurm.conf gave none): resolve it, skipping Debian's 127.0.1.1 entry.
    p = _sbatch(tmp_path, "n0", "127.0.1.1 STREAM n0\\n10.1.0.9 STREAM n0\\n", None)
    assert p.returncode == 0, p.stderr
    args = p.stdout.splitlines()
    assert "placement.master_addr=10.1.0.9" in args
    assert not any(a.startswith("placement.gpus_per_host=") for a in args)  # a CPU allocation keeps its slots


def test_no_routable_address_of_host_0_is_an_error(tmp_path: Path) -> None:
    p = _sbatch(tmp_path, "n0", "127.0.1.1 STREAM n0\\n", "8")
    assert p.returncode == 1 and "non-loopback IPv4 address of host 0 (n0)" in p.stderr


def test_a_requeued_job_resumes_its_run(tmp_path: Path) -> None:
    first = _sbatch(tmp_path / "first", "10.1.0.7", "", "8", "run.name=r", "run.max_resumes=2", restarts="0")
    assert first.returncode == 0, first.stderr
    assert "--resume" not in first.stdout.splitlines()
    again = _sbatch(tmp_path / "again", "10.1.0.7", "", "8", "run.name=r", "run.max_resumes=2", restarts="1")
    assert again.returncode == 0, again.stderr
    args = again.stdout.splitlines()
    assert args[0] == "cfg.yaml" and "--resume" in args and args[-2:] == ["run.name=r", "run.max_resumes=2"]
