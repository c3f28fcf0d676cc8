"""Benchmark span-aware scoring: the log-prob + policy-loss step of an image-text GRPO batch,
scoring only the response tokens, against transformers' default path, in one process.

The batch (defaults: Qwen2.5-VL-3B-like head, D=2048, V=151936, bf16): 16 sequences of 1024
image-placeholder tokens + 256 prompt tokens + 512 response tokens; only the response is
scored (loss spans: 512 rows per sequence, shifted by one: the row before each scored token).
Each variant runs forward + backward from ``hidden [B, L, D]`` and the LM head ``weight [V, D]``
(both requiring grad) to their gradients:

* ``transformers_default``: the LM head on every position (``hidden @ weight.T``, the logits a
  transformers model returns), ``log_softmax`` of the fp32 logits, ``gather`` of the targets,
  then the PPO/GRPO loss of the reference backend over the dense response mask.
* ``ours_fused_spans``: ``fused_linear_policy_loss(..., loss_spans=spans)``: only the scored
  rows reach the LM head, the loss gradient is formed with the logits.
* ``ours_logprob_then_loss_spans``: ``linear_logprob(..., loss_spans=spans)`` then
  ``policy_loss(..., loss_spans=spans)``.
* ``ours_fused_dense_mask``: ``fused_linear_policy_loss`` with the dense mask (every row
  through the LM head): what the spans save over our own dense path.

Timing: median of ``--reps`` CUDA-event-timed calls after ``--warmup`` (``rl_kernel_core.tools.bench``);
memory: the allocator peak during one call over what was allocated before it (inputs
allocated). A variant that runs out of memory is recorded as such. The issue's target: peak
extra memory of ``transformers_default`` at least 10x ours, its time at least 3x ours (``met`` is
None where memory is not measured: on CPU). The JSON names the GPU, versions, shapes and the
command line.

    python benchmarks/bench_spans.py --out benchmarks/results

``--tiny --device cpu`` runs the same code at a tiny shape on CPU (a smoke test, not a
measurement).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import torch

import rl_kernel_core as rk
from rl_kernel_core.tools import bench
from rl_kernel_core.spans import LossSpans

KNOBS = dict(clip_ratio_c=3.0, kl_type="low_var_kl", kl_coef=0.0, loss_agg_mode="token-mean")
TINY = dict(seqs=2, image=8, prompt=4, response=6, hidden=32, vocab=257)


def inputs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """Hidden states, LM head, next-token targets, per-token old log-probs and advantages, and
    the response's loss spans (shifted by one) with their dense mask."""
    b, length = args.seqs, args.image + args.prompt + args.response
    hidden = torch.randn(b, length, args.hidden, device=device, dtype=dtype)
    weight = (torch.randn(args.vocab, args.hidden, device=device) * args.hidden**-0.5).to(dtype)
    targets = torch.randint(0, args.vocab, (b, length), device=device)
    start = args.image + args.prompt - 1
    spans = LossSpans.from_pairs([[(start, args.response)]] * b, length, device=device)
    old = torch.rand(b, length, device=device) * -4 - 5
    adv = torch.randn(b, 1, device=device).expand(b, length).contiguous()
    return dict(hidden=hidden, weight=weight, targets=targets, old=old, adv=adv, spans=spans, mask=spans.dense_mask())


def variants(x: dict, backend: str) -> dict[str, Callable[[], tuple]]:
    """Each variant: a call running forward + backward, returning (loss, d hidden, d weight)."""
    h = x["hidden"].detach().requires_grad_()
    w = x["weight"].detach().requires_grad_()

    def grads(loss: torch.Tensor) -> tuple:
        return (loss.detach(), *torch.autograd.grad(loss, (h, w)))

    def transformers_default():
        logits = h @ w.T
        logprob = torch.log_softmax(logits.float(), dim=-1).gather(-1, x["targets"][..., None])[..., 0]
        loss, _ = rk.policy_loss(logprob, x["old"], x["adv"], x["mask"], backend="torch", **KNOBS)
        return grads(loss)

    def ours_fused_spans():
        loss, _ = rk.fused_linear_policy_loss(
            h, w, x["targets"], x["old"], x["adv"], loss_spans=x["spans"], backend=backend, **KNOBS
        )
        return grads(loss)

    def ours_logprob_then_loss_spans():
        logprob = rk.linear_logprob(h, w, x["targets"], loss_spans=x["spans"], backend=backend)
        loss, _ = rk.policy_loss(logprob, x["old"], x["adv"], loss_spans=x["spans"], backend=backend, **KNOBS)
        return grads(loss)

    def ours_fused_dense_mask():
        loss, _ = rk.fused_linear_policy_loss(
            h, w, x["targets"], x["old"], x["adv"], x["mask"], backend=backend, **KNOBS
        )
        return grads(loss)

    return {
        "transformers_default": transformers_default,
        "ours_fused_spans": ours_fused_spans,
        "ours_logprob_then_loss_spans": ours_logprob_then_loss_spans,
        "ours_fused_dense_mask": ours_fused_dense_mask,
    }


def measure(fn: Callable[[], tuple], device: torch.device, args: argparse.Namespace) -> dict:
    try:
        row: dict = bench.time_ms(fn, device, warmup=args.warmup, reps=args.reps)
        row["peak_extra_gib"] = bench.peak_extra_gib(fn, device)
    except torch.OutOfMemoryError as exc:
        return {"out_of_memory": str(exc).splitlines()[0]}
    return row


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(args.seed)
    x = inputs(args, device, dtype)
    impls = variants(x, args.backend)
    rows = {name: measure(fn, device, args) for name, fn in impls.items()}
    reference = impls["transformers_default"]() if "out_of_memory" not in rows["transformers_default"] else None
    if reference is not None:
        for name, fn in impls.items():
            if name != "transformers_default" and "out_of_memory" not in rows[name]:
                out = fn()
                rows[name]["max_abs_diff_vs_transformers_default"] = {
                    what: float((a.double() - b.double()).abs().max())
                    for what, a, b in zip(("loss", "dhidden", "dweight"), out, reference)
                }
    base, ours = rows["transformers_default"], rows["ours_fused_spans"]
    ratios = {}
    if "median_ms" in base and "median_ms" in ours:
        ratios["time"] = base["median_ms"] / ours["median_ms"]
        if base.get("peak_extra_gib") and ours.get("peak_extra_gib"):
            ratios["peak_extra_memory"] = base["peak_extra_gib"] / ours["peak_extra_gib"]
    length = args.image + args.prompt + args.response
    return {
        "benchmark": "bench_spans",
        "command": bench.command_line(),
        "environment": bench.environment(device),
        "shape": {
            "sequences": args.seqs,
            "image_tokens": args.image,
            "prompt_tokens": args.prompt,
            "response_tokens": args.response,
            "L": length,
            "D": args.hidden,
            "V": args.vocab,
            "scored_rows": x["spans"].total,
            "all_rows": args.seqs * length,
        },
        "dtype": args.dtype,
        "backend": args.backend,
        "loss": KNOBS,
        "warmup": args.warmup,
        "reps": args.reps,
        "results": rows,
        "ours_vs_transformers_default": ratios,
        "target": {
            "peak_extra_memory_ratio_min": 10.0,
            "time_ratio_min": 3.0,
            "met": (ratios["peak_extra_memory"] >= 10.0 and ratios["time"] >= 3.0) if len(ratios) == 2 else None,
        },
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--image", type=int, default=1024, help="image-placeholder tokens per sequence")
    p.add_argument("--prompt", type=int, default=256, help="prompt text tokens per sequence")
    p.add_argument("--response", type=int, default=512, help="response tokens per sequence (the scored ones)")
    p.add_argument("--hidden", type=int, default=2048, help="D")
    p.add_argument("--vocab", type=int, default=151936, help="V")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--backend", default="auto", help="backend of our ops (auto, triton, native, torch)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help=f"a smoke-test shape {TINY}, fp32, 1 warm-up, 2 reps")
    p.add_argument("--out", default=None, help="write bench_spans_<gpu or cpu>.json into this directory")
    args = p.parse_args(argv)
    if args.tiny:
        for key, value in {**TINY, "dtype": "fp32", "warmup": 1, "reps": 2}.items():
            setattr(args, key, value)
    for name in ("seqs", "image", "prompt", "response", "hidden", "vocab", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.image + args.prompt < 1:
        p.error("--image + --prompt must be >= 1: the first scored token needs a row before it")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        gpu = result["environment"].get("gpu", "cpu").split()[-1].lower()
        print(bench.write_json(args.out, f"bench_spans_{gpu}{'_tiny' if args.tiny else ''}.json", result))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
