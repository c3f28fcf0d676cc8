"""Benchmark ``logprob_from_logits`` and ``policy_loss`` against eager PyTorch, in one process.

What it measures (every baseline in the same run, on the same inputs):

* ``logprob_from_logits`` on bf16 logits ``[N, V]`` (default N=8192, V=151936): ours (triton
  backend) forward without grad, forward with entropy, forward+backward; eager
  ``log_softmax(logits.float()).gather`` forward and forward+backward; a chunked bf16
  ``log_softmax`` (rows in chunks, verl's ``logprobs_from_logits_v2`` pattern) forward. The floor
  is the time to read the logits once at the copy bandwidth measured here (``dst.copy_(logits)``
  moves 2x the logits' bytes).
* ``policy_loss`` forward+backward over S x T tokens (default 2048 x 512 = 1M, fp32, dual clip,
  k3 KL and entropy terms): ours against the reference backend (eager PyTorch). Timed as
  launched from Python and, where capture works, as a replayed CUDA graph (device time without
  launch overhead). The floor is the bytes that must move (each input read once, each gradient
  written once) at the measured copy bandwidth.

Each timing is the median of ``--reps`` CUDA-event-timed calls after ``--warmup`` calls
(``rl_kernel_core.tools.bench``), so it includes the host's work inside the call (validation with
the target-id check's one sync, dispatch, launches); ``profile_host.py`` separates host and
device time. Peak extra memory is the allocator peak during one call over what was allocated
before it; errors are max |value - fp64 reference| on the same inputs (the fp64
reference is computed in row chunks). The JSON names the GPU, versions, shapes, dtypes and the
command line.

    python benchmarks/bench_losses.py --out benchmarks/results

Runs on CUDA. With ``TRITON_INTERPRET=1 ... --device cpu`` and tiny shapes it runs the same code
on CPU under the Triton interpreter (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Optional

import torch

import rl_kernel_core as rk
from rl_kernel_core.tools import bench

CHUNK_ROWS = 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, args: argparse.Namespace, graph: bool = False) -> dict:
    """Launched time and extra peak memory of ``fn``; with ``graph``, also its CUDA-graph replay time (``cuda_graph``)."""
    out = bench.time_ms(fn, device, warmup=args.warmup, reps=args.reps)
    out["peak_extra_gib"] = bench.peak_extra_gib(fn, device)
    if graph:
        out["cuda_graph"] = bench.graph_time_ms(fn, device, warmup=args.warmup, reps=args.reps)
    return out


# ---------------------------------------------------------------- logprob_from_logits


def _fp64_logprob(logits: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor, g_ent: Optional[torch.Tensor]):
    """fp64 log-prob, entropy and d(sum g_lp·lp + g_ent·ent)/d logits, computed in row chunks (a generator)."""
    for r0 in range(0, logits.shape[0], CHUNK_ROWS):
        rows = slice(r0, r0 + CHUNK_ROWS)
        logp = torch.log_softmax(logits[rows].double(), dim=-1)
        p = logp.exp()
        ent = -(p * logp).sum(-1)
        t = targets[rows]
        lp = logp.gather(-1, t[:, None])[:, 0]
        grad = -g_lp[rows, None].double() * p
        grad.scatter_add_(-1, t[:, None], g_lp[rows, None].double())
        if g_ent is not None:
            grad -= g_ent[rows, None].double() * p * (logp + ent[:, None])
        yield rows, lp, ent, grad


def _max_err(pairs) -> float:
    return max(float((a.double() - b).abs().max()) for a, b in pairs)


def eager_logprob(
    logits: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor
) -> tuple[Callable, Callable]:
    """The eager baseline ``log_softmax(logits.float()).gather``: ``(forward without grad on
    logits, forward+backward on x -> d x)`` with the upstream gradient ``g_lp``."""

    def fwd():
        with torch.no_grad():
            return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]

    def fwd_bwd():
        lp = torch.log_softmax(x.float(), dim=-1).gather(-1, targets[:, None])[:, 0]
        return torch.autograd.grad((lp * g_lp).sum(), (x,))[0]

    return fwd, fwd_bwd


def bench_logprob(args: argparse.Namespace, device: torch.device, bandwidth_gbs: float) -> dict:
    n, v = args.n, args.v
    logits = (torch.randn(n, v, device=device) * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=device)
    g_lp = torch.rand(n, device=device) + 0.5  # non-uniform upstream gradients, as an RL loss sends
    g_ent = torch.rand(n, device=device) * 0.1
    logits_bytes = logits.numel() * logits.element_size()
    read_once_ms = logits_bytes / (bandwidth_gbs * 1e9) * 1e3
    x = logits.detach().requires_grad_()

    def ours_fwd():
        with torch.no_grad():
            return rk.logprob_from_logits(logits, targets, backend="triton")

    def ours_fwd_entropy():
        with torch.no_grad():
            return rk.logprob_from_logits(logits, targets, return_entropy=True, backend="triton")

    def ours_fwd_bwd():
        lp, ent = rk.logprob_from_logits(x, targets, return_entropy=True, backend="triton")
        return torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (x,))[0]

    eager_fwd, eager_fwd_bwd = eager_logprob(logits, x, targets, g_lp)

    def chunked_bf16_fwd():
        with torch.no_grad():
            return torch.cat(
                [
                    torch.log_softmax(logits[r : r + CHUNK_ROWS], dim=-1).gather(-1, targets[r : r + CHUNK_ROWS, None])[
                        :, 0
                    ]
                    for r in range(0, n, CHUNK_ROWS)
                ]
            )

    impls = {
        "ours_fwd_no_grad": ours_fwd,
        "ours_fwd_entropy_no_grad": ours_fwd_entropy,
        "ours_fwd_bwd_entropy": ours_fwd_bwd,
        "eager_fp32_log_softmax_gather_fwd": eager_fwd,
        "eager_fp32_log_softmax_gather_fwd_bwd": eager_fwd_bwd,
        "chunked_bf16_log_softmax_fwd": chunked_bf16_fwd,
    }
    rows = {}
    for name, fn in impls.items():
        rows[name] = _timed(fn, device, args)
        rows[name]["x_read_once"] = rows[name]["median_ms"] / read_once_ms

    # accuracy against fp64 on the same inputs
    ours_lp, ours_ent = ours_fwd_entropy()
    ours_grad = ours_fwd_bwd()
    eager_lp, eager_grad = eager_fwd(), eager_fwd_bwd()
    chunked_lp = chunked_bf16_fwd()
    errs = {
        k: 0.0
        for k in ("ours_logprob", "ours_entropy", "ours_grad", "eager_logprob", "eager_grad", "chunked_bf16_logprob")
    }
    for r, lp64, ent64, grad64 in _fp64_logprob(logits, targets, g_lp, g_ent):
        errs["ours_logprob"] = max(errs["ours_logprob"], _max_err([(ours_lp[r], lp64)]))
        errs["ours_entropy"] = max(errs["ours_entropy"], _max_err([(ours_ent[r], ent64)]))
        errs["ours_grad"] = max(errs["ours_grad"], _max_err([(ours_grad[r], grad64)]))
        errs["eager_logprob"] = max(errs["eager_logprob"], _max_err([(eager_lp[r], lp64)]))
        errs["chunked_bf16_logprob"] = max(errs["chunked_bf16_logprob"], _max_err([(chunked_lp[r], lp64)]))
    for r, _, _, grad64 in _fp64_logprob(logits, targets, g_lp, None):
        errs["eager_grad"] = max(errs["eager_grad"], _max_err([(eager_grad[r], grad64)]))
    target_ratio = 1.3
    return {
        "shape": {"N": n, "V": v},
        "dtype": "bfloat16",
        "temperature": 1.0,
        "logits_gib": logits_bytes / 2**30,
        "read_once_ms_at_copy_bandwidth": read_once_ms,
        "results": rows,
        "max_abs_err_vs_fp64": errs,
        "target": {
            "ours_fwd_no_grad_x_read_once_max": target_ratio,
            "met": rows["ours_fwd_no_grad"]["x_read_once"] <= target_ratio,
        },
    }


# ---------------------------------------------------------------- policy_loss


def bench_policy_loss(args: argparse.Namespace, device: torch.device, bandwidth_gbs: float) -> dict:
    s, t = args.seqs, args.seq_len
    lp = torch.rand(s, t, device=device) * -4 - 0.05
    old = lp + torch.randn(s, t, device=device) * 0.3
    ref = lp + torch.randn(s, t, device=device) * 0.3
    adv = torch.randn(s, t, device=device)
    mask = torch.rand(s, t, device=device) < 0.9
    ent = torch.rand(s, t, device=device) * 3
    knobs = dict(
        ref_logprob=ref,
        clip_ratio_c=3.0,
        kl_type="low_var_kl",
        kl_coef=0.05,
        entropy_coef=0.01,
        loss_agg_mode="token-mean",
    )
    x, e = lp.detach().requires_grad_(), ent.detach().requires_grad_()

    def make(backend: str) -> Callable[[], tuple]:
        def fwd_bwd():
            loss, metrics = rk.policy_loss(x, old, adv, mask, entropy=e, backend=backend, **knobs)
            return torch.autograd.grad(loss, (x, e))

        return fwd_bwd

    # each input read once (5 fp32 tensors + a bool mask), both gradients written once (fp32)
    floor_bytes = s * t * (5 * 4 + 1 + 2 * 4)
    floor_ms = floor_bytes / (bandwidth_gbs * 1e9) * 1e3
    rows = {}
    for name, backend in (("ours", "triton"), ("eager_reference", "torch")):
        fn = make(backend)
        rows[name] = _timed(fn, device, args, graph=True)
        rows[name]["x_bytes_floor"] = rows[name]["median_ms"] / floor_ms
        if "median_ms" in rows[name]["cuda_graph"]:
            rows[name]["cuda_graph"]["x_bytes_floor"] = rows[name]["cuda_graph"]["median_ms"] / floor_ms

    # accuracy: ours and eager fp32 against the reference run on fp64 upcasts of the same inputs
    def run(backend: str, dtype: torch.dtype):
        xx, ee = lp.to(dtype).requires_grad_(), ent.to(dtype).requires_grad_()
        kn = {**knobs, "ref_logprob": ref.to(dtype)}
        loss, metrics = rk.policy_loss(xx, old.to(dtype), adv.to(dtype), mask, entropy=ee, backend=backend, **kn)
        return (loss, *metrics.values(), *torch.autograd.grad(loss, (xx, ee)))

    exact = run("torch", torch.float64)
    errs = {}
    for name, backend in (("ours", "triton"), ("eager_reference", "torch")):
        got = run(backend, torch.float32)
        errs[name] = {
            "loss_and_metrics": _max_err(zip(got[:7], exact[:7])),
            "grad_logprob": _max_err([(got[7], exact[7])]),
            "grad_entropy": _max_err([(got[8], exact[8])]),
        }
    graph = rows["ours"]["cuda_graph"]
    best = graph["median_ms"] if "median_ms" in graph else rows["ours"]["median_ms"]
    return {
        "shape": {"S": s, "T": t, "tokens": s * t},
        "dtype": "float32",
        "mask": "bool",
        "knobs": {k: v for k, v in knobs.items() if k != "ref_logprob"} | {"entropy": True, "ref_logprob": True},
        "bytes_floor_mb": floor_bytes / 1e6,
        "bytes_floor_ms_at_copy_bandwidth": floor_ms,
        "results": rows,
        "max_abs_err_vs_fp64": errs,
        "target": {
            "ours_fwd_bwd_x_bytes_floor_max": 3.0,
            "measured_on": "cuda_graph" if "median_ms" in graph else "launched",
            "met": best / floor_ms <= 3.0,
        },
    }


# ---------------------------------------------------------------- main


def copy_bandwidth_gbs(args: argparse.Namespace, device: torch.device) -> dict:
    """Device copy bandwidth: bytes read + written per second by ``dst.copy_(src)`` (bf16 N x V)."""
    src = torch.randn(args.n, args.v, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    timing = bench.time_ms(lambda: dst.copy_(src), device, warmup=args.warmup, reps=args.reps)
    moved = 2 * src.numel() * src.element_size()
    return {"bytes_moved": moved, **timing, "gbs": moved / (timing["median_ms"] * 1e-3) / 1e9}


def result_head(benchmark: str, args: argparse.Namespace, env: dict, bandwidth: dict) -> dict:
    """The first fields of a loss benchmark's JSON result: what ran, where, and how it was timed."""
    return {
        "benchmark": benchmark,
        "command": bench.command_line(),
        "environment": env,
        "copy_bandwidth": bandwidth,
        "warmup": args.warmup,
        "reps": args.reps,
    }


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The options every loss benchmark takes: ``--out``, the shapes, ``--warmup`` and ``--reps``."""
    parser.add_argument("--out", required=True, help="directory for the JSON result")
    parser.add_argument("--n", type=int, default=8192, help="logits rows")
    parser.add_argument("--v", type=int, default=151936, help="vocabulary size")
    parser.add_argument("--seqs", type=int, default=2048, help="policy_loss sequences")
    parser.add_argument("--seq-len", type=int, default=512, help="policy_loss tokens per sequence")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)


def write_result(result: dict, out: str, filename: str) -> None:
    """Write ``result`` as indented JSON to ``<out>/<filename>`` (creating ``out``) and print it."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, filename)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


def checked_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """``--device``: CUDA when present, or CPU under the Triton interpreter (a smoke test of a script)."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu with TRITON_INTERPRET=1 for a smoke test)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error(
            "--device cpu needs TRITON_INTERPRET=1 (the triton backend runs on CPU only under the interpreter)"
        )
    return device


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), or cpu under TRITON_INTERPRET=1 as a smoke test"
    )
    parser.add_argument("--only", choices=("logprob", "policy_loss"), help="run one of the two benchmarks")
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    torch.manual_seed(0)
    env = bench.environment(device)
    bandwidth = copy_bandwidth_gbs(args, device)
    result = result_head("bench_losses", args, env, bandwidth)
    if args.only in (None, "logprob"):
        result["logprob_from_logits"] = bench_logprob(args, device, bandwidth["gbs"])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.only in (None, "policy_loss"):
        result["policy_loss"] = bench_policy_loss(args, device, bandwidth["gbs"])
    write_result(result, args.out, f"bench_losses_{env.get('gpu', device.type).replace(' ', '_')}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
