#!/usr/bin/env bash
# On a CUDA machine: the batch-invariant mode's GPU tests (Triton matmul/reductions/attention, the
# consistency chain, the CLI), the mode on/off and attention benchmarks at Qwen3-0.6B shapes and an
# `rl-kernel consistency` run with its drift plot, all written under OUT (default ./gpu-consistency).
#   bash scripts/gpu_consistency.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_preamble.sh gpu-consistency "$@"
python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/core/batch_invariant_mode/test_rms_norm.py tests/core/batch_invariant_mode/test_bi_*.py \
  tests/core/batch_invariant_mode/test_varlen_attention.py tests/core/tools/test_consistency_chain.py tests/core/batch_invariant_mode/test_batch_invariant.py -s 2>&1 | tee "$out/gpu_tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 benchmarks/bench_consistency.py --out "$out" 2>&1 | tee "$out/bench_consistency.log" | tail -16 || status=1
python3 benchmarks/bench_attention.py --sweep --out "$out" 2>&1 | tee "$out/bench_attention.log" | tail -40 || status=1
for dtype in fp32 bf16; do
  python3 -m rl_kernel_core.cli consistency --device cuda --dtype "$dtype" --sequences 32 --min-len 24 --max-len 160 --prompt-len 16 \
    --rollout-batch 5 --plot "$out/consistency_$dtype.png" 2>&1 | tee "$out/consistency_$dtype.txt" | tail -12
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  python3 -m rl_kernel_core.cli consistency --device cuda --dtype "$dtype" --sequences 32 --min-len 24 --max-len 160 --prompt-len 16 \
    --rollout-batch 5 --probe --json > "$out/consistency_$dtype.json" || status=1
done
echo "gpu_consistency status=$status"
exit $status
