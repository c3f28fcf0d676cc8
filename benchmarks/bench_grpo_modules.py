"""Module-level GRPO benchmark: the log-prob + ratio/KL + loss part of a step, off vs on.

The two sides are the recipe's own functions (``recipes/grpo/embedded.py``), applied to an LM
head's hidden states ``[G, L, D]`` in bf16, as the recipe applies them to a model's output:

* ``off``: ``logits = hidden @ W.T`` (bf16), ``log_softmax(logits.float()).gather``, entropy from
  the logits, the clipped loss with low-variance KL and entropy terms in eager ops;
* ``on``: :func:`rl_kernel_core.linear_logprob` with entropy, :func:`rl_kernel_core.loss`.

For each head shape (Qwen3-0.6B, Qwen3-8B, Llama-3-8B) and token count it times, with the same
inputs: the no-grad old-log-prob pass, and the training pass (forward and backward into the
hidden states and the head). Each timing is the median of ``--reps`` CUDA-event-timed calls after
``--warmup`` calls; peak extra memory is the allocator peak over what was allocated before. An
out-of-memory error is recorded as such. Inputs: ``--inputs random`` (Gaussian hidden states) or
``peaked`` (each row's logits have one token far above the rest, as a trained model's).

    python benchmarks/bench_grpo_modules.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))

from grpo.embedded import (
    GRPOConfig,
    plain_head_logprob,
    plain_policy_loss,  # noqa: E402
    rl_kernel_head_logprob,
    rl_kernel_policy_loss,
)
from rl_kernel_core.tools import bench  # noqa: E402

SHAPES = {  # name -> (D, V)
    "qwen3-0.6b": (1024, 151936),
    "qwen3-8b": (4096, 151936),
    "llama3-8b": (4096, 128256),
}
CFG = GRPOConfig(kl_coef=1e-3, entropy_coef=1e-3)


def make_inputs(g: int, length: int, d: int, v: int, regime: str, device: torch.device):
    """hidden [G, L, D] bf16, head weight [V, D] bf16, targets, old/ref log-probs, advantages, mask."""
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(g, length, d, device=device, generator=gen)
    weight = torch.randn(v, d, device=device, generator=gen) / math.sqrt(d)
    targets = torch.randint(0, v, (g, length), device=device, generator=gen)
    if regime == "peaked":
        # push each row towards its target's head row: that logit ends about 12 above the rest
        wt = weight[targets]
        hidden = hidden + 12.0 * wt / (wt * wt).sum(-1, keepdim=True)
    mask = torch.rand(g, length, device=device, generator=gen) > 0.05
    targets = targets.masked_fill(~mask, -100)
    old = -torch.rand(g, length, device=device, generator=gen) * 2
    ref = old + 0.01 * torch.randn(g, length, device=device, generator=gen)
    adv = torch.randn(g, 1, device=device, generator=gen).expand(g, length).contiguous()
    head = torch.nn.Linear(d, v, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(weight)
    return hidden.to(torch.bfloat16), head, targets, old, ref, adv, mask


SIDES = {
    "off": (lambda h, head, t, e: plain_head_logprob(head(h), t, 1.0, e), plain_policy_loss),
    "on": (lambda h, head, t, e: rl_kernel_head_logprob(h, head, t, 1.0, e), rl_kernel_policy_loss),
}


def measure(fn, device, args) -> dict:
    try:
        out = bench.time_ms(fn, device, warmup=args.warmup, reps=args.reps)
        out["peak_extra_gib"] = bench.peak_extra_gib(fn, device)
        return out
    except torch.OutOfMemoryError as exc:
        return {"oom": str(exc).splitlines()[0]}
    finally:
        torch.cuda.empty_cache() if device.type == "cuda" else None


def bench_shape(name: str, tokens: int, args, device) -> list[dict]:
    d, v = SHAPES[name]
    g = tokens // args.seq_len
    hidden, head, targets, old, ref, adv, mask = make_inputs(g, args.seq_len, d, v, args.inputs, device)
    hidden.requires_grad_(True)
    rows = []
    for side, (logprob, loss_fn) in SIDES.items():

        def old_pass():
            with torch.no_grad():
                return logprob(hidden, head, targets, False)[0]

        def train_pass():
            lp, ent = logprob(hidden, head, targets, True)
            loss, _ = loss_fn(lp, old, adv, mask, ref_lp=ref, entropy=ent, cfg=CFG, scale=1.0)
            loss.backward()
            hidden.grad = None
            head.weight.grad = None

        for part, fn in (("old_logprob", old_pass), ("train_fwd_bwd", train_pass)):
            row = {
                "shape": name,
                "D": d,
                "V": v,
                "tokens": g * args.seq_len,
                "G": g,
                "L": args.seq_len,
                "side": side,
                "part": part,
                **measure(fn, device, args),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    del hidden, head
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the JSON result")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--tokens", default="8192,32768", help="tokens per micro-batch (comma list)")
    p.add_argument("--seq-len", type=int, default=512, help="L: tokens per sequence (G = tokens / L)")
    p.add_argument("--inputs", choices=("random", "peaked"), default="random")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for name in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows += bench_shape(name, tokens, args, device)
    by = {(r["shape"], r["tokens"], r["part"], r["side"]): r for r in rows}
    print(
        f"\n{'shape':<12}{'tokens':>8} {'part':<15}{'off ms':>10}{'on ms':>10}{'off/on':>8}{'off GiB':>10}{'on GiB':>9}"
    )
    summary = []
    for (shape, tokens, part, side), r in by.items():
        if side != "off":
            continue
        on = by[(shape, tokens, part, "on")]
        speedup = r["median_ms"] / on["median_ms"] if "median_ms" in r and "median_ms" in on else None
        summary.append({"shape": shape, "tokens": tokens, "part": part, "off_over_on_time": speedup})

        def cell(x, key, fmt):
            return "OOM" if "oom" in x else (format(x[key], fmt) if x.get(key) is not None else "-")

        print(
            f"{shape:<12}{tokens:>8} {part:<15}{cell(r, 'median_ms', '.2f'):>10}{cell(on, 'median_ms', '.2f'):>10}"
            f"{'-' if speedup is None else format(speedup, '.2f'):>8}{cell(r, 'peak_extra_gib', '.2f'):>10}{cell(on, 'peak_extra_gib', '.2f'):>9}"
        )
    result = {
        "benchmark": "GRPO log-prob + ratio/KL + loss, off (plain PyTorch) vs on (rl-kernel)",
        "command": bench.command_line(),
        "environment": bench.environment(device),
        "dtype": "bf16",
        "inputs": args.inputs,
        "settings": {"warmup": args.warmup, "reps": args.reps, "seq_len": args.seq_len},
        "config": {"kl_coef": CFG.kl_coef, "entropy_coef": CFG.entropy_coef, "clip_ratio_c": CFG.clip_ratio_c},
        "results": rows,
        "summary": summary,
    }
    os.makedirs(args.out, exist_ok=True)
    gpu = result["environment"].get("gpu", "cpu").split()[1].lower() if device.type == "cuda" else "cpu"
    path = Path(args.out) / f"bench_grpo_modules_{gpu}_{args.inputs}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
