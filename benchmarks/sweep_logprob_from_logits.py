"""Sweep the Triton ``logprob_from_logits`` forward tile: ``(largest BLOCK_V, num_warps)``.

Times the forward kernel alone (``logprob_fwd``, no validation or dispatch) with and without
entropy for each tile on bf16 logits ``[N, V]``, next to the time to read the logits once at the
copy bandwidth measured in the same run, and checks each tile's log-prob against fp32 eager. One
tile serves both entropy settings (see ``triton/tuning.py: FWD_TILE``), so the ranking is by their
summed time.

    python benchmarks/sweep_logprob_from_logits.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_losses as BL  # noqa: E402

from rl_kernel_core.tools import bench  # noqa: E402
from rl_kernel_core.logprob import triton as L  # noqa: E402
from rl_kernel_core.triton.tuning import FWD_TILE  # noqa: E402


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    BL.add_common_args(parser)
    parser.add_argument("--block-v", default="2048,4096,8192,16384")
    parser.add_argument("--warps", default="4,8,16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the sweep times CUDA kernels: it needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = BL.copy_bandwidth_gbs(args, dev)
    logits = (torch.randn(args.n, args.v, device=dev) * 3).to(torch.bfloat16)
    targets = torch.randint(0, args.v, (args.n,), device=dev)
    read_once_ms = logits.numel() * logits.element_size() / (bandwidth["gbs"] * 1e9) * 1e3
    eager = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]
    rows = []
    for block_v in map(int, args.block_v.split(",")):
        for warps in map(int, args.warps.split(",")):
            row: dict = {"block_v": block_v, "num_warps": warps}
            for ent in (False, True):
                fn = lambda: L.logprob_fwd(logits, targets, 1.0, -100, ent, tile=(block_v, warps))  # noqa: E731
                key = "entropy" if ent else "no_entropy"
                row[key] = bench.time_ms(fn, dev, warmup=args.warmup, reps=args.reps)
                row[key]["x_read_once"] = row[key]["median_ms"] / read_once_ms
                row[f"max_abs_diff_vs_fp32_eager_{key}"] = float((fn()[0] - eager).abs().max())
            row["sum_ms"] = row["no_entropy"]["median_ms"] + row["entropy"]["median_ms"]
            rows.append(row)
            print(
                f"BLOCK_V {block_v:6d} warps {warps:3d}: {row['no_entropy']['median_ms']:.3f} ms, "
                f"with entropy {row['entropy']['median_ms']:.3f} ms (read once {read_once_ms:.3f} ms)",
                flush=True,
            )
    best = min(rows, key=lambda r: r["sum_ms"])
    result = {
        "benchmark": "sweep_logprob_from_logits",
        "command": bench.command_line(),
        "environment": bench.environment(dev),
        "shape": {"N": args.n, "V": args.v},
        "dtype": "bfloat16",
        "copy_bandwidth": bandwidth,
        "read_once_ms_at_copy_bandwidth": read_once_ms,
        "warmup": args.warmup,
        "reps": args.reps,
        "current_tile": list(FWD_TILE),
        "fastest_tile": [best["block_v"], best["num_warps"]],
        "results": rows,
    }
    gpu = result["environment"].get("gpu", "cuda").replace(" ", "_")
    BL.write_result(result, args.out, f"sweep_logprob_from_logits_{gpu}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
