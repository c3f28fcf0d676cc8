#!/usr/bin/env bash
# On a CUDA machine with vLLM importable: the identity's root-cause table and the adversarial harness.
#   1. benchmarks/rope_tables.py: vLLM's rotary table (built on the GPU, plugin off) against transformers'
#      rotary values at every position, per rope setting, and rl-kernel's table against the same;
#   2. python -m rl_kernel_vllm.harness --where gpu: DRAWS (default 8) random real-dim models and workloads,
#      each with both switches on and off (--control), seed SEED (default: random, printed), no engine started
#      after BUDGET_S seconds (default 420; later draws reported as skipped); ARCHITECTURE (e.g.
#      Qwen3MoeForCausalLM) draws that architecture only; DISK_GB (default 8) bounds the checkpoints on
#      disk at once (a GPU machine's free disk, after vLLM's install, can be well under its size).
#   bash benchmarks/gpu_harness.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_preamble.sh gpu-results "${1:-}"
export VLLM_USE_FLASHINFER_SAMPLER=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 benchmarks/rope_tables.py --out "$out/rope_tables.json" 2>&1 | grep -v "WARNING\|SSM cache" | tee "$out/rope_tables.log" | tail -20
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
work=${HARNESS_DIR:-/tmp/rl-kernel-harness}
python3 -m rl_kernel_vllm.harness --where gpu --draws "${DRAWS:-8}" ${SEED:+--seed "$SEED"} --budget-s "${BUDGET_S:-420}" \
  ${ARCHITECTURE:+--architecture "$ARCHITECTURE"} --disk-gb "${DISK_GB:-8}" \
  --control --out "$work" 2>&1 | grep -v "Writing model" | tee "$out/harness.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cp "$work/harness.json" "$out/" 2>/dev/null
echo "gpu_harness status=$status"
exit $status
