"""Benchmark ``varlen_attention``'s forward and backward at Qwen3-0.6B's attention shapes.

Methods, on the same packed inputs in the same run (16 query / 8 KV heads, head_dim 128, bf16,
causal, scale ``D ** -0.5``, by default):

* ``triton``: rl-kernel's Triton forward and backward (``backend="triton"``);
* ``triton_per_sequence_bwd``: the same Triton forward with the backward it had before (a Python
  loop over the sequences: dense fp32 PyTorch products from the forward's lse, kept here as the
  baseline the Triton backward replaced);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch picks its kernel: flash
  on Hopper) over ``[B, H, L, D]`` with every sequence right-padded to the longest, ``is_causal``
  and ``enable_gqa`` (K/V repeated to the query heads before timing where this torch's SDPA
  refuses it); the layout conversion is not timed, padded rows are computed and discarded;
* ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention over the packed
  layout) where this torch has it; its error is recorded otherwise.

Layouts (``--layouts``): ``BxL`` is B sequences of L tokens; ``BxL1-L2`` is B lengths drawn
uniformly from [L1, L2] (seeded). Per layout and method: the forward, the backward alone (one
``autograd.grad`` over the retained graph) and their sum, each the median of ``--reps``
CUDA-event timings after ``--warmup`` calls (``rl_kernel_core.tools.bench``), and the peak extra
memory of forward + backward. Checks per layout: the Triton gradients bitwise equal over two
calls, and their largest difference from the per-sequence baseline's relative to the largest
gradient (both are fp32-accumulated approximations; the tests hold each to the fp64 formula).

``--sweep`` also times the Triton backward alone for each candidate ``(dq tile; dk/dv tile)``,
each ``BLOCK_M,BLOCK_N,num_warps,num_stages`` (see ``triton/tuning.py: BWD_TILES``), with its
gradients' largest difference from the current tiles' (relative, as above); a tile that does not
compile is reported, not fatal.

    python benchmarks/bench_attention.py --sweep --out benchmarks/results

Runs on CUDA. ``--device cpu`` runs the Triton kernels under the interpreter with tiny shapes
(``--layouts 2x20,3x5-17 --heads 4,2 --head-dim 8 --warmup 0 --reps 1``): a smoke test of the
script, not a measurement.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import random
import sys
from typing import Callable, Optional

import torch

import rl_kernel_core as rk
from rl_kernel_core.tools import bench
from rl_kernel_core.batch_invariant_mode import triton_attention as triton_attention
from rl_kernel_core.triton.tuning import BWD_TILES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SWEEP = [
    "64,32,8,2;32,64,8,2",
    "64,32,4,2;32,64,4,2",
    "64,32,8,3;32,64,8,3",
    "128,32,8,2;32,128,8,2",
    "64,64,8,2;64,64,8,2",
    "128,64,8,2;64,128,8,2",
    "64,32,8,2;16,64,8,2",
    "128,32,4,3;32,128,4,3",
]


def per_sequence_backward(q, k, v, out, lse, grad_out, cu_q, cu_k, causal, scale):
    """The backward ``varlen_attention``'s Triton backend had before its Triton one: per sequence,
    dense fp32 products with K/V repeated to the query heads (``P = exp(S - lse)``,
    ``dS = P (dP - rowsum(dO O))``)."""
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        qb = q[qs:qe].float().transpose(0, 1)
        kb = k[ks:ke].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[ks:ke].float().repeat_interleave(group, dim=1).transpose(0, 1)
        go = grad_out[qs:qe].float().transpose(0, 1)
        s = torch.matmul(qb, kb.transpose(1, 2)) * scale
        if causal:
            lq, lk = qe - qs, ke - ks
            future = torch.arange(lk, device=q.device)[None, :] > (lk - lq + torch.arange(lq, device=q.device))[:, None]
            s = s.masked_fill(future, -math.inf)
        p = torch.exp(s - lse[qs:qe].transpose(0, 1)[..., None])
        ds = (
            p
            * (torch.matmul(go, vb.transpose(1, 2)) - (go * out[qs:qe].float().transpose(0, 1)).sum(-1, keepdim=True))
            * scale
        )
        dq[qs:qe] = torch.matmul(ds, kb).transpose(0, 1)
        hkv = k.shape[1]
        dk[ks:ke] = torch.matmul(ds.transpose(1, 2), qb).view(hkv, group, ke - ks, -1).sum(1).transpose(0, 1)
        dv[ks:ke] = torch.matmul(p.transpose(1, 2), go).view(hkv, group, ke - ks, -1).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _PerSequenceBackward(torch.autograd.Function):
    """The Triton forward with :func:`per_sequence_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale):
        out, lse = triton_attention._forward(q, k, v, cu_q, cu_k, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (cu_q, cu_k, causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        return (*per_sequence_backward(q, k, v, out, lse, grad_out.contiguous(), *ctx.args), None, None, None, None)


def _lengths(layout: str, rng: random.Random) -> list[int]:
    count, _, span = layout.partition("x")
    low, _, high = span.partition("-")
    return [rng.randint(int(low), int(high or low)) for _ in range(int(count))]


def _sdpa(q, k, v, lengths, scale):
    """Forward callable of SDPA over the right-padded batch, and what it ran (the GQA route)."""
    b, lmax = len(lengths), max(lengths)
    starts = [0] + list(torch.tensor(lengths).cumsum(0).tolist())

    def padded(x):
        out = x.new_zeros(b, lmax, x.shape[1], x.shape[2])
        for i, n in enumerate(lengths):
            out[i, :n] = x[starts[i] : starts[i] + n]
        return out.transpose(1, 2).contiguous().detach().requires_grad_()

    qp, kp, vp = padded(q), padded(k), padded(v)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        sdpa(qp[:1, :, :2], kp[:1, :, :2], vp[:1, :, :2], is_causal=True, enable_gqa=True)
        return (qp, kp, vp), lambda: sdpa(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True), "enable_gqa"
    except (TypeError, RuntimeError):
        group = q.shape[1] // k.shape[1]
        kp, vp = (x.detach().repeat_interleave(group, dim=1).requires_grad_() for x in (kp, vp))
        return (qp, kp, vp), lambda: sdpa(qp, kp, vp, is_causal=True, scale=scale), "kv repeated to the query heads"


def _torch_varlen(q, k, v, cu, lengths, scale):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"scale": scale} if "scale" in params else {}
    kwargs.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        group = q.shape[1] // k.shape[1]
        k, v = (x.detach().repeat_interleave(group, dim=1).requires_grad_() for x in (k, v))
    cu = cu.to(torch.int32)
    return (q, k, v), lambda: varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), **kwargs)


def _time_method(leaves, forward: Callable[[], torch.Tensor], device, args) -> dict:
    """Forward, backward alone (over a retained graph) and forward + backward of ``forward``."""
    out = forward()
    grad = torch.randn_like(out)
    backward = lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)  # noqa: E731
    both = lambda: torch.autograd.grad(forward(), leaves, grad)  # noqa: E731
    row = {
        "forward": bench.time_ms(forward, device, warmup=args.warmup, reps=args.reps),
        "backward": bench.time_ms(backward, device, warmup=args.warmup, reps=args.reps),
    }
    row["forward_backward_ms"] = row["forward"]["median_ms"] + row["backward"]["median_ms"]
    row["peak_extra_gib"] = bench.peak_extra_gib(both, device)
    return row


def _relative_diff(got, ref) -> float:
    return max(
        float((g.float() - r.float()).abs().max()) / max(float(r.float().abs().max()), 1e-30) for g, r in zip(got, ref)
    )


def _tile_pair(text: str):
    pair = tuple(tuple(int(x) for x in half.split(",")) for half in text.split(";"))
    if len(pair) != 2 or any(len(t) != 4 for t in pair):
        raise ValueError(
            f"a sweep entry is 'dq BLOCK_M,BLOCK_N,warps,stages;dkdv BLOCK_M,BLOCK_N,warps,stages', got {text!r}"
        )
    return pair


def layout_row(layout: str, args, device, dtype, rng) -> dict:
    lengths = _lengths(layout, rng)
    hq, hkv = (int(x) for x in args.heads.split(","))
    d, t = args.head_dim, sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    c = cu.tolist()
    scale = d**-0.5
    g = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v = (torch.randn(t, h, d, device=device, generator=g).to(dtype).requires_grad_() for h in (hq, hkv, hkv))
    row = {"layout": layout, "lengths": lengths, "tokens": t, "methods": {}}
    methods = {
        "triton": lambda: (
            (q, k, v),
            lambda: rk.varlen_attention(q, k, v, cu, causal=True, scale=scale, backend="triton"),
        ),
        "triton_per_sequence_bwd": lambda: ((q, k, v), lambda: _PerSequenceBackward.apply(q, k, v, c, c, True, scale)),
        "sdpa": lambda: _sdpa(q, k, v, lengths, scale),
        "torch_varlen": lambda: _torch_varlen(q, k, v, cu, lengths, scale),
    }
    for name, make in methods.items():
        try:
            leaves, forward, *how = make()
            row["methods"][name] = {**_time_method(leaves, forward, device, args), **({"route": how[0]} if how else {})}
        except Exception as exc:  # a baseline this torch or device lacks is reported, not fatal
            row["methods"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    out, lse = triton_attention._forward(q.detach(), k.detach(), v.detach(), c, c, True, scale)
    grad_out = torch.randn_like(out)
    bwd_args = (q.detach(), k.detach(), v.detach(), out, lse, grad_out, c, c, True, scale)
    ours = triton_attention._backward(*bwd_args)
    row["triton_bitwise_deterministic"] = all(
        torch.equal(a, b) for a, b in zip(ours, triton_attention._backward(*bwd_args))
    )
    row["triton_vs_per_sequence_relative_diff"] = _relative_diff(ours, per_sequence_backward(*bwd_args))
    if args.sweep and device.type == "cuda":
        row["sweep"] = {}
        for text in args.sweep_tiles.split("|"):
            try:
                tiles = _tile_pair(text)
                grads = triton_attention._backward(*bwd_args, tiles=tiles)
                timing = bench.time_ms(
                    lambda: triton_attention._backward(*bwd_args, tiles=tiles),
                    device,
                    warmup=args.warmup,
                    reps=args.reps,
                )
                row["sweep"][text] = {
                    "backward_ms": timing["median_ms"],
                    "relative_diff_vs_current": _relative_diff(grads, ours),
                }
            except Exception as exc:  # a tile that does not compile (shared memory, registers) is reported
                row["sweep"][text] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return row


def _print_row(row: dict) -> None:
    base = row["methods"]["triton_per_sequence_bwd"].get("forward_backward_ms")
    print(
        f"-- {row['layout']}: {len(row['lengths'])} sequences, {row['tokens']} tokens; Triton backward bitwise "
        f"deterministic: {row['triton_bitwise_deterministic']}, relative diff vs per-sequence: {row['triton_vs_per_sequence_relative_diff']:.2e}"
    )
    print(f"   {'method':<26}{'fwd ms':>10}{'bwd ms':>10}{'fwd+bwd':>10}{'vs per-seq':>12}{'peak GiB':>10}")
    for name, m in row["methods"].items():
        if "error" in m:
            print(f"   {name:<26}{m['error'][:80]}")
            continue
        speed = f"{base / m['forward_backward_ms']:.2f}x" if base else "-"
        peak = "-" if m["peak_extra_gib"] is None else f"{m['peak_extra_gib']:.2f}"
        print(
            f"   {name:<26}{m['forward']['median_ms']:>10.3f}{m['backward']['median_ms']:>10.3f}"
            f"{m['forward_backward_ms']:>10.3f}{speed:>12}{peak:>10}"
        )
    for text, s in row.get("sweep", {}).items():
        done = "error" not in s
        print(
            f"   sweep {text:<24}"
            + (
                f"bwd {s['backward_ms']:.3f} ms, rel diff {s['relative_diff_vs_current']:.1e}"
                if done
                else s["error"][:80]
            )
        )


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="8x1024,16x512,8x512-1024", help="comma-separated BxL or BxL1-L2")
    p.add_argument("--heads", default="16,8", help="query heads,KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    bench.add_timing_options(p, reps=20)
    p.add_argument("--sweep", action="store_true", help="also time the Triton backward at each of --sweep-tiles (CUDA)")
    p.add_argument("--sweep-tiles", default="|".join(SWEEP), help="'|'-separated 'dq tile;dk/dv tile' pairs")
    p.add_argument("--out", default=None, help="directory for bench_attention.json")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the Triton kernels run in the interpreter (a smoke test)
    dtype = DTYPES[args.dtype]
    rng = random.Random(args.seed)
    print(
        f"varlen_attention forward/backward, heads {args.heads}, head_dim {args.head_dim}, {args.dtype}, causal, on {device}"
    )
    rows = []
    for layout in args.layouts.split(","):
        rows.append(layout_row(layout, args, device, dtype, rng))
        _print_row(rows[-1])
    result = {
        "benchmark": "varlen_attention forward and backward: Triton vs the per-sequence backward it replaced, SDPA and torch varlen",
        "command": bench.command_line(),
        "environment": bench.environment(device),
        "shapes": {"heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype, "causal": True},
        "backward_tiles": [list(t) for t in BWD_TILES[dtype]],
        "timing": {"warmup": args.warmup, "reps": args.reps, "statistic": "median"},
        "rows": rows,
    }
    if args.out:
        bench.write_json(args.out, "bench_attention.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
