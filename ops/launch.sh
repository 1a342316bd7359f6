#!/usr/bin/env bash
# Run vapo end to end: `ops/launch.sh [config.yaml] [key=value ...] [--resume]`.
# No arguments: the embedded CPU default (ops/configs/default.yaml). `ops/launch.sh --help` for more.
set -euo pipefail
cd "$(dirname "$0")/.."
ops/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/vapo/torch_extensions}
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1
# Engines and learner share 2 cores: spinning OpenMP workers made 2-thread torch ~5-10x slower here.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
exec .venv/bin/python ops/launch.py "$@"
