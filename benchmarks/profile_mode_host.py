"""Host cost of one routed product under the batch-invariant mode, piece by piece (CUDA).

A model's ``x @ w.T`` with the mode on passes through: the route's ``torch.library`` kernel,
:func:`rl_kernel_core.batch_invariant_mode.api._matmul` (``dispatch.select`` and the Triton backend's
``matmul``), :func:`rl_kernel_core.batch_invariant_mode.triton.matmul_forward` (output, tile, kernel
choice, descriptors) and the kernel's launch: the C++ launcher's
(:mod:`rl_kernel_core.batch_invariant_mode.triton_launch`; ``native_launch_matmul`` alone) or, in the rows
ending ``_triton_launch``, Triton's. Each row times a loop of one piece alone, in host
microseconds per call (``--calls`` calls after 20 warm-up calls, no synchronisation inside the
loop, median of ``--reps`` loops), at a decode-sized product (8 rows), a prefill-sized one (512)
and one on the TMA kernel (8192). With the mode off, ``x @ w.T`` is one cuBLAS call: the target.
The decode-step rows (:func:`decode_pieces`) do the same for a routed RMSNorm mean and an attention
call of a transformers decode step, against the mode-off mean and ``sdpa``.
Only rows whose device time is below the host time measure the host: a loop of longer kernels
fills the launch queue and times the device (the 8192-row products).
``--cprofile`` adds the top functions of a cProfile of the routed call by own time.

    python benchmarks/profile_mode_host.py --out OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core.tools import bench
from rl_kernel_core.batch_invariant_mode import api as invariance
from rl_kernel_core.batch_invariant_mode import triton as tbi
from rl_kernel_core.batch_invariant_mode import triton_launch as native_launch


def host_us(fn, calls: int, reps: int) -> float:
    """Median over ``reps`` loops of the host microseconds per call of ``calls`` calls of ``fn``."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(loops)


def pieces(rows: int, d_in: int, d_out: int, device: torch.device) -> dict:
    """The pieces of one routed ``x [rows, d_in] @ w [d_out, d_in].T``, each a no-argument callable."""
    x = torch.randn(rows, d_in, device=device, dtype=torch.bfloat16)
    w = torch.randn(d_out, d_in, device=device, dtype=torch.bfloat16) * 0.02
    wt = w.t()
    out = torch.empty(rows, d_out, device=device, dtype=torch.bfloat16)

    return {
        "mode_off_cublas": lambda: x @ wt,
        "mode_on_routed": lambda: x @ wt,  # timed inside the mode
        "invariance_matmul": lambda: invariance._matmul(x, wt),
        "dispatch_select": lambda: dispatch.select("bi_matmul", "auto", x.device, x, wt),
        "mode_on_routed_triton_launch": lambda: x @ wt,  # timed inside the mode, the C++ launcher off
        "matmul_forward": lambda: tbi.matmul_forward(x, w, None),
        "matmul_forward_triton_launch": lambda: tbi.matmul_forward(x, w, None),  # the C++ launcher off
        "native_launch_matmul": lambda: native_launch.matmul(x, w, None),
        "torch_empty": lambda: torch.empty(rows, d_out, device=device, dtype=torch.bfloat16),
        "pointer_kernel_launch": lambda: _pointer_launch(x, w, out),
        "pointer_kernel_triton_run": lambda: _pointer_launch(x, w, out, triton_run=True),
        "compiled_kernel_run": _compiled_run(x, w, out),
    }


def decode_pieces(batch: int, hidden: int, cache: int, device: torch.device) -> dict:
    """The pieces of a decode step's routed RMSNorm mean (``hidden_states.pow(2).mean(-1,
    keepdim=True)`` over ``[batch, 1, hidden]`` fp32, as transformers' Qwen3 RMSNorm) and of its
    attention call (Qwen3-0.6B's 16 query and 8 KV heads of 128 over a ``cache``-token KV cache,
    through :func:`rl_kernel_core.batch_invariant_mode.api_hf.mode_attention`: ``sdpa`` with the mode off), each
    a no-argument callable; names starting ``mode_on`` are timed inside the mode."""
    from types import SimpleNamespace

    from rl_kernel_core.batch_invariant_mode.api_attention import varlen_attention
    from rl_kernel_core.batch_invariant_mode.api_hf import mode_attention
    from rl_kernel_core.batch_invariant_mode import triton_attention as tattn

    squares = torch.randn(batch, 1, hidden, device=device).pow(2)
    rows = squares.view(batch, hidden)
    mean_out = torch.empty(batch, device=device)
    module = SimpleNamespace(is_causal=True, training=False, num_key_value_groups=2)
    query = torch.randn(batch, 16, 1, 128, device=device, dtype=torch.bfloat16)
    key = torch.randn(batch, 8, cache, 128, device=device, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    mask = torch.ones(batch, 1, 1, cache, dtype=torch.bool, device=device)
    q = query.transpose(1, 2).reshape(batch, 16, 128)
    k = key.transpose(1, 2).reshape(batch * cache, 8, 128)
    v = value.transpose(1, 2).reshape(batch * cache, 8, 128)
    cu_q = torch.arange(batch + 1) * 1
    cu_k = torch.arange(batch + 1) * cache
    cu_q_list, cu_k_list = cu_q.tolist(), cu_k.tolist()
    launch = tattn._forward_launch(q.dtype, 16, 8, 128, True)
    tables = tattn._tables(device, launch["BLOCK_M"], tuple(cu_q_list), tuple(cu_k_list))
    attn_out, lse = torch.empty_like(q), torch.empty(batch, 16, device=device)

    def attention_kernel_launch():
        tattn._attention_fwd_kernel[(tables[2].shape[0], 16)](q, k, v, attn_out, lse, *tables, 128**-0.5, **launch)

    return {
        "mean_mode_off": lambda: squares.mean(-1, keepdim=True),
        "mode_on_mean": lambda: squares.mean(-1, keepdim=True),
        "bi_mean": lambda: invariance.bi_mean(squares, -1, True),
        "row_pass_mean": lambda: tbi._row_pass(rows, 0),
        "native_launch_row_stats": lambda: native_launch.row_stats(rows, mean_out, 0, 0.0),
        "attention_mode_off_sdpa": lambda: mode_attention(module, query, key, value, mask, scaling=128**-0.5),
        "mode_on_attention": lambda: mode_attention(module, query, key, value, mask, scaling=128**-0.5),
        "varlen_attention": lambda: varlen_attention(q, k, v, cu_q, cu_k, scale=128**-0.5),
        "attention_forward": lambda: tattn._forward(q, k, v, cu_q_list, cu_k_list, True, 128**-0.5),
        "attention_kernel_launch": attention_kernel_launch,
    }


def _pointer_args(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> tuple[int, tuple, dict, dict]:
    (bm, bn, bk), extra = tbi._tile_for(x, w.shape[0], False, None, False, False)
    m, k = x.shape
    n = w.shape[0]
    progs = tbi._n_programs(-(-m // bm) * -(-n // bn), x.device)
    args = (
        x,
        w,
        x,
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.stride(1),
        w.stride(0),
        out.stride(0),
        out.stride(1),
        progs,
    )
    constexprs = dict(
        HAS_BIAS=False, IEEE=False, UPCAST_DOT=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tbi.MATMUL_GROUP_M
    )
    return progs, args, constexprs, extra


def _pointer_launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, triton_run: bool = False) -> None:
    """The pointer kernel's launch alone, into a preallocated output, tile and grid as
    matmul_forward's: as matmul_forward launches it, or (``triton_run``) through Triton's own
    ``JITFunction.run``."""
    progs, args, constexprs, extra = _pointer_args(x, w, out)
    kernel = tbi._persistent_matmul_kernel.flavour(False) if triton_run else tbi._persistent_matmul_kernel
    kernel[(progs,)](*args, **constexprs, **extra)


def _compiled_run(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor):
    """The floor of a Triton launch: the compiled kernel's C launcher called directly, skipping
    Triton's argument binding, specialisation and cache lookup (valid for these very arguments)."""
    progs, args, constexprs, extra = _pointer_args(x, w, out)
    compiled = tbi._persistent_matmul_kernel.flavour(False)[(progs,)](*args, **constexprs, **extra)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    full = (*args, *constexprs.values())
    return lambda: compiled.run(
        progs, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *full
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="directory for profile_mode_host.json")
    p.add_argument("--rows", default="8,512,8192", help="comma-separated row counts")
    p.add_argument("--d-in", type=int, default=1024, help="K (Qwen3-0.6B's hidden size)")
    p.add_argument("--d-out", type=int, default=3072, help="output columns (Qwen3-0.6B's MLP width)")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cprofile", action="store_true", help="add a cProfile of the routed call at the first row count")
    p.add_argument("--decode-batch", type=int, default=8, help="batch of the decode-step pieces (0: skip them)")
    p.add_argument("--decode-cache", type=int, default=160, help="KV-cache tokens of the decode-step attention")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        timed = {}
        for name, fn in pieces(rows, args.d_in, args.d_out, device).items():
            native_launch.set_enabled(not name.endswith("_triton_launch"))
            with rk.batch_invariant(name.startswith("mode_on_routed")):
                timed[name] = round(host_us(fn, args.calls, args.reps), 2)
            native_launch.set_enabled(True)
        tma = tbi.uses_tma(torch.bfloat16, device, rows)
        results.append({"rows": rows, "tma_kernel": tma, "host_us_per_call": timed})
        print(
            f"rows {rows:6d} ({'TMA' if tma else 'pointer'} kernel): "
            + ", ".join(f"{k} {v:.1f}" for k, v in timed.items()),
            flush=True,
        )
    decode = {}
    if args.decode_batch:
        for name, fn in decode_pieces(args.decode_batch, args.d_in, args.decode_cache, device).items():
            with rk.batch_invariant(name.startswith("mode_on")):
                decode[name] = round(host_us(fn, args.calls, args.reps), 2)
        print(
            f"decode step, batch {args.decode_batch}, cache {args.decode_cache}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in decode.items()),
            flush=True,
        )
    profile_text = None
    if args.cprofile:
        routed = pieces(int(args.rows.split(",")[0]), args.d_in, args.d_out, device)["mode_on_routed"]
        prof = cProfile.Profile()
        with rk.batch_invariant():
            host_us(routed, 100, 1)
            prof.enable()
            for _ in range(args.calls):
                routed()
            prof.disable()
        stream = io.StringIO()
        pstats.Stats(prof, stream=stream).strip_dirs().sort_stats("tottime").print_stats(25)
        profile_text = stream.getvalue()
        print(profile_text)
    result = {
        "benchmark": "host microseconds per routed product, batch-invariant mode, piece by piece",
        "command": bench.command_line(),
        "environment": bench.environment(device),
        "shapes": {"d_in": args.d_in, "d_out": args.d_out, "rows": [r["rows"] for r in results], "dtype": "bfloat16"},
        "settings": {"calls": args.calls, "reps": args.reps, "statistic": "median host us per call"},
        "baseline": "mode_off_cublas: the same x @ w.T with the mode off (one cuBLAS call)",
        "native_launch": {"unavailable_reason": native_launch.unavailable_reason(), **native_launch.stats()},
        "rows": results,
        "cprofile_routed": profile_text,
        "decode_step": {
            "batch": args.decode_batch,
            "cache": args.decode_cache,
            "hidden": args.d_in,
            "host_us_per_call": decode,
        },
    }
    if args.out:
        print("wrote", bench.write_json(args.out, "profile_mode_host.json", result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
