"""Host time against device time of the loss ops, and where the host time goes.

``bench_losses.py`` times a call between two CUDA events recorded around it, so a call whose
Python side takes longer than its kernels is timed by its host work. This script separates the
two for each case, in one process:

* ``launched_ms``: the median of CUDA-event-timed calls (what ``bench_losses`` reports);
* ``host_ms``: the wall time per call of enqueuing ``--host-calls`` calls back to back without
  synchronizing (while the GPU is busier than the host this is the host's cost per call);
* ``profile``: the ``--top`` Python functions by cumulative time over those calls (``cProfile``),
  so the overhead can be attributed;
* ``device_ms``: the summed time of the call's CUDA kernels under ``torch.profiler`` (kernels
  only; a CUDA graph cannot capture the public ops, whose target-id check syncs with the host),
  with ``x_floor``, its ratio to the case's floor: the bytes it must move (the logits read once;
  forward+backward: read twice and the gradient written; the policy loss's inputs read and its
  gradient written) at the copy bandwidth measured here. The profiler runs last, after every
  timing: once it has run it stays attached and slows later launches.

Besides the public ops, ``policy_loss_op_fwd_bwd[<backend>, custom op | eager path]`` calls the
backend's op layer directly, both ways (the ``torch.library`` custom op that ``torch.compile``
traces, and the ``torch.autograd.Function`` eager calls take), on the same arguments.

    python benchmarks/profile_host.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import re
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_losses as BL  # noqa: E402

import rl_kernel_core as rk  # noqa: E402
from rl_kernel_core.tools import bench  # noqa: E402


def _host(fn: Callable[[], object], calls: int, top: int) -> tuple[float, list[str]]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    lines = [_short_paths(ln.strip()) for ln in text.getvalue().splitlines() if ln.strip() and ("/" in ln or "{" in ln)]
    return host_ms, lines[:top]


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _short_paths(line: str) -> str:
    """A profile line with file paths relative to this repository or to ``site-packages``."""
    return re.sub(r"\S*/site-packages/", "site-packages/", line.replace(_REPO, ""))


OP_MODULES = {"triton": "rl_kernel_core.loss.triton", "native": "rl_kernel_core.loss.native"}
"""The modules whose ``_policy_loss_op`` is the eager path of each fast backend's policy loss."""


def cases(args: argparse.Namespace, bandwidth_gbs: float) -> dict[str, tuple[Callable[[], object], float]]:
    """``{name: (call, floor ms)}``: ``logprob_from_logits`` (no grad, and forward+backward) and
    ``policy_loss`` forward+backward, per backend."""
    dev = torch.device("cuda")
    n, v = args.n, args.v
    logits = (torch.randn(n, v, device=dev) * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=dev)
    x = logits.detach().requires_grad_()
    g_lp = torch.rand(n, device=dev) + 0.5
    s, t = args.seqs, args.seq_len
    lp = (torch.rand(s, t, device=dev) * -4 - 0.05).requires_grad_()
    old = lp.detach() + torch.randn(s, t, device=dev) * 0.3
    ref = lp.detach() + torch.randn(s, t, device=dev) * 0.3
    adv = torch.randn(s, t, device=dev)
    mask = torch.rand(s, t, device=dev) < 0.9
    read_once_ms = logits.numel() * logits.element_size() / (bandwidth_gbs * 1e9) * 1e3
    # as bench_losses: logprob, old, ref, advantages read, a bool mask, d logprob written (fp32)
    loss_floor_ms = s * t * (4 * 4 + 1 + 4) / (bandwidth_gbs * 1e9) * 1e3
    out: dict[str, tuple[Callable[[], object], float]] = {}
    for backend in args.backends.split(","):

        def lfl_fwd(backend=backend):
            with torch.no_grad():
                return rk.logprob_from_logits(logits, targets, backend=backend)

        def lfl_fwd_bwd(backend=backend):
            return torch.autograd.grad((rk.logprob_from_logits(x, targets, backend=backend) * g_lp).sum(), (x,))

        def loss_fwd_bwd(backend=backend):
            loss, _ = rk.policy_loss(
                lp,
                old,
                adv,
                mask,
                ref_logprob=ref,
                clip_ratio_c=3.0,
                kl_type="low_var_kl",
                kl_coef=0.05,
                backend=backend,
            )
            return torch.autograd.grad(loss, (lp,))

        out[f"logprob_from_logits_fwd_no_grad[{backend}]"] = (lfl_fwd, read_once_ms)
        # forward+backward: the logits read twice and their gradient written once
        out[f"logprob_from_logits_fwd_bwd[{backend}]"] = (lfl_fwd_bwd, 3 * read_once_ms)
        out[f"policy_loss_fwd_bwd[{backend}]"] = (loss_fwd_bwd, loss_floor_ms)
        if backend in OP_MODULES:  # the op layer alone: the custom op against the eager path
            module = importlib.import_module(OP_MODULES[backend])
            args = (lp, old, adv, mask, ref, None, None, 0.2, 0.2, 3.0, "k3", 0.05, 0.0, "token-mean")
            for label, op in (
                ("custom op", getattr(torch.ops.rl_kernel, f"{backend}_policy_loss")),
                ("eager path", module._policy_loss_op),
            ):

                def op_fwd_bwd(op=op):
                    return torch.autograd.grad(op(*args)[0], (lp,))

                out[f"policy_loss_op_fwd_bwd[{backend}, {label}]"] = (op_fwd_bwd, loss_floor_ms)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="directory for profile_host_<gpu>.json")
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--seqs", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--backends", default="triton,native,torch")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--host-calls", type=int, default=50)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_host.py measures CUDA launches: it needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = BL.copy_bandwidth_gbs(args, dev)
    timed = cases(args, bandwidth["gbs"])
    rows: dict[str, dict] = {}
    for name, (fn, _) in timed.items():
        try:
            launched = bench.time_ms(fn, dev, warmup=args.warmup, reps=args.reps)["median_ms"]
            host_ms, top = _host(fn, args.host_calls, args.top)
        except Exception as exc:  # recorded, never hidden
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        rows[name] = {"launched_ms": launched, "host_ms": host_ms, "profile": top}
    for name, (fn, floor_ms) in timed.items():  # the profiler last (see the module docstring)
        if "error" not in rows[name]:
            device_ms, kernels = bench.kernel_table(fn, warmup=1)
            rows[name].update(device_ms=device_ms, floor_ms=floor_ms, x_floor=device_ms / floor_ms, kernels=kernels)
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:45s} error: {row['error']}")
        else:
            print(
                f"{name:45s} launched {row['launched_ms']:8.3f} ms  host {row['host_ms']:8.3f} ms  "
                f"device {row['device_ms']:8.3f} ms = {row['x_floor']:6.2f}x floor"
            )
    result = {
        "benchmark": "profile_host",
        "command": bench.command_line(),
        "environment": bench.environment(dev),
        "shapes": {
            "logprob_from_logits": {"N": args.n, "V": args.v, "dtype": "bfloat16"},
            "policy_loss": {"S": args.seqs, "T": args.seq_len, "dtype": "float32"},
        },
        "copy_bandwidth": bandwidth,
        "reps": args.reps,
        "host_calls": args.host_calls,
        "results": rows,
    }
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"profile_host_{torch.cuda.get_device_name(dev).replace(' ', '_')}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
