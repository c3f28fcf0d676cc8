"""The ``rl-kernel`` command: ``info``, ``bench`` and ``compare``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

import torch

from rl_kernel_core import bench, dispatch, profiling


def _info(args: argparse.Namespace) -> int:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    env = bench.environment(device)
    import rl_kernel_core

    env["rl_kernel"] = rl_kernel_core.__version__
    env["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    status = dispatch.backend_status()
    backends = {
        name: ("available" if reason is None else f"unavailable: {reason}")
        for name, reason in status.items()
    }
    if status.get("triton") is None and device.type != "cuda":
        backends["triton"] = "imports, but runs only on CUDA tensors (or under TRITON_INTERPRET=1 when named explicitly)"
    env["backends"] = backends
    env["default_backend"] = dispatch.default_backend()
    if args.json:
        print(json.dumps(env, indent=2))
        return 0
    width = max(len(k) for k in env)
    for key, value in env.items():
        if key == "backends":
            print("backends:")
            for name, text in value.items():
                print(f"  {name:<{width - 2}} {text}")
        else:
            print(f"{key:<{width}} {value}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from rl_kernel_core.logprob import linear_logprob

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    n, d, v = args.tokens, args.hidden, args.vocab
    hidden = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, d, device=device, dtype=dtype) / d**0.5).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device=device)
    upstream = torch.rand(n, device=device)

    def ours_fwd_bwd():
        lp = linear_logprob(hidden, weight, targets, backend=args.backend)
        torch.autograd.grad(lp, (hidden, weight), upstream)

    def eager_fwd_bwd():
        logits = hidden @ weight.T
        lp = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
        torch.autograd.grad(lp, (hidden, weight), upstream)

    rows = []
    for name, fn in (("rl_kernel", ours_fwd_bwd), ("eager", eager_fwd_bwd)):
        timing = bench.time_ms(fn, device, warmup=args.warmup, reps=args.reps)
        rows.append({"impl": name, **timing, "peak_extra_gib": bench.peak_extra_gib(fn, device)})
    decision = dispatch.explain("linear_logprob")
    result = {
        "op": "linear_logprob forward+backward",
        "command": bench.command_line(),
        "shape": {"N": n, "D": d, "V": v},
        "dtype": args.dtype,
        "backend": decision.backend if decision else None,
        "environment": bench.environment(device),
        "results": rows,
        "ratio_to_eager": rows[0]["median_ms"] / rows[1]["median_ms"],
    }
    print(f"linear_logprob fwd+bwd N={n} D={d} V={v} {args.dtype} on {device} (backend {result['backend']})")
    print(f"{'impl':<12}{'median ms':>12}{'peak extra GiB':>16}")
    for row in rows:
        mem = "n/a" if row["peak_extra_gib"] is None else f"{row['peak_extra_gib']:.3f}"
        print(f"{row['impl']:<12}{row['median_ms']:>12.3f}{mem:>16}")
    print(f"ratio rl_kernel/eager: {result['ratio_to_eager']:.3f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def compare_table(off: list[dict[str, Any]], on: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of (metric, off stats, on stats, on/off ratio of means) for two step-record lists."""
    s_off, s_on = profiling.summarize(off), profiling.summarize(on)
    rows = []
    for key in sorted(set(s_off) | set(s_on)):
        a, b = s_off.get(key, {"n": 0}), s_on.get(key, {"n": 0})
        ratio = b["mean"] / a["mean"] if a.get("n") and b.get("n") and a["mean"] else None
        rows.append({"metric": key, "off": a, "on": b, "on_over_off": ratio})
    return rows


def _compare(args: argparse.Namespace) -> int:
    off, on = profiling.read_jsonl(args.off), profiling.read_jsonl(args.on)
    rows = compare_table(off, on)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"OFF: {args.off} ({len(off)} steps)   ON: {args.on} ({len(on)} steps)")
    header = f"{'metric':<24}" + "".join(f"{f'{side} {stat}':>12}" for side in ("off", "on") for stat in ("mean", "p50", "p90", "p99")) + f"{'on/off':>10}"
    print(header)
    for row in rows:
        cells = "".join(_fmt(row[side].get(stat)) .rjust(12) for side in ("off", "on") for stat in ("mean", "p50", "p90", "p99"))
        print(f"{row['metric']:<24}{cells}{_fmt(row['on_over_off']).rjust(10)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rl-kernel``."""
    parser = argparse.ArgumentParser(prog="rl-kernel", description="rl-kernel operators: environment, benchmarks, step-log comparison")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, devices and which backends are available (and why not)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_info)

    p = sub.add_parser("bench", help="time linear_logprob forward+backward against eager PyTorch")
    p.add_argument("--tokens", "-N", type=int, default=2048)
    p.add_argument("--hidden", "-D", type=int, default=256)
    p.add_argument("--vocab", "-V", type=int, default=32000)
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--backend", default="auto", help="auto, native, triton or torch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.set_defaults(func=_bench)

    p = sub.add_parser("compare", help="compare two step-record JSONL files (flag off vs on)")
    p.add_argument("off")
    p.add_argument("on")
    p.add_argument("--json", action="store_true", help="print JSON rows")
    p.set_defaults(func=_compare)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``rl-kernel`` console script."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
