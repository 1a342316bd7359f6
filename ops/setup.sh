#!/usr/bin/env bash
# Idempotent environment setup of .venv: vapo in editable mode on the right torch.
#
#   ops/setup.sh            CPU machines (default): the CPU torch build, DeepSpeed; no SGLang
#   ops/setup.sh --sglang   CPU machines, plus the real SGLang server on that CPU torch (minutes, ~3.5 GB):
#                           engine.kind=sglang runs live (ops/configs/sglang-cpu.yaml, tests marked sglang)
#   ops/setup.sh --cuda     GPU machines: the CUDA torch that the SGLang release pins, SGLang, DeepSpeed
#   ops/setup.sh --cpu      go back to the CPU build in an existing .venv (SGLang, if added, stays)
#
# Without a flag the mode of an existing .venv is kept (ops/launch.sh and ops/test.sh call this with none),
# so a GPU machine set up once with --cuda stays on CUDA, and a CPU venv given SGLang keeps it. Returns in seconds when nothing changed (a stamp of
# pyproject.toml + this file + the mode is kept in .venv). --cuda first checks Python >= 3.11, glibc >= 2.34
# and an NVIDIA driver for CUDA 13, and after installing that torch sees a GPU (ops/setup_checks.py).
# Variables: PYTHON (interpreter for the venv), VAPO_VENV (venv directory, default .venv),
# VAPO_SETUP_NO_GPU=1 (--cuda on a machine without GPUs, e.g. a login node: no driver/GPU checks).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VAPO_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
CPU_TORCH=2.13.0          # the CPU build these machines carry on disk
CPU_TORCHVISION=0.28.0    # the torchvision release built against CPU_TORCH (SGLang imports torchvision)
SGLANG_VERSION=0.5.23     # GPU: the SGLang release vapo's client follows (common/sglang_client.py)
DEEPSPEED_VERSION=0.19.8
MODE_FILE="$VENV/.vapo-mode"

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
MODE=""
SGLANG_CPU_FILE="$VENV/.vapo-sglang-cpu"  # present: this CPU venv also has SGLang (ops/setup.sh --sglang)
WANT_SGLANG=""
for arg in "$@"; do
  case "$arg" in
    --sglang) MODE=cpu; WANT_SGLANG=1 ;;
    --cuda) MODE=cuda ;;
    --cpu) MODE=cpu ;;
    -h|--help) usage; exit 0 ;;
    *) echo "ops/setup.sh: unknown argument '$arg' (see ops/setup.sh --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$MODE" ]; then
  MODE=$(cat "$MODE_FILE" 2>/dev/null || echo cpu)
fi
[ "$MODE" = cpu ] && [ -f "$SGLANG_CPU_FILE" ] && WANT_SGLANG=1
STAMP="$VENV/.vapo-setup-stamp"
want=$( (cat pyproject.toml ops/setup.sh; echo "$MODE"; [ -z "$WANT_SGLANG" ] || cat ops/sglang_cpu/pyproject.toml \
  ops/sglang_cpu/prepare.py ops/sglang_cpu/sgl_kernel/__init__.py) | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

die() { echo "ops/setup.sh: $*" >&2; exit 1; }
if [ "$MODE" = cuda ]; then
  # Python, glibc and the NVIDIA driver before anything is downloaded: each fails much later, and obscurely
  # ("cannot download sglang", a torch that sees no GPU), when it is wrong (VAPO_SETUP_NO_GPU=1 skips the driver).
  "$PY" -m ops.setup_checks before || exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --quiet --disable-pip-version-check)
torch_is() {  # torch_is VERSION cpu|cuda: the installed torch is that version and build
  "$VPY" - "$1" "$2" <<'EOF' 2>/dev/null
import sys, torch
want, kind = sys.argv[1], sys.argv[2]
ok = torch.__version__.split("+")[0] == want and (torch.version.cuda is None) == (kind == "cpu")
sys.exit(0 if ok else 1)
EOF
}

install_sglang_cpu() {
  # The real SGLang server on the CPU torch (ops/sglang_cpu/prepare.py says why each step is needed): the
  # wheel without its CUDA-only requirements, vapo's pure-torch sgl_kernel, torchvision for this torch with
  # its two unguarded fake-op registrations guarded. Every pip call is constrained to the CPU torch.
  echo "[setup] adding SGLang $SGLANG_VERSION for CPU engines (first time: a few minutes, ~3.5 GB)" >&2
  local cons="$VENV/.vapo-sglang-constraints.txt" wheels="$VENV/.sglang-wheel"
  printf 'torch==%s\ntorchvision==%s\n' "$CPU_TORCH" "$CPU_TORCHVISION" >"$cons"
  if ! "$VPY" -c "import importlib.metadata as m; assert m.version('sglang')=='$SGLANG_VERSION'" 2>/dev/null; then
    rm -rf "$wheels"
    "$VPY" -m pip download --quiet --disable-pip-version-check --no-deps -d "$wheels" "sglang==$SGLANG_VERSION" \
      || die "cannot download sglang==$SGLANG_VERSION from the package index"
    local whl
    whl=$(ls "$wheels"/sglang-*.whl)
    mapfile -t reqs < <("$VPY" -m ops.sglang_cpu.prepare requirements "$whl")
    "${PIP[@]}" -c "$cons" "torchvision==$CPU_TORCHVISION" "${reqs[@]}" || die "installing SGLang's CPU requirements failed"
    "${PIP[@]}" -c "$cons" --no-deps "$whl" || die "installing the sglang wheel failed"
    rm -rf "$wheels"
  fi
  "${PIP[@]}" -c "$cons" --no-deps --no-build-isolation ./ops/sglang_cpu
  "$VPY" -m ops.sglang_cpu.prepare patch-torchvision || die "could not make torchvision importable on the CPU torch"
  torch_is "$CPU_TORCH" cpu || die "installing SGLang replaced torch $CPU_TORCH (CPU) with $("$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
  "$VPY" -m ops.sglang_cpu.prepare check || die "SGLang does not import on this CPU torch (the error is above)"
  touch "$SGLANG_CPU_FILE"
}

if [ "$MODE" = cpu ]; then
  echo "[setup] preparing $VENV (torch $CPU_TORCH CPU build, vapo editable)" >&2
  # torch first, pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
  if ! torch_is "$CPU_TORCH" cpu; then
    "${PIP[@]}" "torch==$CPU_TORCH"
  fi
  "${PIP[@]}" "setuptools>=68" wheel
  # DeepSpeed ships only an sdist whose setup imports torch: build it against the torch above, without ops
  # (DS_BUILD_OPS=0; they are JIT-built only when used) and without build isolation (which would fetch torch).
  if ! "$VPY" -c "import importlib.metadata as m; assert m.version('deepspeed')=='$DEEPSPEED_VERSION'" 2>/dev/null; then
    DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation "deepspeed==$DEEPSPEED_VERSION"
  fi
  "${PIP[@]}" --no-build-isolation -e ".[dev]"
  torch_is "$CPU_TORCH" cpu || die "a dependency replaced torch $CPU_TORCH (CPU) with $("$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda)'); on a GPU machine use ops/setup.sh --cuda"
  if [ -n "$WANT_SGLANG" ]; then
    install_sglang_cpu
  fi
else
  echo "[setup] preparing $VENV for GPUs (SGLang $SGLANG_VERSION, its CUDA torch, DeepSpeed $DEEPSPEED_VERSION)" >&2
  "${PIP[@]}" "setuptools>=68" wheel packaging
  # The torch that this SGLang release pins, read from its own metadata (not guessed): everything else
  # must agree with it.
  "$VPY" -m pip download --quiet --disable-pip-version-check --no-deps -d "$VENV/.sglang-wheel" "sglang==$SGLANG_VERSION" \
    || die "cannot download sglang==$SGLANG_VERSION from the package index"
  TORCH_PIN=$("$VPY" - "$VENV/.sglang-wheel" <<'EOF'
import sys, zipfile, pathlib, re
whl = next(pathlib.Path(sys.argv[1]).glob("sglang-*.whl"))
meta = next(n for n in zipfile.ZipFile(whl).namelist() if n.endswith(".dist-info/METADATA"))
for line in zipfile.ZipFile(whl).read(meta).decode().splitlines():
    m = re.match(r"Requires-Dist: torch\s*==\s*([0-9][^;\s]*)", line)
    if m:
        print(m.group(1)); break
EOF
)
  [ -n "$TORCH_PIN" ] || die "sglang==$SGLANG_VERSION does not pin torch; cannot choose a CUDA build"
  if ! torch_is "$TORCH_PIN" cuda; then
    "${PIP[@]}" --force-reinstall "torch==$TORCH_PIN"
  fi
  torch_is "$TORCH_PIN" cuda || die "pip installed $("$VPY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)') instead of the CUDA build of torch $TORCH_PIN that sglang $SGLANG_VERSION needs (a local pip cap or index?)"
  "${PIP[@]}" "sglang==$SGLANG_VERSION"
  if ! "$VPY" -c "import importlib.metadata as m; assert m.version('deepspeed')=='$DEEPSPEED_VERSION'" 2>/dev/null; then
    DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation "deepspeed==$DEEPSPEED_VERSION"
  fi
  "${PIP[@]}" --no-build-isolation -e ".[dev,sglang]"
  torch_is "$TORCH_PIN" cuda || die "installing SGLang/DeepSpeed/vapo replaced torch: now $("$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda)'), SGLang $SGLANG_VERSION needs $TORCH_PIN (CUDA)"
  "$VPY" -m pip check >/tmp/vapo-pip-check.$$ 2>&1 || { cat /tmp/vapo-pip-check.$$ >&2; rm -f /tmp/vapo-pip-check.$$; die "the installed packages disagree (pip check above): SGLang $SGLANG_VERSION, torch $TORCH_PIN and DeepSpeed $DEEPSPEED_VERSION cannot be installed together as pinned"; }
  rm -f /tmp/vapo-pip-check.$$
  "$VPY" -c "import sglang, deepspeed, torch; print(f'[setup] torch {torch.__version__} (CUDA {torch.version.cuda}), sglang {sglang.__version__}, deepspeed {deepspeed.__version__}')" >&2 \
    || die "SGLang or DeepSpeed does not import with torch $TORCH_PIN"
  "$VPY" -m ops.setup_checks after || exit 1  # a CUDA build that sees a GPU
fi
echo "$MODE" > "$MODE_FILE"
echo "$want" > "$STAMP"
echo "[setup] done ($MODE)" >&2
