"""Benchmark ``sample`` (Triton backend) against PyTorch sampling paths and FlashInfer, in one process.

What it measures, on the same logits ``[B, V]`` (default V=151936; B in ``--batch``; fp32 and
bf16; ``randn * 3``), with top-k 50 and top-p 0.9 at temperature 1 unless stated:

* ``ours``: ``rk.sample(logits, top_k=..., top_p=..., seeds=..., backend="triton")``: tokens and
  their log-probs under the full tempered distribution.
* ``torch_sort``: vLLM V1's PyTorch path (``apply_top_k_top_p``: a full descending sort, top-k
  and top-p masks on the sorted row, scatter back, softmax, exponential-race draw) plus the
  sampled token's log-prob from ``log_softmax`` of the fp32 row, as a trainer would need.
* ``torch_topk``: ``torch.topk`` of the fp32 row, top-p and the exponential-race draw on the k
  values, the log-prob from ``logsumexp`` of the full row.
* ``flashinfer``: the FlashInfer calls of the ``flashinfer`` backend
  (:func:`rl_kernel_core.sampling.flashinfer.draw`: the fp32 tempered logits, FlashInfer's top-k
  mask, softmax and top-p sampler), tokens only, no log-prob; and ``flashinfer_backend``:
  ``rk.sample(logits, backend="flashinfer", ...)`` without seeds (seeds drawn from the global RNG,
  FlashInfer's tokens, their log-probs from ``logprob_from_logits``' Triton kernel). Both are
  recorded as unavailable with the import error when the backend does not import.

At B=128 bf16 it also times ours and ``torch_sort`` with top-p 0.9 alone, min-p 0.05 alone and
no filter. Each timing is the median of ``--reps`` CUDA-event-timed calls after ``--warmup``
calls (``rl_kernel_core.tools.bench``), launched from Python, and the median of CUDA-graph replays where
capture works (device time without launch overhead). Peak extra memory is the allocator peak
during one call over what was allocated before it. Checks recorded with the timings: ours draws
the torch reference backend's tokens for the same seeds (fraction equal) and its log-probs equal
``logprob_from_logits`` bit for bit. The target is ours at B=128, V=151936, top-k 50 + top-p 0.9
in at most 0.25 ms.

    python benchmarks/bench_sampling.py --out benchmarks/results

Runs on CUDA. With ``TRITON_INTERPRET=1 ... --device cpu`` and tiny shapes it runs the same code
on CPU under the Triton interpreter (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch

import rl_kernel_core as rk
from rl_kernel_core.tools import bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_losses import _timed, checked_device, write_result  # noqa: E402

TARGET_MS = 0.25


def torch_sort_path(
    logits: torch.Tensor, k: Optional[int], p: Optional[float], min_p: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM V1's PyTorch sampler path (``vllm/v1/sample/ops/topk_topp_sampler.py``), plus the log-prob."""
    x = logits.float()
    full = torch.log_softmax(x, dim=-1)
    if min_p is not None:
        probs = full.exp()
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if k is not None or p is not None:
        sorted_x, order = x.sort(dim=-1, descending=False)
        if k is not None:
            kth = sorted_x.gather(1, torch.full((x.shape[0], 1), x.shape[1] - k, device=x.device))
            sorted_x.masked_fill_(sorted_x < kth, float("-inf"))
        if p is not None:
            cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= 1 - p
            drop[:, -1] = False
            sorted_x.masked_fill_(drop, float("-inf"))
        x = sorted_x.scatter(-1, order, sorted_x)
    probs = x.softmax(dim=-1)
    tokens = probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)
    return tokens, full.gather(1, tokens[:, None])[:, 0]


def torch_topk_path(logits: torch.Tensor, k: int, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk``, then top-p and the draw on the k values; the log-prob from the full row's logsumexp."""
    x = logits.float()
    values, idx = x.topk(k, dim=-1)  # descending
    probs = values.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= p
    probs = probs.masked_fill(drop, 0.0)
    pick = probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1, keepdim=True)
    tokens = idx.gather(1, pick)[:, 0]
    return tokens, values.gather(1, pick)[:, 0] - x.logsumexp(dim=-1)


def flashinfer_sampler() -> tuple[Optional[Callable], Optional[str]]:
    """The ``flashinfer`` backend's token draw (:func:`rl_kernel_core.sampling.flashinfer.draw`),
    or why it is unavailable."""
    try:
        from rl_kernel_core.sampling.flashinfer import draw
    except Exception as exc:  # recorded in the JSON
        return None, f"unavailable: {type(exc).__name__}: {exc}"
    return draw, None


def _checks(logits: torch.Tensor, seeds: torch.Tensor, params: dict) -> dict:
    """Ours against the torch reference backend (same seeds) and against logprob_from_logits."""
    tokens, logprobs = rk.sample(logits, seeds=seeds, backend="triton", **params)
    ref_tokens, _ = rk.sample(logits, seeds=seeds, backend="torch", **params)
    expected = rk.logprob_from_logits(logits, tokens, temperature=params.get("temperature", 1.0), backend="triton")
    return {
        "tokens_equal_reference_fraction": float((tokens == ref_tokens).double().mean()),
        "logprob_bitwise_logprob_from_logits": bool(torch.equal(logprobs, expected)),
    }


def bench_case(
    args: argparse.Namespace,
    device: torch.device,
    b: int,
    dtype: torch.dtype,
    fi: Optional[Callable],
    fi_reason: Optional[str],
    filters: dict,
    baselines: bool,
) -> dict:
    v = args.v
    logits = (torch.randn(b, v, device=device) * 3).to(dtype)
    info = torch.iinfo(torch.int64)
    seeds = torch.randint(info.min, info.max, (b,), device=device)
    k, p, mp = filters.get("top_k"), filters.get("top_p"), filters.get("min_p")

    def ours():
        return rk.sample(logits, seeds=seeds, backend="triton", **filters)

    impls: dict[str, Callable] = {"ours": ours, "torch_sort": lambda: torch_sort_path(logits, k, p, mp)}
    if baselines:
        impls["torch_topk"] = lambda: torch_topk_path(logits, k, p)
    rows = {name: _timed(fn, device, args, graph=device.type == "cuda") for name, fn in impls.items()}
    if baselines:
        if fi is None:
            rows["flashinfer"] = {"skipped": fi_reason}
            rows["flashinfer_backend"] = {"skipped": fi_reason}
        else:
            rows["flashinfer"] = _timed(
                lambda: fi(logits, 1.0, seeds, k, p, mp), device, args, graph=device.type == "cuda"
            )
            rows["flashinfer"]["note"] = "tokens only (no log-prob): the flashinfer backend's FlashInfer calls"
            rows["flashinfer_backend"] = _timed(
                lambda: rk.sample(logits, backend="flashinfer", **filters), device, args, graph=device.type == "cuda"
            )
            rows["flashinfer_backend"]["note"] = "rk.sample(backend='flashinfer') without seeds: tokens and log-probs"
    return {
        "B": b,
        "V": v,
        "dtype": str(dtype).replace("torch.", ""),
        "filters": filters,
        "results": rows,
        "checks": _checks(logits, seeds, filters),
    }


def _best_ms(row: dict) -> Optional[float]:
    graph = row.get("cuda_graph", {})
    return graph["median_ms"] if "median_ms" in graph else row.get("median_ms")


def _table(cases: list[dict]) -> str:
    names = ["ours", "torch_sort", "torch_topk", "flashinfer", "flashinfer_backend"]
    widths = [max(14, len(n) + 2) for n in names]
    lines = [
        f"{'B':<5} {'dtype':<9} {'filters':<28}"
        + "".join(f"{n:>{w}}" for n, w in zip(names, widths))
        + "  (ms: graph replay where captured)"
    ]
    for c in cases:
        cells = []
        for n, w in zip(names, widths):
            row = c["results"].get(n)
            ms = None if row is None else _best_ms(row)
            cells.append(f"{ms:{w}.4f}" if ms is not None else f"{'-':>{w}}")
        filt = ",".join(f"{key}={val}" for key, val in c["filters"].items())
        lines.append(f"{c['B']:<5} {c['dtype']:<9} {filt:<28}" + "".join(cells))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the JSON result")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128, 256], help="batch sizes B")
    parser.add_argument("--v", type=int, default=151936, help="vocabulary size")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), or cpu under TRITON_INTERPRET=1 as a smoke test"
    )
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    torch.manual_seed(0)
    env = bench.environment(device)
    fi, fi_reason = flashinfer_sampler()
    headline = {"top_k": args.top_k, "top_p": args.top_p}
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for b in args.batch:
            cases.append(bench_case(args, device, b, dtype, fi, fi_reason, headline, baselines=True))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    b_ref = 128 if 128 in args.batch else args.batch[-1]
    for filters in ({"top_p": args.top_p}, {"min_p": 0.05}, {}):
        cases.append(bench_case(args, device, b_ref, torch.bfloat16, fi, fi_reason, filters, baselines=False))
    target = {}
    for c in cases:
        if c["B"] == b_ref and c["filters"] == headline:
            ms = _best_ms(c["results"]["ours"])
            launched = c["results"]["ours"]["median_ms"]
            target[c["dtype"]] = {
                "graph_or_launched_ms": ms,
                "launched_ms": launched,
                "met": ms is not None and ms <= TARGET_MS,
            }
    result = {
        "benchmark": "bench_sampling",
        "command": bench.command_line(),
        "environment": env,
        "flashinfer": fi_reason or "available",
        "logits": "randn * 3",
        "temperature": 1.0,
        "warmup": args.warmup,
        "reps": args.reps,
        "cases": cases,
        "target": {"ours_ms_max": TARGET_MS, "B": b_ref, "V": args.v, "filters": headline, "by_dtype": target},
    }
    print(_table(cases))
    write_result(result, args.out, f"bench_sampling_{env.get('gpu', device.type).replace(' ', '_')}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
