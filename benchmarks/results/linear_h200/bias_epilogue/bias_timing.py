"""A biased head on the Hopper kernels (the one general epilogue) against the Triton passes and
against the same head without a bias, each timed alternately with one cuBLAS GEMM h @ W.T.

Run from the repository root: python benchmarks/results/linear_h200/bias_epilogue/bias_timing.py OUT
Writes OUT/bias_timing.json; every sm90 output is compared bit for bit with the Triton passes'."""
import argparse, json, os, sys

import torch

sys.path.insert(0, os.getcwd())
import benchmarks.bench_linear_logprob as B  # noqa: E402
import rl_kernel_core as rk  # noqa: E402
from rl_kernel_core.linear import chunks as LC  # noqa: E402

out = sys.argv[1]
args = argparse.Namespace(warmup=3, reps=int(os.environ.get("REPS", "7")))
rows = []
for n, d, v in [(16384, 1024, 151936), (16384, 4096, 128256)]:
    h, w, t, g = B.make(n, d, v, torch.bfloat16)
    bias = (torch.randn(v, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) * 0.5).bfloat16()

    def fwd(b, entropy):
        def run():
            result = rk.linear_logprob(h, w, t, bias=b, return_entropy=entropy, backend="triton")
            return tuple(result) if entropy else (result,)
        return run

    def fwd_bwd(b):
        def run():
            hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
            lp = rk.linear_logprob(hl, wl, t, bias=b, backend="triton")
            return (lp.detach(), *torch.autograd.grad((lp.float() * g).sum(), (hl, wl)))
        return run

    cases = {"fwd": lambda b: fwd(b, False), "fwd_ent": lambda b: fwd(b, True), "fwd_bwd": fwd_bwd}
    for case, make_fn in cases.items():
        rec = {"N": n, "D": d, "V": v, "case": case}
        outs = {}
        for variant, b, sm90 in (("bias_sm90", bias, "all"), ("bias_triton", bias, "off"), ("nobias_sm90", None, "all")):
            fn = make_fn(b)
            with LC.tuned(sm90=sm90), torch.set_grad_enabled(case == "fwd_bwd"):
                outs[variant] = fn()
                rec[variant] = B.paired_ratio(fn, lambda: h @ w.T, args)
        rec["bias_same_bits"] = all(torch.equal(x, y) for x, y in zip(outs["bias_sm90"], outs["bias_triton"]))
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    del h, w, t, g, bias
    torch.cuda.empty_cache()
json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps,
           "command": " ".join(sys.argv), "rows": rows}, open(os.path.join(out, "bias_timing.json"), "w"), indent=1)
