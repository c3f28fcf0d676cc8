"""Vocab-parallel ``linear_logprob`` (triton backend) on several GPUs: bitwise forward across TP sizes, gradients against fp64.

    torchrun --nproc_per_node 2 benchmarks/tp_check.py --out benchmarks/results

Rank 0 draws the inputs and broadcasts them. For every TP size P dividing the world (1, 2, 4, 8),
groups of P consecutive ranks are formed (NCCL); each rank keeps its contiguous vocab shard of
``weight`` (and ``bias``) and runs, through the public op:

* forward with entropy and gradients, backward with non-uniform upstream gradients of the
  log-prob (random signs) and of the entropy;
* the no-grad forward without entropy (the old/ref log-prob pass).

Checks, on every rank (a failure anywhere makes the exit status 1):

* bitwise: log-prob and entropy of every TP size equal the single-process forward
  (``tp_group=None``) on its default route (gemm, the route of every vocab-parallel pass); the
  no-grad log-prob of every TP size equals the single-process no-grad forward; rank 0's values
  equal every other rank's;
* gradients: ``dh`` and this rank's ``dW`` (and ``db``) shard of every TP size within
  ``rl_kernel_core.contract`` of the fp64 single-process torch reference on the same inputs.

Recorded, not asserted: max and relative errors; median CUDA-event times of the single-process
and each TP size; peak extra memory.

``--vocab`` must split into whole vocab tiles (256 for bf16 on a GPU) on every TP size: the
default 128512 is Llama-3's 128256 padded to a multiple of 512 (Megatron pads the vocab to a
multiple of 128 x TP). ``--device cpu`` runs the same script on CPU (gloo, Triton interpreter)
as a smoke test: ``torchrun --nproc_per_node 2 benchmarks/tp_check.py --device cpu --tokens 37 --hidden 40
--vocab 512 --out <dir>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

import rl_kernel_core as rk
from rl_kernel_core.tools import bench
from rl_kernel_core.contract import assert_close
from rl_kernel_core.linear import triton_vocab_parallel as VP
from rl_kernel_core.linear.chunks import tuning
from rl_kernel_core.linear.triton_tile import tiles

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="N, token rows")
    p.add_argument("--hidden", type=int, default=4096, help="D, hidden size")
    p.add_argument("--vocab", type=int, default=128512, help="global vocab size")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--bias", action="store_true", help="add a vocab bias")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", required=True, help="directory for tp_check_<world>x<device>.json")
    return p.parse_args(argv)


def tp_groups(world: int, rank: int) -> dict[int, object]:
    """{P: this rank's group of P consecutive ranks} for every P in (1, 2, 4, 8) dividing ``world``."""
    groups = {}
    for size in (s for s in (1, 2, 4, 8) if world % s == 0):
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))  # every rank creates every group
            if start <= rank < start + size:
                groups[size] = group
    return groups


def draw_inputs(args: argparse.Namespace, dev: torch.device) -> dict[str, Optional[torch.Tensor]]:
    """Random inputs drawn on rank 0 and broadcast, so every rank holds the same bits."""
    n, d, v, dtype = args.tokens, args.hidden, args.vocab, DTYPES[args.dtype]
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    x = dict(
        hidden=torch.randn(n, d, device=dev, generator=gen).to(dtype),
        weight=(torch.randn(v, d, device=dev, generator=gen) * (3.0 / d**0.5)).to(dtype),
        bias=torch.randn(v, device=dev, generator=gen).to(dtype) if args.bias else None,
        targets=torch.randint(0, v, (n,), device=dev, generator=gen),
        g_lp=(torch.rand(n, device=dev, generator=gen) + 0.5)
        * torch.where(torch.rand(n, device=dev, generator=gen) < 0.5, -1.0, 1.0),
        g_ent=torch.rand(n, device=dev, generator=gen) + 0.5,
    )
    t = x["targets"]
    t[torch.rand(n, device=dev, generator=gen) < 0.05] = -100
    edges = torch.tensor([e + o for e in range(v // 8, v, v // 8) for o in (-1, 0)], device=dev)  # every shard boundary
    t[: edges.numel()] = edges
    for value in x.values():
        if value is not None:
            dist.broadcast(value, src=0)
    return x


def forward_backward(x, weight, bias, group):
    """(logprob, entropy, dh, dW, db) through the public triton op; ``weight``/``bias`` this rank's shard.

    The leaves share the inputs' storage (no copy inside the timed calls); gradients are returned.
    """
    h = x["hidden"].detach().requires_grad_()
    w = weight.detach().requires_grad_()
    b = None if bias is None else bias.detach().requires_grad_()
    lp, ent = rk.linear_logprob(
        h, w, x["targets"], bias=b, temperature=x["temperature"], return_entropy=True, tp_group=group, backend="triton"
    )
    loss = (lp * x["g_lp"]).sum() + (ent * x["g_ent"]).sum()
    grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t is not None])
    return lp.detach(), ent.detach(), *grads, *(() if b is not None else (None,))


def no_grad_logprob(x, weight, bias, group):
    with torch.no_grad():
        return rk.linear_logprob(
            x["hidden"], weight, x["targets"], bias=bias, temperature=x["temperature"], tp_group=group, backend="triton"
        )


def fp64_reference(x):
    """Single-process fp64 values and gradients (the torch backend) on the same inputs."""
    h = x["hidden"].double().requires_grad_()
    w = x["weight"].double().requires_grad_()
    b = None if x["bias"] is None else x["bias"].double().requires_grad_()
    lp, ent = rk.linear_logprob(
        h, w, x["targets"], bias=b, temperature=x["temperature"], return_entropy=True, backend="torch"
    )
    loss = (lp * x["g_lp"].double()).sum() + (ent * x["g_ent"].double()).sum()
    grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t is not None])
    return dict(lp=lp.detach(), ent=ent.detach(), dh=grads[0], dw=grads[1], db=grads[2] if b is not None else None)


def compare(
    name: str, got: torch.Tensor, want: torch.Tensor, op_class: str, dtype: torch.dtype, failures: list[str]
) -> dict:
    """Errors of ``got`` against the fp64 ``want`` and the contract's verdict (a failure is appended)."""
    err = (got.double() - want).abs()
    row = {
        "max_abs_err": float(err.max()),
        "rel_fro_err": float(err.norm() / want.norm().clamp_min(1e-300)),
        "within_contract": True,
    }
    try:
        assert_close(got, want, op_class, dtype, name)
    except AssertionError as exc:
        row["within_contract"] = False
        failures.append(str(exc))
    return row


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = tp_groups(world, rank)
    dtype = DTYPES[args.dtype]
    x = draw_inputs(args, dev)
    x["temperature"] = args.temperature
    failures: list[str] = []
    report: dict = {"bitwise": {}, "errors": {}, "timings_ms": {}, "peak_extra_gib": {}}

    def shard(size: int):
        v_local = args.vocab // size
        lo = dist.get_rank(groups[size]) * v_local
        sl = slice(lo, lo + v_local)
        return x["weight"][sl], None if x["bias"] is None else x["bias"][sl], sl

    def timed(key: str, fn: Callable[[], object]) -> None:
        report["timings_ms"][key] = bench.time_ms(fn, dev, warmup=args.warmup, reps=args.reps)["median_ms"]
        report["peak_extra_gib"][key] = bench.peak_extra_gib(fn, dev)

    # single process on the default route (gemm, the vocab-parallel route)
    assert tuning().route_for(x["hidden"]) == VP.ROUTE, "the single-process route must be the vocab-parallel one"
    single = forward_backward(x, x["weight"], x["bias"], None)[:2]  # the gradients are checked per TP size
    single_nograd = no_grad_logprob(x, x["weight"], x["bias"], None)
    timed("single_nograd_fwd", lambda: no_grad_logprob(x, x["weight"], x["bias"], None))
    timed("single_fwd_bwd", lambda: forward_backward(x, x["weight"], x["bias"], None))

    ref = fp64_reference(x)
    for size, group in groups.items():
        w, b, sl = shard(size)
        lp, ent, dh, dw, db = forward_backward(x, w, b, group)
        ng = no_grad_logprob(x, w, b, group)
        bits = {
            "logprob": bool(torch.equal(lp, single[0])),
            "entropy": bool(torch.equal(ent, single[1])),
            "nograd_logprob": bool(torch.equal(ng, single_nograd)),
        }
        for what in ("logprob", "entropy", "nograd_logprob"):
            if not bits[what]:
                failures.append(f"rank {rank} TP={size}: {what} differs from the single-process result")
        # replicated: every rank of the world holds rank 0's bits
        for what, value in (("logprob", lp), ("entropy", ent), ("nograd_logprob", ng)):
            other = value.clone()
            dist.broadcast(other, src=0)
            bits[f"{what}_equals_rank0"] = bool(torch.equal(other, value))
            if not bits[f"{what}_equals_rank0"]:
                failures.append(f"rank {rank} TP={size}: {what} differs from rank 0's")
        report["bitwise"][f"tp{size}"] = bits
        errs = {
            "logprob": compare(f"logprob TP={size}", lp, ref["lp"], "logprob", dtype, failures),
            "entropy": compare(f"entropy TP={size}", ent, ref["ent"], "logprob", dtype, failures),
            "dhidden": compare(f"dhidden TP={size}", dh, ref["dh"], "gradient", dtype, failures),
            "dweight_shard": compare(f"dweight shard TP={size}", dw, ref["dw"][sl], "gradient", dtype, failures),
        }
        if db is not None:
            errs["dbias_shard"] = compare(f"dbias shard TP={size}", db, ref["db"][sl], "gradient", dtype, failures)
        report["errors"][f"tp{size}"] = errs
        del lp, ent, dh, dw, db
        timed(f"tp{size}_nograd_fwd", lambda: no_grad_logprob(x, w, b, group))
        timed(f"tp{size}_fwd_bwd", lambda: forward_backward(x, w, b, group))

    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, dict(rank=rank, failures=failures, **report))
    if rank == 0:
        doc = {
            "check": "vocab-parallel linear_logprob (triton): forward bitwise across TP sizes, gradients vs fp64",
            "launch": f"torchrun --nproc_per_node {world} benchmarks/tp_check.py",
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "environment": bench.environment(dev),
            "world": world,
            "tp_sizes": sorted(groups),
            "shape": dict(
                n=args.tokens,
                d=args.hidden,
                vocab=args.vocab,
                dtype=args.dtype,
                temperature=args.temperature,
                bias=args.bias,
            ),
            "vocab_tile_block_n": tiles(dtype, dev, from_logits=False).block_n,
            "passed": all(not r["failures"] for r in per_rank),
            "notes": [
                "timings: median CUDA-event ms per rank; fwd_bwd = forward with entropy + backward; nograd_fwd = "
                "log-prob only under no_grad; single_* = tp_group=None on the default route "
                "(gemm, the vocab-parallel one)",
                "peak_extra_gib: allocator peak during one call beyond what was allocated before it, returned gradients included",
            ],
            "ranks": per_rank,
        }
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"tp_check_{world}x{args.device}.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(json.dumps({k: doc[k] for k in ("world", "tp_sizes", "shape", "passed")}))
        for r in per_rank:
            for line in r["failures"]:
                print(f"FAIL rank {r['rank']}: {line}")
        print(f"wrote {path}")
    ok = all(not r["failures"] for r in per_rank)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
