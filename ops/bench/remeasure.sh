#!/usr/bin/env bash
# Re-measure the published tables from the shipped bases (ops/bases/): the default task's VAPO, DAPO, GRPO and
# PPO (3 seeds each, 60 steps) and the long-horizon suite (α sweep at seed 0, then the picked α, DAPO and GRPO
# with 3 seeds each, and the plain-critic follow-ups). ~9 min per default run and 13-14 min per long VAPO run
# on 2 cores: about 2 h + 2 h 40 min. Resumable (finished runs are skipped). Every run records what produced
# it (metrics.jsonl header); the reports go to runs/remeasure/RESULTS.md (plots beside it), not over
# docs/RESULTS.md, so they can be compared with the published figures before replacing them.
#     ops/bench/remeasure.sh [--jobs N]
set -euo pipefail
cd "$(dirname "$0")/../.."
ops/setup.sh
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
mkdir -p runs/remeasure
[ -f runs/remeasure/RESULTS.md ] || printf '# Results: VAPO in miniature (re-measured from the shipped bases)\n' > runs/remeasure/RESULTS.md
.venv/bin/python ops/bench/experiments.py --root runs/remeasure/default --only vapo dapo grpo ppo \
  --out runs/remeasure/RESULTS.md --notes /dev/null "$@"
.venv/bin/python ops/bench/experiments.py --suite long --root runs/remeasure/long --out runs/remeasure/RESULTS.md "$@"
