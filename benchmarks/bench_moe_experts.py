"""A mixture-of-experts layer's experts: the mode's grouped products against the per-expert loop,
transformers and vLLM's fused MoE, at Qwen3-30B-A3B's widths.

One process, one layer (``--experts`` experts of ``--hidden`` -> ``--inter`` gated MLPs, top
``--top-k``, random bf16 weights), tokens routed by the mode's router
(:func:`rl_kernel_core.batch_invariant_mode.api_moe.route`) for each count in ``--tokens``. Rows:

* ``grouped``: :func:`~rl_kernel_core.batch_invariant_mode.api_moe.experts` in the mode (two
  ``bi_grouped_linear`` launches for all experts); also timed as a CUDA graph (``grouped_graph``:
  it reads nothing to the host, so it captures);
* ``per_expert``: the same math with one batch-invariant product per expert (the token counts
  read to the host, two launches per routed expert): the path ``experts`` took before
  ``bi_grouped_linear``. Its output is asserted bitwise equal to ``grouped``'s;
* ``transformers``: ``Qwen3MoeExperts.forward`` as shipped (mode off), the trainer's own path;
* ``vllm_fused``: vLLM's ``fused_experts`` (mode off) where vLLM imports, else the reason it is skipped;
* ``grouped_train`` / ``per_expert_train`` / ``transformers_train``: forward and backward
  (gradients of the input and both expert tensors).

Each time is the median of ``--reps`` calls after ``--warmup`` (``rl_kernel_core.tools.bench``); the
JSON names the GPU, versions, shapes, dtype and command line, with each row's peak extra memory.

    python benchmarks/bench_moe_experts.py --out OUT
    TRITON_INTERPRET=1 python benchmarks/bench_moe_experts.py --device cpu --experts 8 --hidden 64 --inter 32 \\
        --top-k 2 --tokens 8 --reps 1 --warmup 0   # smoke test
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

import rl_kernel_core as rk
from rl_kernel_core.batch_invariant_mode.api_moe import experts, route, router_logits
from rl_kernel_core.batch_invariant_mode.api_moe import _gated, _rows  # experts' own activation step
from rl_kernel_core.tools import bench


def per_expert(x, ids, weights, gate_up, down):
    """:func:`experts`' math with one batch-invariant ``F.linear`` per routed expert (in the mode)."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    starts = [sum(counts[:e]) for e in range(len(counts))]
    up = torch.cat([F.linear(rows[s : s + c], gate_up[e]) for e, (s, c) in enumerate(zip(starts, counts)) if c])
    act = _rows(_gated, up)
    out_rows = torch.cat([F.linear(act[s : s + c], down[e]) for e, (s, c) in enumerate(zip(starts, counts)) if c])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = out_rows.index_select(0, inverse).view(n, k, -1)
    out = weights[:, 0, None] * per_slot[:, 0].float()
    for j in range(1, k):
        out = out + weights[:, j, None] * per_slot[:, j].float()
    return out.to(x.dtype)


def transformers_experts(config: dict, gate_up: torch.Tensor, down: torch.Tensor):
    """transformers' ``Qwen3MoeExperts`` holding ``gate_up``/``down``, or the reason it cannot be built."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError as exc:
        return f"transformers: {exc}"
    module = Qwen3MoeExperts(Qwen3MoeConfig(**config)).to(device=gate_up.device, dtype=gate_up.dtype)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    return module


def vllm_fused_experts() -> Callable[..., torch.Tensor] | str:
    """vLLM's ``fused_experts``, or the reason it is not importable here."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception as exc:  # recorded in the results, never hidden
        return f"vllm: {type(exc).__name__}: {exc}"
    return fused_experts


def timed_row(fn: Callable[[], Any], device: torch.device, args, graph: bool = False) -> dict[str, Any]:
    """``fn``'s median time and peak extra memory, or ``{"skipped": why}`` where it raises."""
    try:
        row = bench.graph_time_ms(fn, device, warmup=args.warmup, reps=args.reps) if graph else {}
        if not graph:
            row = bench.time_ms(fn, device, warmup=args.warmup, reps=args.reps)
        row["peak_extra_gib"] = bench.peak_extra_gib(fn, device)
        return row
    except Exception as exc:  # a baseline that cannot run here is recorded, never hidden
        return {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="directory for bench_moe_experts.json")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="each expert's intermediate size")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="16,128,1024,4096", help="comma-separated token counts")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    bench.add_timing_options(p, reps=10, warmup=3)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device or "cuda"), getattr(torch, args.dtype)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    e, h, i = args.experts, args.hidden, args.inter
    gate = (torch.randn(e, h, generator=gen) / h**0.5).to(device, dtype)
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(device, dtype)
    down = (torch.randn(e, h, i, generator=gen) / i**0.5).to(device, dtype)
    config = dict(
        hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=args.top_k, hidden_act="silu"
    )
    hf = transformers_experts(config, gate_up, down)
    fused = vllm_fused_experts()
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(n, h, generator=gen).to(device, dtype)
        with rk.batch_invariant():
            weights, ids = route(router_logits(x, gate), args.top_k, True)
            grouped = experts(x, ids, weights, gate_up, down)
            assert torch.equal(grouped, per_expert(x, ids, weights, gate_up, down)), f"grouped != per_expert at N={n}"
        leaves = [t.detach().clone().requires_grad_() for t in (x, gate_up, down)]
        upstream = torch.randn(n, h, generator=gen).to(device, dtype)

        def train(fn):
            def step():
                for t in leaves:
                    t.grad = None
                fn(leaves[0], ids, weights, leaves[1], leaves[2]).backward(upstream)

            return step

        with rk.batch_invariant():
            cases: dict[str, Any] = {
                "grouped": timed_row(lambda: experts(x, ids, weights, gate_up, down), device, args),
                "grouped_graph": (
                    timed_row(lambda: experts(x, ids, weights, gate_up, down), device, args, graph=True)
                    if device.type == "cuda"
                    else {"skipped": "CUDA graphs need a CUDA device"}
                ),
                "per_expert": timed_row(lambda: per_expert(x, ids, weights, gate_up, down), device, args),
                "grouped_train": timed_row(train(experts), device, args),
                "per_expert_train": timed_row(train(per_expert), device, args),
            }
        if isinstance(hf, str):
            cases["transformers"] = cases["transformers_train"] = {"skipped": hf}
        else:
            hf_weights = weights.to(dtype)
            cases["transformers"] = timed_row(lambda: hf(x, ids, hf_weights), device, args)
            hx = x.detach().clone().requires_grad_()
            cases["transformers_train"] = timed_row(lambda: hf(hx, ids, hf_weights).backward(upstream), device, args)
        if isinstance(fused, str):
            cases["vllm_fused"] = {"skipped": fused}
        else:
            fused_fn = fused
            cases["vllm_fused"] = timed_row(
                lambda: fused_fn(x, gate_up, down, weights, ids.to(torch.int32)), device, args
            )
        rows.append({"tokens": n, **cases})
    print(f"{'tokens':>7} " + " ".join(f"{name:>18}" for name in rows[0] if name != "tokens"))
    for row in rows:
        cells = [
            f"{row[name]['median_ms']:>15.3f} ms" if "median_ms" in row[name] else f"{'skipped':>18}"
            for name in row
            if name != "tokens"
        ]
        print(f"{row['tokens']:>7} " + " ".join(cells))
    result = {
        "benchmark": "bench_moe_experts",
        "command": bench.command_line(),
        "environment": bench.environment(device),
        "shapes": {"experts": e, "hidden": h, "inter": i, "top_k": args.top_k, "tokens": args.tokens},
        "dtype": args.dtype,
        "timing": {"warmup": args.warmup, "reps": args.reps, "statistic": "median"},
        "rows": rows,
    }
    if args.out:
        print(bench.write_json(args.out, "bench_moe_experts.json", result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
