#!/usr/bin/env bash
# End-to-end benchmark on one GPU: the recipe with the qwen3-0.6b preset (off vs on), then a run
# whose micro-batch the off path cannot fit (its out-of-memory error is caught and reported).
# Each run's directory (logs, report, plots) is packed as OUT/<name>.tar.gz.
#   bash benchmarks/e2e_grpo.sh OUT --data DIR [more recipe options]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/e2e_grpo.sh OUT [recipe options]}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
run() {
  local name=$1; shift
  bash recipes/grpo_gsm8k.sh --preset qwen3-0.6b --no-progress --out "$out/$name" "$@" 2>&1 | tee "$out/$name.log" || status=1
  tar -C "$out" -czf "$out/$name.tar.gz" "$name" && rm -rf "${out:?}/$name"
}
run e2e "$@"
run e2e_oom --steps 2 --prompts-per-step 32 --micro-batch 256 "$@"
exit $status
