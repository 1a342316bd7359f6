#!/usr/bin/env bash
# Run vapo end to end: `ops/launch.sh [config.yaml] [key=value ...]` (no arguments: the embedded default).
set -euo pipefail
cd "$(dirname "$0")/.."
ops/setup.sh
echo "ops/launch.sh: the pipeline is not implemented yet (see the open issues)." >&2
exit 1
