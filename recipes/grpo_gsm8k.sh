#!/usr/bin/env bash
# GRPO on GSM8K with rl-kernel off, then on, and a report comparing the two runs.
#   bash recipes/grpo_gsm8k.sh --data synthetic              # offline, tiny preset, 2-core CPU
#   bash recipes/grpo_gsm8k.sh --data DIR --preset qwen3-0.6b # one GPU
#   bash recipes/grpo_gsm8k.sh --engine verl --data synthetic # verl's trainer + vLLM (CPU or GPU)
#   bash recipes/grpo_gsm8k.sh --help                         # every option
# Uses the current python3 when it already has torch, transformers, matplotlib and tqdm (and,
# for --engine verl, verl, vllm, pandas and pyarrow); otherwise builds (once) and uses the project's cached
# environment (scripts/env.sh): core, or recipe-verl for --engine verl.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
needs="torch, transformers, matplotlib, tqdm" tier=core prev=
for arg in "$@"; do
  if [ "$arg" = "--engine=verl" ] || { [ "$prev" = "--engine" ] && [ "$arg" = verl ]; }; then
    needs="$needs, verl, vllm, pandas, pyarrow" tier=recipe-verl
  fi
  prev=$arg
done
if python3 -c "import $needs" >/dev/null 2>&1; then
  py=python3
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
else
  py="$("$root/scripts/env.sh" "$tier")/bin/python"
fi
exec "$py" "$root/recipes/grpo_gsm8k.py" "$@"
