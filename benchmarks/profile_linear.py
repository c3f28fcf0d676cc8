"""Per-kernel device time of ``linear_logprob`` and ``fused_linear_policy_loss`` (triton backend).

The evidence behind the ratios in ``bench_linear_logprob.py``: one call of each case under
``torch.profiler`` after warm-up, the CUDA kernels grouped by name (total ms, launches), next to
the cuBLAS floor of the same shape. Cases: ``fwd`` (log-probs under ``torch.no_grad()``),
``fwdbwd`` (log-probs and entropies, forward and backward with a non-uniform upstream gradient),
``loss`` (GRPO loss forward and backward). ``--variants`` takes ``bench_linear_logprob``'s syntax.

    python benchmarks/profile_linear.py --out benchmarks/results --shapes llama8b,qwen0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_linear_logprob as B  # noqa: E402

from rl_kernel_core.tools import bench  # noqa: E402


def _case_fn(case: str, shape: str, dtype: torch.dtype):
    n, d, v = B.shape_of(shape)
    if case == "loss":
        h, w, t, old, adv, mask = B._loss_inputs(32, n // 32, d, v, dtype)
        return lambda: B.loss_fwd_bwd(B.ours_loss, h, w, t, old, adv, mask)
    h, w, t, g = B.make(n, d, v, dtype)
    if case == "fwd":
        return lambda: B.fwd_only(B.ours, h, w, t)

    def fwd_bwd():
        hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
        lp, ent = B.rk.linear_logprob(hl, wl, t, return_entropy=True, backend="triton")
        return torch.autograd.grad((lp * g).sum() + 0.01 * ent.sum(), (hl, wl))

    return fwd_bwd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument(
        "--shapes",
        default="llama8b,qwen0.5b",
        help="comma list of bench_linear_logprob's SHAPES names or d<D>_v<V>_n<N>",
    )
    p.add_argument("--cases", default="fwd,fwdbwd,loss")
    p.add_argument("--variants", default="", help="as bench_linear_logprob.py: name=field:value;...")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=8, help="kernels printed per case")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    variants = [("", {})] + [B._parse_variant(s) for s in args.variants.split(",") if s]
    doc = {
        "benchmark": "profile_linear",
        "command": bench.command_line(),
        "environment": bench.environment(dev),
        "tuning_defaults": B._tuning_dict(B.LC.tuning()),
        "results": [],
    }
    for shape in args.shapes.split(","):
        n, d, v = B.shape_of(shape)
        h = torch.randn(n, d, device=dev).to(dtype)
        w = torch.randn(v, d, device=dev).to(dtype)
        floor_ms, _ = bench.kernel_table(lambda: h @ w.T, max(3, args.warmup))
        del h, w
        doc["results"].append({"shape": shape, "case": "floor", "N": n, "D": d, "V": v, "device_ms": floor_ms})
        print(f"== {shape}: cuBLAS h@W.T {floor_ms:.2f} ms")
        for case in args.cases.split(","):
            for vname, over in variants:
                scope = B._with_tuning(**over)
                try:
                    total, rows = bench.kernel_table(_case_fn(case, shape, dtype), args.warmup)
                finally:
                    scope.close()
                label = case + (f"[{vname}]" if vname else "")
                doc["results"].append(
                    {
                        "shape": shape,
                        "case": label,
                        "N": n,
                        "D": d,
                        "V": v,
                        "device_ms": total,
                        "x_floor": round(total / floor_ms, 3),
                        "kernels": rows,
                    }
                )
                print(f"-- {shape} {label}: {total:.2f} ms device ({total / floor_ms:.2f}x floor)")
                for r in rows[: args.top]:
                    print(f"   {r['ms']:9.3f} ms {r['launches']:5d}x  {r['kernel'][:90]}")
                torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_linear.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
