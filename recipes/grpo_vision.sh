#!/usr/bin/env bash
# GRPO on generated image problems (a tiny Qwen2-VL) with rl-kernel off, then on, and a report.
#   bash recipes/grpo_vision.sh --data synthetic     # offline, tiny preset, 2-core CPU
#   bash recipes/grpo_vision.sh --help               # every option
# Before training, each run checks processor-layout parity on its first batch and stops on a mismatch.
# Uses the current python3 when it already has torch, transformers, PIL, matplotlib and tqdm;
# otherwise builds (once) and uses the project's cached core environment (scripts/env.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if python3 -c "import torch, transformers, PIL, matplotlib, tqdm" >/dev/null 2>&1; then
  py=python3
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
else
  py="$("$root/scripts/env.sh" core)/bin/python"
fi
exec "$py" "$root/recipes/grpo_vision.py" "$@"
