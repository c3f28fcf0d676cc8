#!/usr/bin/env bash
# On a CUDA machine: the GPU tests of `sample` (both backends' files) and bench_sampling.py, with
# logs and JSON under OUT (default $OUT, else ./gpu-results). Prints a summary last.
#   bash benchmarks/gpu_sampling_check.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_preamble.sh gpu-results "$@"
python3 -m rl_kernel_core.cli info > "$out/info.txt" 2>&1
python3 -m pytest -q -m gpu tests/core/sampling/test_sample.py -p no:cacheprovider --durations=15 2>&1 \
  | tee "$out/sampling_gpu_tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 - > "$out/sampling_kernels.txt" 2>&1 <<'PY'
# registers and spills of every compiled sampling kernel (headline calls in bf16 and fp32 compile them)
import torch
import rl_kernel_core as rk
from rl_kernel_core.sampling import triton as S
kernels = (("scan", S._block_scan_kernel), ("plan", S._row_plan_kernel), ("gather", S._block_gather_kernel),
           ("finish", S._finish_kernel), ("exact", S._exact_kernel))
seen = set()
for dtype in (torch.bfloat16, torch.float32):
    logits = (torch.randn(128, 151936, device="cuda") * 3).to(dtype)
    rk.sample(logits, top_k=50, top_p=0.9, seeds=torch.arange(128, device="cuda"))
    for name, kernel in kernels:
        for cache in kernel.flavour().device_caches.values():
            for key, compiled in cache[0].items():
                if (name, key) not in seen:
                    seen.add((name, key))
                    print(str(dtype).replace("torch.", ""), name, "regs", compiled.n_regs, "spills", compiled.n_spills,
                          "shared", compiled.metadata.shared, "warps", compiled.metadata.num_warps)
PY
cat "$out/sampling_kernels.txt"
python3 benchmarks/bench_sampling.py --out "$out" 2>&1 | tee "$out/bench_sampling.log" | grep -v '^[ {}]' | tail -20
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_sampling_check status=$status"
exit $status
