"""``ops/setup.sh --cuda``'s checks (``ops/setup_checks.py``) with the inputs of the machines they guard
against, and the real ``setup.sh --cuda`` on this (GPU-less) machine: it stops before creating or installing
anything, naming the missing driver. Nothing here installs a CUDA torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ops import setup_checks as sc

ROOT = Path(__file__).resolve().parents[2]


def test_python_and_glibc_floors() -> None:
    assert sc.check_python((3, 11, 9)) is None and sc.check_python((3, 12, 0)) is None
    assert "Python 3.10.12 is too old" in sc.check_python((3, 10, 12))  # Ubuntu 22.04's python3
    assert sc.check_glibc("glibc 2.36") is None and sc.check_glibc("glibc 2.34") is None
    assert "glibc 2.31 is too old" in sc.check_glibc("glibc 2.31")  # Ubuntu 20.04, Debian 11
    assert "glibc 2.17 is too old" in sc.check_glibc("glibc 2.17")  # CentOS 7
    assert "no glibc found" in sc.check_glibc(None)  # musl (Alpine)


def test_driver_for_cuda_13() -> None:
    assert sc.check_driver("580.82.07") is None and sc.check_driver("590.1") is None
    assert "driver 570.172.08 is too old for CUDA 13: it needs >= 580.65.6" in sc.check_driver("570.172.08")
    assert "driver 535.104.05 is too old" in sc.check_driver("535.104.05")
    assert "no NVIDIA driver found" in sc.check_driver(None)
    assert sc.check_driver("535.104.05", cuda_major=12) is None


def test_torch_sees_a_gpu_after_install() -> None:
    assert sc.check_torch("13.0", True, "580.82.07") is None
    assert "CPU build" in sc.check_torch(None, False, "580.82.07")
    msg = sc.check_torch("13.0", False, "570.86.10")
    assert "is_available() is False with driver 570.86.10" in msg and "needs driver >= 580.65.6" in msg


def test_this_machine_passes_the_python_and_glibc_checks() -> None:
    # The CPU machines these tests run on are the floor's reference: Debian 12, Python 3.11.
    assert sc.check_python(sys.version_info[:3]) is None
    assert sc.check_glibc(sc.glibc_version()) is None


def test_setup_cuda_without_a_driver_stops_before_installing(tmp_path: Path) -> None:
    if sc.driver_version() is not None:
        pytest.skip("this machine has an NVIDIA driver: setup.sh --cuda would install for real")
    venv = tmp_path / "venv"
    p = subprocess.run(["bash", str(ROOT / "ops" / "setup.sh"), "--cuda"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "VAPO_VENV": str(venv), "PYTHON": shutil.which("python3") or sys.executable})
    assert p.returncode == 1
    assert "ops/setup.sh: no NVIDIA driver found" in p.stderr and "VAPO_SETUP_NO_GPU=1" in p.stderr
    assert not venv.exists()  # nothing created, nothing downloaded


def test_after_install_check_refuses_a_cpu_torch() -> None:
    # The venv these tests run in has the CPU build: exactly what `after` must refuse on a GPU machine.
    p = subprocess.run([sys.executable, "-m", "ops.setup_checks", "after"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in os.environ.items() if k != "VAPO_SETUP_NO_GPU"})
    assert p.returncode == 1 and "the installed torch is a CPU build" in p.stderr
