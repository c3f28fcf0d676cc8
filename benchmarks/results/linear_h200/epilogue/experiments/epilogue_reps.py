import argparse, json, os, sys
import torch
sys.path.insert(0, os.getcwd())
import benchmarks.bench_linear_logprob as B
import rl_kernel_core as rk
from rl_kernel_core import linear_chunks as LC
out = sys.argv[1]
args = argparse.Namespace(warmup=3, reps=9)
rows = []
for (n, d, v) in [(16384, 896, 151936), (16384, 4096, 128256)]:
    h, w, t, g = B.make(n, d, v, torch.bfloat16)
    def f():
        with torch.no_grad():
            return rk.linear_logprob(h, w, t, backend="triton")
    for reps, stg in [(1, 0), (0, 0), (2, 0), (3, 0), (0, 3), (1, 3)]:
        os.environ["RLK_SM90_EPI_REPS"] = str(reps); os.environ["RLK_SM90_STAGGER"] = str(stg)
        with LC.tuned(sm90="all"):
            r = {"D": d, "V": v, "epi_reps": reps, "stagger": stg, **B.paired_ratio(f, lambda: h @ w.T, args)}
        print(json.dumps(r), flush=True); rows.append(r)
    del h, w, t, g
json.dump(rows, open(os.path.join(out, "epi.json"), "w"), indent=1)
