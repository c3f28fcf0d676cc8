#!/usr/bin/env bash
# Sets up the core environment and runs the main job available today: the environment report,
# one GRPO loss step through the public ops, and the linear_logprob benchmark against eager.
set -euo pipefail
cd "$(dirname "$0")/.."
env=$(scripts/env.sh core)
"$env/bin/rl-kernel" info
"$env/bin/python" recipes/demo_step.py "$@"
"$env/bin/rl-kernel" bench -N 2048 -D 256 -V 32000 --warmup 1 --reps 3
