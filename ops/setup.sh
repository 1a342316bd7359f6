#!/usr/bin/env bash
# Idempotent environment setup: .venv with the CPU torch build, then vapo in editable mode.
# Returns in seconds when nothing changed (a stamp of pyproject.toml + this file is kept in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3}
TORCH_VERSION=${VAPO_TORCH_VERSION:-2.13.0}
STAMP="$VENV/.vapo-setup-stamp"
want=$(cat pyproject.toml ops/setup.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

echo "[setup] preparing $VENV (torch $TORCH_VERSION CPU build, vapo editable)" >&2
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.split('+')[0]=='$TORCH_VERSION' else 1)" 2>/dev/null; then
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
"${PIP[@]}" "setuptools>=68" wheel
# DeepSpeed ships only an sdist whose setup imports torch: build it against the torch above, without ops
# (DS_BUILD_OPS=0; they are JIT-built only when used) and without build isolation (which would fetch torch).
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('deepspeed')=='0.19.8'" 2>/dev/null; then
  DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation "deepspeed==0.19.8"
fi
"${PIP[@]}" --no-build-isolation -e ".[dev]"
"$VENV/bin/python" -c "import torch; assert torch.__version__.split('+')[0]=='$TORCH_VERSION', torch.__version__; assert not torch.version.cuda or '${VAPO_ALLOW_CUDA_TORCH:-0}'=='1', 'CUDA torch pulled in'" 
echo "$want" > "$STAMP"
echo "[setup] done" >&2
