#!/usr/bin/env bash
# The project's test command (README, CI): setup, then the default suite. Extra args go to pytest,
# e.g. `ops/test.sh -m slow` or `ops/test.sh tests/learner -x`. It ends with the 15 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ops/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/vapo/torch_extensions}
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest --durations=15 "$@"
