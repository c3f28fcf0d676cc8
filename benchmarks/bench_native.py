"""Native CUDA backend against the Triton backend and eager PyTorch, in one process, and the ``auto`` order they imply.

What it measures (every implementation in the same run, on the same inputs):

* ``logprob_from_logits`` on bf16 logits ``[N, V]`` (default N=8192, V=151936): native and triton
  forward without grad (log-prob only, and with entropy) and forward+backward with entropy;
  eager ``log_softmax(logits.float()).gather`` forward and forward+backward. The floor is one
  read of the logits at the copy bandwidth measured here.
* ``policy_loss`` forward+backward over S x T tokens (default 2048 x 512 = 1M, fp32, dual clip,
  k3 KL, entropy term): native, triton and the reference (eager PyTorch), launched from Python
  and replayed as a CUDA graph (device time without launch overhead). Floor: each input read once
  and both gradients written once at the copy bandwidth.
* ``ratio_kl`` forward+backward over the same tokens and ``group_advantages`` over 64k rewards in
  groups of 16 (by size, and by index), native, triton and eager.
* ``linear_logprob`` at ``--linear-shape`` (default N=16384, D=4096, V=128256, bf16): native and
  triton forward without grad (log-probs only: the old/ref passes) and forward+backward with
  entropy; the order follows the time of one RL step's share, two no-grad forwards plus one
  forward+backward.

Errors are max |value - fp64 reference| on the same inputs. For each op the faster of native and
Triton (CUDA-graph time where capture worked, else launched time; forward+backward where there is
a backward) goes first in ``auto_order``: that is the order each op's ``measured_order`` in
``rl_kernel_core.ops.OPS`` records for this GPU architecture.

    python benchmarks/bench_native.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core.tools import bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_losses import (  # noqa: E402
    _fp64_logprob,
    _max_err,
    _timed,
    add_common_args,
    copy_bandwidth_gbs,
    eager_logprob,
    result_head,
    write_result,
)

FAST = ("native", "triton")


def _best_ms(row: dict) -> float:
    graph = row.get("cuda_graph", {})
    return graph["median_ms"] if "median_ms" in graph else row["median_ms"]


def _order(rows: dict, key: str) -> tuple[str, ...]:
    """``auto`` order for an op: native and triton by ``rows[f"{backend}_{key}"]``'s time, then torch."""
    fast = sorted(FAST, key=lambda b: _best_ms(rows[f"{b}_{key}"]))
    return (*fast, "torch")


def bench_logprob(args: argparse.Namespace, device: torch.device, bandwidth_gbs: float) -> dict:
    n, v = args.n, args.v
    logits = (torch.randn(n, v, device=device) * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=device)
    g_lp = torch.rand(n, device=device) + 0.5  # non-uniform upstream gradients
    g_ent = torch.rand(n, device=device) * 0.1
    read_once_ms = logits.numel() * logits.element_size() / (bandwidth_gbs * 1e9) * 1e3
    x = logits.detach().requires_grad_()

    def fwd(backend: str, entropy: bool):
        def run():
            with torch.no_grad():
                return rk.logprob_from_logits(logits, targets, return_entropy=entropy, backend=backend)

        return run

    def fwd_bwd(backend: str):
        def run():
            lp, ent = rk.logprob_from_logits(x, targets, return_entropy=True, backend=backend)
            return torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (x,))[0]

        return run

    eager_fwd, eager_fwd_bwd = eager_logprob(logits, x, targets, g_lp)

    impls = {"eager_fwd_no_grad": eager_fwd, "eager_fwd_bwd": eager_fwd_bwd}
    for b in FAST:
        impls[f"{b}_fwd_no_grad"] = fwd(b, False)
        impls[f"{b}_fwd_entropy_no_grad"] = fwd(b, True)
        impls[f"{b}_fwd_bwd_entropy"] = fwd_bwd(b)
    rows = {}
    for name, fn in impls.items():
        rows[name] = _timed(fn, device, args)
        rows[name]["x_read_once"] = rows[name]["median_ms"] / read_once_ms
    errs = {}
    for b in FAST:
        lp, ent = fwd(b, True)()
        grad = fwd_bwd(b)()
        e = {"logprob": 0.0, "entropy": 0.0, "grad": 0.0}
        for r, lp64, ent64, grad64 in _fp64_logprob(logits, targets, g_lp, g_ent):
            e["logprob"] = max(e["logprob"], _max_err([(lp[r], lp64)]))
            e["entropy"] = max(e["entropy"], _max_err([(ent[r], ent64)]))
            e["grad"] = max(e["grad"], _max_err([(grad[r], grad64)]))
        errs[b] = e
        del grad
    return {
        "shape": {"N": n, "V": v},
        "dtype": "bfloat16",
        "read_once_ms_at_copy_bandwidth": read_once_ms,
        "results": rows,
        "max_abs_err_vs_fp64": errs,
        "auto_order": _order(rows, "fwd_bwd_entropy"),
        "auto_order_rule": "faster forward+backward with entropy",
    }


def _tokens(args: argparse.Namespace, device: torch.device) -> dict:
    s, t = args.seqs, args.seq_len
    lp = torch.rand(s, t, device=device) * -4 - 0.05
    return dict(
        lp=lp,
        old=lp + torch.randn(s, t, device=device) * 0.3,
        ref=lp + torch.randn(s, t, device=device) * 0.3,
        adv=torch.randn(s, t, device=device),
        mask=torch.rand(s, t, device=device) < 0.9,
        ent=torch.rand(s, t, device=device) * 3,
    )


def bench_policy_loss(args: argparse.Namespace, device: torch.device, bandwidth_gbs: float) -> dict:
    tk = _tokens(args, device)
    s, t = tk["lp"].shape
    knobs = dict(clip_ratio_c=3.0, kl_type="low_var_kl", kl_coef=0.05, entropy_coef=0.01, loss_agg_mode="token-mean")
    x, e = tk["lp"].detach().requires_grad_(), tk["ent"].detach().requires_grad_()

    def make(backend: str) -> Callable[[], tuple]:
        def fwd_bwd():
            loss, _ = rk.policy_loss(
                x, tk["old"], tk["adv"], tk["mask"], ref_logprob=tk["ref"], entropy=e, backend=backend, **knobs
            )
            return torch.autograd.grad(loss, (x, e))

        return fwd_bwd

    floor_ms = s * t * (5 * 4 + 1 + 2 * 4) / (bandwidth_gbs * 1e9) * 1e3
    rows = {}
    for name, backend in (
        ("native_fwd_bwd", "native"),
        ("triton_fwd_bwd", "triton"),
        ("eager_reference_fwd_bwd", "torch"),
    ):
        rows[name] = _timed(make(backend), device, args, graph=True)
        rows[name]["x_bytes_floor"] = _best_ms(rows[name]) / floor_ms

    def run(backend: str, dtype: torch.dtype):
        xx, ee = tk["lp"].to(dtype).requires_grad_(), tk["ent"].to(dtype).requires_grad_()
        loss, metrics = rk.policy_loss(
            xx,
            tk["old"].to(dtype),
            tk["adv"].to(dtype),
            tk["mask"],
            ref_logprob=tk["ref"].to(dtype),
            entropy=ee,
            backend=backend,
            **knobs,
        )
        return (loss, *metrics.values(), *torch.autograd.grad(loss, (xx, ee)))

    exact = run("torch", torch.float64)
    errs = {}
    for b in FAST:
        got = run(b, torch.float32)
        errs[b] = {
            "loss_and_metrics": _max_err(zip(got[:7], exact[:7])),
            "grad_logprob": _max_err([(got[7], exact[7])]),
            "grad_entropy": _max_err([(got[8], exact[8])]),
        }
    return {
        "shape": {"S": s, "T": t, "tokens": s * t},
        "dtype": "float32",
        "knobs": knobs,
        "bytes_floor_ms_at_copy_bandwidth": floor_ms,
        "results": rows,
        "max_abs_err_vs_fp64": errs,
        "auto_order": _order(rows, "fwd_bwd"),
        "auto_order_rule": "faster forward+backward (CUDA graph replay)",
    }


def bench_ratio_kl(args: argparse.Namespace, device: torch.device) -> dict:
    tk = _tokens(args, device)
    x = tk["lp"].detach().requires_grad_()
    g = torch.rand_like(x)

    def make(backend: str):
        def fwd_bwd():
            ratio, kl = rk.ratio_kl(x, tk["old"], tk["ref"], kl_type="low_var_kl", backend=backend)
            return torch.autograd.grad((ratio * g).sum() + kl.sum(), (x,))

        return fwd_bwd

    rows = {
        f"{n}_fwd_bwd": _timed(make(b), device, args, graph=True)
        for n, b in (("native", "native"), ("triton", "triton"), ("eager", "torch"))
    }
    return {
        "shape": {"tokens": x.numel()},
        "results": rows,
        "auto_order": _order(rows, "fwd_bwd"),
        "auto_order_rule": "faster forward+backward (CUDA graph replay)",
    }


def bench_group_advantages(args: argparse.Namespace, device: torch.device) -> dict:
    n, size = 65536, 16
    rewards = torch.randn(n, device=device)
    index = torch.randperm(n, device=device) // size

    rows = {}
    for name, backend in (("native", "native"), ("triton", "triton"), ("eager", "torch")):
        rows[f"{name}_by_size"] = _timed(
            lambda b=backend: rk.group_advantages(rewards, group_size=size, backend=b), device, args
        )
        rows[f"{name}_by_index"] = _timed(
            lambda b=backend: rk.group_advantages(rewards, group_index=index, backend=b), device, args
        )
    exact = rk.group_advantages(rewards.double(), group_size=size, backend="torch")
    errs = {b: _max_err([(rk.group_advantages(rewards, group_size=size, backend=b), exact)]) for b in FAST}
    return {
        "shape": {"N": n, "group_size": size},
        "results": rows,
        "max_abs_err_vs_fp64_by_size": errs,
        "auto_order": _order(rows, "by_index"),
        "auto_order_rule": "faster by index (the layout-free case)",
    }


def bench_linear_logprob(args: argparse.Namespace, device: torch.device) -> dict:
    n, d, v = (int(x) for x in args.linear_shape.split(","))
    hidden = torch.randn(n, d, device=device).to(torch.bfloat16)
    weight = (torch.randn(v, d, device=device) * (3.0 / d**0.5)).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=device)
    g_lp = torch.rand(n, device=device) + 0.5  # non-uniform upstream gradients
    g_ent = torch.rand(n, device=device) * 0.1

    def fwd(backend: str):
        def run():
            with torch.no_grad():
                return rk.linear_logprob(hidden, weight, targets, backend=backend)

        return run

    def fwd_bwd(backend: str):
        def run():
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            lp, ent = rk.linear_logprob(h, w, targets, return_entropy=True, backend=backend)
            return torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w))

        return run

    rows = {"cublas_logits_floor": _timed(lambda: hidden @ weight.T, device, args)}
    for b in FAST:
        rows[f"{b}_fwd_no_grad"] = _timed(fwd(b), device, args)
        rows[f"{b}_fwd_bwd_entropy"] = _timed(fwd_bwd(b), device, args)
        rows[f"{b}_rl_step"] = {
            "median_ms": 2 * rows[f"{b}_fwd_no_grad"]["median_ms"] + rows[f"{b}_fwd_bwd_entropy"]["median_ms"]
        }
    rows_ref = min(n, 1024)
    lp64 = torch.log_softmax(hidden[:rows_ref].double() @ weight.double().T, dim=-1).gather(
        -1, targets[:rows_ref, None]
    )[:, 0]
    errs = {b: _max_err([(fwd(b)()[:rows_ref], lp64)]) for b in FAST}
    return {
        "shape": {"N": n, "D": d, "V": v},
        "dtype": "bfloat16",
        "results": rows,
        "max_abs_err_logprob_vs_fp64_first_rows": errs,
        "auto_order": _order(rows, "rl_step"),
        "auto_order_rule": "faster 2 x forward without grad + 1 x forward+backward with entropy",
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--linear-shape", default="16384,4096,128256", help="N,D,V of the linear_logprob measurement")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda")
    torch.manual_seed(0)
    env = bench.environment(device)
    env["native"] = dispatch.backend_status()["native"] or "available"
    bandwidth = copy_bandwidth_gbs(args, device)
    result = result_head("bench_native", args, env, bandwidth)
    result["logprob_from_logits"] = bench_logprob(args, device, bandwidth["gbs"])
    torch.cuda.empty_cache()
    result["policy_loss"] = bench_policy_loss(args, device, bandwidth["gbs"])
    result["ratio_kl"] = bench_ratio_kl(args, device)
    result["group_advantages"] = bench_group_advantages(args, device)
    torch.cuda.empty_cache()
    result["linear_logprob"] = bench_linear_logprob(args, device)
    major, minor = torch.cuda.get_device_capability(device)
    result["measured_preference"] = {
        f"{major}.{minor}": {
            op: result[op]["auto_order"]
            for op in ("logprob_from_logits", "policy_loss", "ratio_kl", "group_advantages", "linear_logprob")
        }
    }
    write_result(result, args.out, f"bench_native_{env.get('gpu', 'cuda').replace(' ', '_')}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
