#!/usr/bin/env bash
# Re-measure the published tables from the shipped bases (ops/bases/): the default task's VAPO, DAPO, GRPO and
# PPO (3 seeds each, 60 steps: 12 runs, 4-9 min each on 2 cores, ~2 h) and the long task's VAPO α = 1, DAPO
# and GRPO (3 seeds each, 40 steps: 9 runs, 4-8 min each, ~55 min). Resumable (finished runs are skipped).
# Every run records what produced it (metrics.jsonl header). The reports go to runs/remeasure/RESULTS.md (plots
# beside it), to compare with the published figures; --publish writes them into docs/RESULTS.md instead, with
# the hand-written readings (docs/results/notes.md, long_notes.md), which then need re-reading against the
# new figures. The long task's α sweep and plain-critic follow-ups: experiments.py --suite long without --alpha.
#     ops/bench/suites/remeasure.sh [--publish] [--jobs N]
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=runs/remeasure/RESULTS.md notes=/dev/null
if [ "${1:-}" = --publish ]; then
  out=docs/RESULTS.md notes=docs/results/notes.md
  shift
fi
ops/setup.sh
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
mkdir -p runs/remeasure
.venv/bin/python -m ops.bench.suites.experiments --root runs/remeasure/default --only vapo dapo grpo ppo \
  --out "$out" --notes "$notes" "$@"
.venv/bin/python -m ops.bench.suites.experiments --suite long --root runs/remeasure/long --alpha 1 \
  --only long_vapo_a1 long_dapo long_grpo --out "$out" "$@"
