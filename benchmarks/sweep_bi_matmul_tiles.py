"""Sweep the batch-invariant matmul's kernel and tile, ``KERNEL:BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages``
(a bare ``KERNEL``: the library's own tile choice for each product).

Times the persistent kernels alone (``matmul_forward``, no dispatch; ``tma`` or ``pointer``) for
each candidate on the products of one decoder layer of ``--model`` and its LM head, bf16 by
default, at M = ``--rows`` (8192: a training micro-batch; 512: one sequence), next to cuBLAS in
the same run, in the three layouts a training step multiplies in (``--layouts``): ``fwd``
``x [M, K] @ W [N, K].T``, ``dx`` ``g [M, N] @ W``, ``dw`` ``g.T @ x``. Each candidate is checked
before it is timed: rows bitwise equal whether computed among M rows or among the first 7, the
error against an fp64 product within the bound the CPU tests hold ``bi_matmul`` to, and whether
its bits equal the first candidate's. The ranking is by the per-layer-weighted sum (7 layer
products per layer x ``--layers`` in each layout, plus the LM head's forward once), and the
fastest per row count is printed last. ``--timing graph`` (the default) times each product's
device time, ``--graph-calls`` calls captured in one CUDA graph; ``eager`` times host-launched
calls, which for a product of tens of microseconds also counts its launch (Triton's launcher here,
cuBLAS's there), as the sweeps before this option did.

    python benchmarks/sweep_bi_matmul_tiles.py --model qwen3-1.7b --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from rl_kernel_core import contract
from rl_kernel_core.tools import bench
from rl_kernel_core.batch_invariant_mode.triton import matmul_forward, matmul_tile, uses_tma
from rl_kernel_core.triton.tuning import TMA_MATMUL_TILES, TMA_MIN_ROWS

MODELS = {  # (hidden, q heads x head_dim, kv heads x head_dim, intermediate, vocab)
    "qwen3-0.6b": (1024, 2048, 1024, 3072, 151936),
    "qwen3-1.7b": (2048, 2048, 1024, 6144, 151936),
}
CANDIDATES = [
    "pointer:128,256,64,8,4",
    "tma:128,256,64,8,3",
    "tma:128,256,64,8,4",
    "tma:64,256,64,4,4",
    "tma:64,256,64,4,3",
    "tma:128,128,64,4,4",
    "tma:128,128,64,4,3",
    "tma:64,128,64,4,4",
    "tma:256,128,64,8,3",
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LAYOUTS = ("fwd", "dx", "dw")


def _layer(model: str) -> tuple[dict[str, tuple[int, int]], tuple[int, int]]:
    """``{product: (K, N)}`` of one decoder layer (``W [N, K]``) and the LM head's ``(K, N)``."""
    hidden, q, kv, inter, vocab = MODELS[model]
    layer = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    return layer, (hidden, vocab)


def _candidate(text: str) -> tuple[bool, Optional[tuple[int, int, int, int, int]]]:
    """``(tma, tile)`` of ``KERNEL:BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages``, or of a bare
    ``KERNEL``: that kernel with the library's own tile choice (``tile`` None)."""
    kernel, _, tile = text.partition(":")
    values = tuple(int(x) for x in tile.split(",")) if tile else None
    if kernel not in ("tma", "pointer") or (values is not None and len(values) != 5):
        raise ValueError(f"a candidate is tma|pointer[:BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages], got {text!r}")
    return kernel == "tma", values  # type: ignore[return-value]


def _operands(layout: str, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b_t)`` of ``matmul_forward`` for ``layout`` (``x [M, K]``, ``g [M, N]``, ``w [N, K]``)."""
    return {"fwd": (x, w), "dx": (g, w.t()), "dw": (g.t(), x.t())}[layout]


def _check(tma: bool, tile, x: torch.Tensor, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Rows bitwise equal among M rows and among the first 7; error within the bound the CPU tests
    use for ``bi_matmul`` (the contract's attention class plus one rounding to the output dtype)."""
    full = matmul_forward(x, w, None, tile, tma)
    invariant = torch.equal(full[:7], matmul_forward(x[:7], w, None, tile, tma))
    ref = x.double() @ w.double().T
    tol = contract.tolerance("attention", x.dtype)
    excess = ((full.double() - ref).abs() - (tol.atol + (tol.rtol + torch.finfo(x.dtype).eps) * ref.abs())).max().item()
    return {
        "rows_bitwise_invariant": invariant,
        "worst_excess_over_bound": excess,
        "ok": invariant and excess <= 0,
    }, full


def _fastest(rows_out: list[dict]) -> dict[int, str]:
    """The fastest candidate (weighted) at each row count."""
    return {
        e["rows"]: min(
            (c for c, r in e["candidates"].items() if "weighted_ms" in r),
            key=lambda c: e["candidates"][c]["weighted_ms"],
            default=None,
        )
        for e in rows_out
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--candidates",
        default=";".join(CANDIDATES),
        help="';'-separated tma|pointer:BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages",
    )
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-1.7b")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"','-separated, of {LAYOUTS}")
    p.add_argument("--rows", default="8192,512")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--timing",
        choices=("graph", "eager"),
        default="graph",
        help="graph: each call's device time (--graph-calls calls captured in a CUDA graph); eager: "
        "host-launched calls timed with events, which also counts a short product's launch",
    )
    p.add_argument("--graph-calls", type=int, default=10)
    p.add_argument("--out", default=None, help="directory for sweep_bi_matmul_tiles.json")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    candidates = [(text, *_candidate(text)) for text in args.candidates.split(";") if text]
    layouts = [name for name in args.layouts.split(",") if name]
    if any(name not in LAYOUTS for name in layouts):
        p.error(f"--layouts: each of {LAYOUTS}, got {args.layouts!r}")
    layer, lm_head = _layer(args.model)
    shapes = {f"{name}.{layout}": kn for name, kn in layer.items() for layout in layouts} | {"lm_head.fwd": lm_head}
    weights = {key: args.layers for key in shapes} | {"lm_head.fwd": 1}
    g = torch.Generator(device=device).manual_seed(0)
    mats = {
        name: torch.randn(n, k, device=device, dtype=dtype, generator=g) * k**-0.5
        for name, (k, n) in (layer | {"lm_head": lm_head}).items()
    }

    def timed_ms(fn) -> float:
        if args.timing == "eager":
            return bench.time_ms(fn, device, warmup=args.warmup, reps=args.reps)["median_ms"]
        timed = bench.graph_time_ms(fn, device, warmup=args.warmup, reps=args.reps, calls=args.graph_calls)
        if "skipped" in timed:
            raise RuntimeError(timed["skipped"])
        return timed["median_ms"]

    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        dims = {k for k, _ in shapes.values()} | {n for key, (_, n) in shapes.items() if key != "lm_head.fwd"}
        acts = {d: torch.randn(m, d, device=device, dtype=dtype, generator=g) for d in dims}

        def operands(key: str) -> tuple[torch.Tensor, torch.Tensor]:
            name, layout = key.split(".")
            k, n = shapes[key]
            return _operands(layout, acts[k], acts.get(n, acts[k]), mats[name])

        entry = {"rows": m, "cublas": {}, "candidates": {}}
        for key in shapes:
            a, b_t = operands(key)
            entry["cublas"][key] = timed_ms(lambda: a @ b_t.T)
        entry["cublas_weighted_ms"] = sum(weights[key] * t for key, t in entry["cublas"].items())
        print(f"M={m}: cuBLAS weighted {entry['cublas_weighted_ms']:.3f} ms")
        first_bits = None
        for text, tma, tile in candidates:
            try:
                check, bits = _check(tma, tile, acts[layer["q_proj"][0]], mats["q_proj"])
                first_bits = bits if first_bits is None else first_bits
                check["bits_equal_first_candidate"] = torch.equal(bits, first_bits)
                times = {}
                for key in shapes:
                    a, b_t = operands(key)
                    times[key] = timed_ms(lambda: matmul_forward(a, b_t, None, tile, tma))
            except Exception as exc:  # a tile that does not compile (shared memory) is reported, not fatal
                entry["candidates"][text] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                print(f"  {text:>24}: {entry['candidates'][text]['error']}")
                continue
            weighted = sum(weights[key] * t for key, t in times.items())
            by_layout = {
                layout: sum(t for key, t in times.items() if key.endswith("." + layout))
                / sum(t for key, t in entry["cublas"].items() if key.endswith("." + layout))
                for layout in layouts
            }
            entry["candidates"][text] = {
                "check": check,
                "ms": times,
                "weighted_ms": weighted,
                "over_cublas": weighted / entry["cublas_weighted_ms"],
                "over_cublas_by_layout": by_layout,
            }
            print(
                f"  {text:>24}: weighted {weighted:.3f} ms ({weighted / entry['cublas_weighted_ms']:.2f}x cuBLAS; "
                + ", ".join(f"{layout} {r:.2f}x" for layout, r in by_layout.items())
                + f"), check ok={check['ok']}, bits = first's: {check['bits_equal_first_candidate']}"
            )
        rows_out.append(entry)
    fastest = _fastest(rows_out)
    for rows, text in fastest.items():
        print(f"fastest at M={rows}: {text}")
    result = {
        "benchmark": "batch-invariant matmul tile sweep",
        "command": bench.command_line(),
        "environment": bench.environment(device),
        "dtype": args.dtype,
        "model": args.model,
        "current": {
            "pointer_tile": list(matmul_tile(dtype, device)),
            "tma_tile": list(TMA_MATMUL_TILES[dtype]),
            "tma_min_rows": TMA_MIN_ROWS,
            "tma_on_this_device": uses_tma(dtype, device, TMA_MIN_ROWS),
        },
        "shapes_k_n": shapes,
        "weights": weights,
        "timing": {
            "warmup": args.warmup,
            "reps": args.reps,
            "statistic": "median",
            "mode": args.timing,
            "graph_calls": args.graph_calls if args.timing == "graph" else None,
        },
        "rows": rows_out,
        "fastest": fastest,
    }
    if args.out:
        bench.write_json(args.out, "sweep_bi_matmul_tiles.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
