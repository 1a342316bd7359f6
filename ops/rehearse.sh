#!/usr/bin/env bash
# The multi-host path rehearsed on one machine: hosts h0..h3 as network namespaces on a bridge, each with
# its own address, hostname, sshd and slurmd (slurmctld on h0, munged), paper.yaml's topology in miniature
# on CPU (ops/configs/rehearsal.yaml), the scale checks, and everything torn down at the end (also on
# Ctrl-C or failure). Prints one JSON line of figures; exits 0 when every check passed, 3 when this
# machine cannot host it (not root, no namespaces, packages missing: see docs/MULTIHOST.md), 1 otherwise.
#   sudo ops/rehearse.sh                 # ~4 min on 2 cores (217 s measured, other jobs sharing them)
#   ops/rehearse.sh --skip slurm,kill    # the ssh route and plan-time checks only
#   ops/rehearse.sh --link 1gbit --push --skip plan,slurm,kill
#       # every host's link shaped with tc (RATE[,DELAY]; a delay needs netem), plus a run with the
#       # distributed weight push: both transports' figures under "weight_sync", check_push_shaped
#   ops/rehearse.sh --engine sglang --skip ssh,plan,slurm,kill
#       # live SGLang engines on h2 and h3 (ops/setup.sh --sglang), the distributed push run alone (~3-4.5 min)
#   ops/rehearse.sh --engine sglang      # every stage on SGLang engines, plus the push run (755 s measured)
set -euo pipefail
cd "$(dirname "$0")/.."
ops/setup.sh
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/vapo/torch_extensions}
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
exec .venv/bin/python -m ops.rehearsal.main "$@"
