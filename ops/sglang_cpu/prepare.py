"""Helpers of ``ops/setup.sh --sglang``: what to install from SGLang's wheel on a CPU, and what to fix after.

    python -m ops.sglang_cpu.prepare requirements WHEEL   # the wheel's requirements a CPU install takes, one a line
    python -m ops.sglang_cpu.prepare patch-torchvision    # guard torchvision's two fake-op registrations
    python -m ops.sglang_cpu.prepare check                # sglang, sgl_kernel and torchvision import on a CPU torch

SGLang 0.5.23 declares CUDA-only packages (and ``torch==2.14.1``) as plain requirements; none of them is
imported on its CPU serving path (``--device cpu --attention-backend torch_native``), so the sglang wheel is
installed with ``--no-deps`` and its other requirements from this list. The compiled ``sgl_kernel`` is
replaced by the pure-torch package beside this file. torchvision's registry wheels are CUDA builds: with a
CPU torch its extension does not load, and ``import torchvision`` fails on two fake-op registrations that do
not check for it (SGLang imports ``torchvision.transforms`` when it resolves its arguments);
``patch-torchvision`` makes those two conditional, as every other registration in that file already is.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import zipfile
from pathlib import Path

# Requirements of the sglang wheel never imported on the CPU path (CUDA/ROCm kernels, the GPU torch and its
# media siblings); torch and torchvision are installed by setup.sh, pinned to the CPU torch.
CUDA_ONLY = (
    "torch", "torchvision", "torchaudio", "torchcodec", "torch-memory-saver", "flashinfer-python", "flash-attn-4",
    "cuda-python", "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13", "sgl-deep-ep", "sgl-deep-gemm",
    "sgl-flash-mla", "sglang-kernel", "tilelang", "humming-kernels", "quack-kernels",
)
TORCHVISION_FAKES = ("torchvision::nms", "torchvision::qnms")
REQUIRED_SGL_KERNEL_NAMES = (
    "copy_all_layer_kv_cache_cpu", "assign_req_to_token_pool_cpu", "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu", "rotate_input_ids_cpu",
)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(metadata: str) -> list[str]:
    """``Requires-Dist`` lines of a wheel's METADATA that a CPU install takes: no extras, no CUDA-only
    package; environment markers are kept (pip evaluates them)."""
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        if name is None or _canonical(name.group(0)) in CUDA_ONLY:
            continue
        out.append(req)
    return out


def wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(meta).decode()


def patch_source(text: str) -> str:
    """torchvision's ``_meta_registrations.py`` with the nms/qnms fake registrations applied only when its
    compiled ops loaded; unchanged when already so. ValueError when the file does not look as expected."""
    for op in TORCHVISION_FAKES:
        plain = f'@torch.library.register_fake("{op}")'
        guarded = f'@(torch.library.register_fake("{op}") if torchvision.extension._has_ops() else (lambda f: f))'
        if guarded in text:
            continue
        if text.count(plain) != 1:
            raise ValueError(f"torchvision's _meta_registrations.py has {text.count(plain)} registrations of {op}; "
                             "this torchvision is not the one ops/setup.sh --sglang knows how to fix")
        text = text.replace(plain, guarded)
    return text


def patch_torchvision() -> Path:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        raise SystemExit("torchvision is not installed")
    path = Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    new = patch_source(text)
    if new != text:
        path.write_text(new)
    return path


def check() -> None:
    """Import what the server imports, as it does on a CPU (fails with the import error otherwise)."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sgl_kernel  # noqa: PLC0415 - optional dependency: SGLang's stack
    import sglang  # noqa: PLC0415 - optional dependency: SGLang's stack
    import torch  # noqa: PLC0415 - heavy (torch): --help and the light paths skip it
    import torchvision.transforms  # noqa: F401,PLC0415 - optional dependency: what SGLang's argument parsing imports

    missing = [n for n in REQUIRED_SGL_KERNEL_NAMES if not hasattr(sgl_kernel, n)]
    if missing:
        raise SystemExit(f"sgl_kernel lacks {missing}")
    if torch.version.cuda is not None:
        raise SystemExit(f"torch {torch.__version__} is a CUDA build; the CPU SGLang install needs the CPU torch")
    print(f"[setup] sglang {sglang.__version__} on torch {torch.__version__} (CPU), sgl_kernel {sgl_kernel.__version__}",
          file=sys.stderr)


def main(argv: list[str]) -> None:
    if argv[:1] == ["requirements"] and len(argv) == 2:
        print("\n".join(requirements(wheel_metadata(Path(argv[1])))))
    elif argv == ["patch-torchvision"]:
        patch_torchvision()
    elif argv == ["check"]:
        check()
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
