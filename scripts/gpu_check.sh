#!/usr/bin/env bash
# On a CUDA machine: run every GPU test, the loss benchmarks and the contract calibration, and
# write logs, JSON and the tests' JUnit XML (every test's outcome; -rs lists skip reasons) under OUT
# (default ./gpu-results). Prints a summary last.
#   bash scripts/gpu_check.sh [OUT]        (GPU_CHECK_WORKERS=N: parallel test processes, default 8)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_preamble.sh gpu-results "$@"
python3 -m rl_kernel_core.cli info | tee "$out/info.txt"
# The native groups are built first, side by side, so a compile error is reported once, here, and
# the test processes load the built extensions instead of each waiting on a build.
( time python3 -m rl_kernel_core.native build --jobs 4 ) 2>&1 | tee "$out/native_build.log" | tail -8
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# Test files run in parallel processes on the one GPU where pytest-xdist is installed (Triton's
# compiles, not the GPU, bound the run); GPU_CHECK_WORKERS=1 runs them in one process.
workers=${GPU_CHECK_WORKERS:-8}
parallel=()
if [ "$workers" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then parallel=(-n "$workers" --dist loadfile); fi
python3 -m pytest -q -rs -m gpu tests/core tests/vime tests/vllm -p no:cacheprovider --junitxml "$out/gpu_tests.xml" "${parallel[@]}" 2>&1 | tee "$out/gpu_tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 benchmarks/bench_losses.py --out "$out" 2>&1 | tee "$out/bench_losses.log" | tail -30 || status=1
python3 benchmarks/calibrate_contract.py --out "$out/contract_calibration.json" 2>&1 | tee "$out/calibration.log" | awk '/worst fraction/ && $NF > 0.5 {print "NEAR/OVER BOUND:", $0}'
echo "gpu_check status=$status"
exit $status
