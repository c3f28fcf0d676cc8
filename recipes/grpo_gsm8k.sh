#!/usr/bin/env bash
# GRPO on GSM8K with rl-kernel off, then on, and a report comparing the two runs.
#   bash recipes/grpo_gsm8k.sh --data synthetic              # offline, tiny preset, 2-core CPU
#   bash recipes/grpo_gsm8k.sh --data DIR --preset qwen3-0.6b # one GPU
#   bash recipes/grpo_gsm8k.sh --help                         # every option
# Uses the current python3 when it already has torch, transformers, matplotlib and tqdm;
# otherwise builds (once) and uses the project's cached core environment (scripts/env.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if python3 -c "import torch, transformers, matplotlib, tqdm" >/dev/null 2>&1; then
  py=python3
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
else
  py="$("$root/scripts/env.sh" core)/bin/python"
fi
exec "$py" "$root/recipes/grpo_gsm8k.py" "$@"
