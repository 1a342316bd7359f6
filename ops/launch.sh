#!/usr/bin/env bash
# Run vapo end to end: `ops/launch.sh [config.yaml] [key=value ...] [--resume] [--auto-resume N] [--dry-run]`.
# No arguments: the embedded CPU default (ops/configs/default.yaml). `ops/launch.sh --help` for more.
set -euo pipefail
cd "$(dirname "$0")/.."
ops/setup.sh
# No DS_ACCELERATOR default here: ops/launch.py gives each process the accelerator of its device
# (cpu for run.device=cpu, cuda for the DeepSpeed ranks of a GPU run), from the process plan.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/vapo/torch_extensions}
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1
# Engines and learner share 2 cores: spinning OpenMP workers made 2-thread torch ~5-10x slower here.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
exec .venv/bin/python -m ops.launch "$@"
