"""Sweep the batch-invariant matmul's tile, ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``.

Times the persistent kernel alone (``matmul_forward``, no dispatch) for each candidate tile on the
products of a Qwen3-0.6B decoder layer and its LM head (``x [M, K] @ W [N, K].T``, bf16 by default)
at M = ``--rows`` (8192: a training micro-batch; 512: one sequence), next to cuBLAS (``x @ W.T``)
in the same run. Each tile is checked before it is timed: rows bitwise equal whether computed
among M rows or among the first 7, and the error against an fp64 product within the bound the
CPU tests hold ``bi_matmul`` to. The ranking is by the per-layer-weighted sum (7 layer products per layer x ``--layers``,
plus the LM head once), as ``bench_consistency.py`` runs them.

    python benchmarks/sweep_bi_matmul_tiles.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from rl_kernel_core import bench, contract
from rl_kernel_core.triton.batch_invariant import matmul_forward, matmul_tile

LAYER = {"q_proj": (1024, 2048), "k_proj": (1024, 1024), "v_proj": (1024, 1024), "o_proj": (2048, 1024),
         "gate_proj": (1024, 3072), "up_proj": (1024, 3072), "down_proj": (3072, 1024)}
LM_HEAD = (1024, 151936)
CANDIDATES = ["128,128,64,8,3", "128,128,64,4,4", "128,256,64,8,3", "128,256,64,8,4", "256,128,64,8,3",
              "128,128,128,8,3", "64,256,64,4,4", "128,64,64,4,4"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _tile(text: str) -> tuple[int, int, int, int, int]:
    values = tuple(int(x) for x in text.split(","))
    if len(values) != 5:
        raise ValueError(f"a tile is BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages, got {text!r}")
    return values  # type: ignore[return-value]


def _check(tile, x: torch.Tensor, w: torch.Tensor) -> dict:
    """Rows bitwise equal among M rows and among the first 7; error within the bound the CPU tests
    use for ``bi_matmul`` (the contract's attention class plus one rounding to the output dtype)."""
    full = matmul_forward(x, w, None, tile)
    invariant = torch.equal(full[:7], matmul_forward(x[:7], w, None, tile))
    ref = x.double() @ w.double().T
    tol = contract.tolerance("attention", x.dtype)
    excess = ((full.double() - ref).abs() - (tol.atol + (tol.rtol + torch.finfo(x.dtype).eps) * ref.abs())).max().item()
    return {"rows_bitwise_invariant": invariant, "worst_excess_over_bound": excess, "ok": invariant and excess <= 0}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiles", default=";".join(CANDIDATES), help="';'-separated BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages")
    p.add_argument("--rows", default="8192,512")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="directory for sweep_bi_matmul_tiles.json")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    tiles = [_tile(t) for t in args.tiles.split(";") if t]
    weights = {name: args.layers for name in LAYER} | {"lm_head": 1}
    shapes = LAYER | {"lm_head": LM_HEAD}
    g = torch.Generator(device=device).manual_seed(0)
    mats = {name: torch.randn(n, k, device=device, dtype=dtype, generator=g) * k ** -0.5 for name, (k, n) in shapes.items()}
    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, device=device, dtype=dtype, generator=g) for k in {k for k, _ in shapes.values()}}
        entry = {"rows": m, "cublas": {}, "tiles": {}}
        for name, (k, n) in shapes.items():
            entry["cublas"][name] = bench.time_ms(lambda: xs[k] @ mats[name].T, device, warmup=args.warmup, reps=args.reps)["median_ms"]
        entry["cublas_weighted_ms"] = sum(weights[n] * t for n, t in entry["cublas"].items())
        print(f"M={m}: cuBLAS weighted {entry['cublas_weighted_ms']:.3f} ms")
        for tile in tiles:
            key = ",".join(map(str, tile))
            try:
                check = _check(tile, xs[1024], mats["q_proj"])
                times = {name: bench.time_ms(lambda: matmul_forward(xs[k], mats[name], None, tile), device,
                                             warmup=args.warmup, reps=args.reps)["median_ms"] for name, (k, n) in shapes.items()}
            except Exception as exc:  # a tile that does not compile (shared memory) is reported, not fatal
                entry["tiles"][key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                print(f"  {key:>18}: {entry['tiles'][key]['error']}")
                continue
            weighted = sum(weights[n] * t for n, t in times.items())
            entry["tiles"][key] = {"check": check, "ms": times, "weighted_ms": weighted, "over_cublas": weighted / entry["cublas_weighted_ms"]}
            print(f"  {key:>18}: weighted {weighted:.3f} ms ({weighted / entry['cublas_weighted_ms']:.2f}x cuBLAS), "
                  f"lm_head {times['lm_head']:.3f} ms, check ok={check['ok']}")
        rows_out.append(entry)
    result = {"benchmark": "batch-invariant matmul tile sweep", "command": bench.command_line(),
              "environment": bench.environment(device), "dtype": args.dtype, "current_tile": list(matmul_tile(dtype, device)),
              "shapes_k_n": shapes, "weights": weights, "timing": {"warmup": args.warmup, "reps": args.reps, "statistic": "median"},
              "rows": rows_out}
    if args.out:
        bench.write_json(args.out, "sweep_bi_matmul_tiles.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
