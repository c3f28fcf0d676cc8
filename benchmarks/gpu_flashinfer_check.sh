#!/usr/bin/env bash
# On a CUDA machine where FlashInfer imports (pip install -e '.[flashinfer]'): the GPU tests of the
# flashinfer backend of `sample` and bench_sampling.py, with logs and JSON under OUT (default $OUT,
# else ./gpu-results). FlashInfer JIT-compiles its sampling kernels on first use (nvcc and ninja);
# the first step times that build on its own. Prints a summary last.
#   bash benchmarks/gpu_flashinfer_check.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_preamble.sh gpu-results "$@"
python3 -m rl_kernel_core.cli info > "$out/info.txt" 2>&1
python3 - 2>&1 <<'PY' | tee "$out/flashinfer_jit.log"
# versions, then one call per FlashInfer path of the backend: the first builds FlashInfer's sampling module
import time
import flashinfer
import torch
import rl_kernel_core as rk
print("flashinfer", flashinfer.__version__, "torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
logits = torch.randn(4, 151936, device="cuda")
for params in ({}, {"top_k": 50}, {"top_p": 0.9}, {"top_k": 50, "top_p": 0.9}, {"min_p": 0.05}):
    start = time.perf_counter()
    tokens, _ = rk.sample(logits, backend="flashinfer", **params)
    torch.cuda.synchronize()
    print(params, "first call", f"{time.perf_counter() - start:.1f} s", tokens.tolist())
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 -m pytest -q -m gpu tests/core/sampling/test_sample_flashinfer.py -p no:cacheprovider --durations=10 2>&1 \
  | tee "$out/flashinfer_gpu_tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 benchmarks/bench_sampling.py --out "$out" 2>&1 | tee "$out/bench_sampling.log" | grep -v '^[ {}]' | tail -20
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_flashinfer_check status=$status"
exit $status
