import os, sys, torch
sys.path.insert(0, os.getcwd())
import benchmarks.bench_linear_logprob as B
import rl_kernel_core as rk
from rl_kernel_core import linear_chunks as LC
n, d, v = 16384, int(sys.argv[1]), 151936
h, w, t, g = B.make(n, d, v, torch.bfloat16)
with LC.tuned(sm90="all"), torch.no_grad():
    for _ in range(2):
        rk.linear_logprob(h, w, t, backend="triton")
        h @ w.T
torch.cuda.synchronize()
