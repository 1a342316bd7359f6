"""What ``ops/setup.sh --cuda`` checks, so that it stops with the reason instead of failing later (a pip
resolver's "cannot download sglang", a torch that silently finds no GPU).

    python3 -m ops.setup_checks before   # with the interpreter the venv will use: Python, glibc, driver
    .venv/bin/python -m ops.setup_checks after   # in the new venv: torch is a CUDA build and sees a GPU

Exit 0 when every check passes, 1 with one ``ops/setup.sh: ...`` line per failure. Standard library only
(``before`` runs before anything is installed). ``VAPO_SETUP_NO_GPU=1`` skips the driver and GPU checks
(a login node preparing a shared venv for its GPU hosts).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

MIN_PYTHON = (3, 11)  # vapo's own floor (pyproject) and SGLang's
MIN_GLIBC = (2, 34)  # the manylinux tag of the CUDA wheels SGLang pulls (sgl-kernel, flashinfer)
CUDA_MAJOR = 13  # the CUDA of the torch build that SGLang 0.5.23 pins
# Linux driver each CUDA major version needs at least (NVIDIA's CUDA Toolkit release notes, table 3).
MIN_DRIVER = {13: (580, 65, 6), 12: (525, 60, 13)}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)


def check_python(version: tuple[int, ...]) -> str | None:
    if tuple(version[:2]) < MIN_PYTHON:
        return (f"Python {_fmt(version[:3])} is too old: SGLang and vapo need Python >= {_fmt(MIN_PYTHON)} "
                "(set PYTHON=/path/to/python3.11 for the venv)")
    return None


def check_glibc(version: str | None) -> str | None:
    """``version`` as ``os.confstr('CS_GNU_LIBC_VERSION')`` gives it (``'glibc 2.36'``), None if not glibc."""
    if not version or not version.lower().startswith("glibc"):
        return (f"no glibc found ({version or 'unknown C library'}): SGLang's CUDA wheels are built for glibc >= "
                f"{_fmt(MIN_GLIBC)} (musl distributions such as Alpine cannot run them)")
    v = _version(version)
    if v[:2] < MIN_GLIBC:
        return (f"glibc {_fmt(v)} is too old: SGLang's CUDA wheels need glibc >= {_fmt(MIN_GLIBC)} (e.g. Ubuntu 22.04, "
                "Debian 12, RHEL 9); pip would report only that it cannot find a matching sglang distribution")
    return None


def check_driver(driver: str | None, cuda_major: int = CUDA_MAJOR) -> str | None:
    """``driver`` as nvidia-smi reports it (``'580.82.07'``), None when no driver was found."""
    need = MIN_DRIVER[cuda_major]
    if driver is None:
        return (f"no NVIDIA driver found (nvidia-smi, /proc/driver/nvidia/version): the CUDA {cuda_major} torch that "
                f"SGLang needs runs only with driver >= {_fmt(need)}; on a machine without GPUs use ops/setup.sh, or "
                "VAPO_SETUP_NO_GPU=1 to prepare a shared venv for GPU hosts")
    if _version(driver)[:3] < need:
        return (f"NVIDIA driver {driver} is too old for CUDA {cuda_major}: it needs >= {_fmt(need)} "
                "(upgrade the driver; torch would report no GPU)")
    return None


def check_torch(torch_cuda: str | None, available: bool, driver: str | None) -> str | None:
    """After install: torch is a CUDA build and ``torch.cuda.is_available()``."""
    if torch_cuda is None:
        return "the installed torch is a CPU build (torch.version.cuda is None): pip did not install the CUDA build"
    if not available:
        need = MIN_DRIVER.get(_version(torch_cuda)[0])
        why = f"driver {driver}" if driver else "no NVIDIA driver"
        return (f"torch (CUDA {torch_cuda}) is installed but torch.cuda.is_available() is False with {why}"
                + (f"; CUDA {torch_cuda} needs driver >= {_fmt(need)}" if need else "")
                + " (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
    return None


def glibc_version() -> str | None:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):
        return None


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version, from nvidia-smi or /proc."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            lines = out.stdout.split()
            if out.returncode == 0 and lines:
                return lines[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([\d.]+)", Path("/proc/driver/nvidia/version").read_text())
        return m.group(1) if m else None
    except OSError:
        return None


def run(stage: str) -> list[str]:
    no_gpu = os.environ.get("VAPO_SETUP_NO_GPU") == "1"
    if stage == "before":
        problems = [check_python(sys.version_info[:3]), check_glibc(glibc_version())]
        if not no_gpu:
            problems.append(check_driver(driver_version()))
    else:
        import torch  # noqa: PLC0415 - the 'before' checks run before torch is installed

        problems = [] if no_gpu else [check_torch(torch.version.cuda, torch.cuda.is_available(), driver_version())]
    return [p for p in problems if p]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["before"], ["after"]):
        print("usage: ops/setup_checks.py before|after", file=sys.stderr)
        return 2
    problems = run(args[0])
    for p in problems:
        print(f"ops/setup.sh: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
