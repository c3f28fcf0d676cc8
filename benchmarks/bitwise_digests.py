"""Digests of every op's outputs and gradients on fixed inputs, to show that two versions of the
code (or two machines) compute the same bits.

Runs each fast backend's ops (Triton on both ``linear_logprob`` routes, native) on inputs drawn
from fixed seeds at realistic shapes (bf16 logits of a 151936-token vocabulary, a D=896 LM head)
and writes ``{case: {output: sha256 of its bytes}}`` as JSON. Run it at two commits and compare
the files: equal digests mean equal bits; the script prints nothing about speed.

    python benchmarks/bitwise_digests.py --out digests.json
    python benchmarks/bitwise_digests.py --compare a.json b.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import json
import sys

import torch

import rl_kernel_core as rk
from rl_kernel_core.tools import bench


def digest(t: torch.Tensor) -> str:
    """sha256 of the tensor's dtype, shape and bytes."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:24]


def loss_digests(loss: torch.Tensor, metrics: dict, **grads: torch.Tensor) -> dict[str, str]:
    """Digests of a loss op's outputs: ``loss``, each of its ``metrics`` and each named gradient."""
    return {
        "loss": digest(loss),
        **{k: digest(m) for k, m in metrics.items()},
        **{k: digest(g) for k, g in grads.items()},
    }


def route_scope(route: str):
    """The ``linear_logprob`` route for the block, on this version of the code."""
    for driver in ("rl_kernel_core.linear.chunks", "rl_kernel_core.linear_chunks"):  # this layout, then the one before
        try:
            return importlib.import_module(driver).tuned(route=route)
        except ModuleNotFoundError:
            pass
    # the layout before the chunk driver existed
    from rl_kernel_core.triton import _linear_kernels as K

    @contextlib.contextmanager
    def old():
        saved = K.TUNING
        K.TUNING = dataclasses.replace(saved, route=route)
        try:
            yield
        finally:
            K.TUNING = saved

    return old()


def gen(seed: int, dev: torch.device) -> torch.Generator:
    return torch.Generator(device=dev).manual_seed(seed)


def linear_cases(dev: torch.device, out: dict) -> None:
    n, d, v = 1031, 896, 151936
    g = gen(1, dev)
    hidden = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16)
    weight = (torch.randn(v, d, device=dev, generator=g) / d**0.5 * 3).to(torch.bfloat16)
    bias = torch.randn(v, device=dev, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=dev, generator=g)
    targets[::7] = -100
    g_lp, g_ent = torch.randn(n, device=dev, generator=g), torch.randn(n, device=dev, generator=g)
    s, t = 1, n
    old = torch.randn(s, t, device=dev, generator=g) - 4
    adv = torch.randn(s, t, device=dev, generator=g)
    mask = torch.rand(s, t, device=dev, generator=g) < 0.9
    for backend, routes in (("triton", ("gemm", "chunked")), ("native", ("chunked",))):
        for route in routes:
            with route_scope(route):
                h, w, b = (x.clone().requires_grad_() for x in (hidden, weight, bias))
                lp, ent = rk.linear_logprob(
                    h, w, targets, bias=b, temperature=0.8, return_entropy=True, backend=backend
                )
                grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w, b))
                with torch.no_grad():
                    lp_ng = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=0.8, backend=backend)
                out[f"linear_logprob[{backend},{route}]"] = {
                    "logprob": digest(lp),
                    "entropy": digest(ent),
                    "logprob_no_grad": digest(lp_ng),
                    "dhidden": digest(grads[0]),
                    "dweight": digest(grads[1]),
                    "dbias": digest(grads[2]),
                }
                if backend == "triton":
                    h, w = (x.clone().requires_grad_() for x in (hidden, weight))
                    loss, metrics = rk.fused_linear_policy_loss(
                        h.view(s, t, d),
                        w,
                        targets.view(s, t),
                        old,
                        adv,
                        mask,
                        temperature=0.8,
                        kl_coef=0.05,
                        entropy_coef=0.01,
                        clip_ratio_c=3.0,
                        backend=backend,
                    )
                    dh, dw = torch.autograd.grad(loss, (h, w))
                    out[f"fused_linear_policy_loss[{backend},{route}]"] = loss_digests(
                        loss, metrics, dhidden=dh, dweight=dw
                    )


def loss_cases(dev: torch.device, out: dict) -> None:
    g = gen(2, dev)
    n, v = 2048, 151936
    logits = (torch.randn(n, v, device=dev, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=dev, generator=g)
    s, t = 64, 512
    lp0 = torch.rand(s, t, device=dev, generator=g) * -4
    old = lp0 + torch.randn(s, t, device=dev, generator=g) * 0.3
    ref = lp0 + torch.randn(s, t, device=dev, generator=g) * 0.3
    adv = torch.randn(s, t, device=dev, generator=g)
    ent = torch.rand(s, t, device=dev, generator=g) * 3
    mask = torch.rand(s, t, device=dev, generator=g) < 0.9
    rewards = torch.randn(4096, device=dev, generator=g)
    index = torch.randint(0, 300, (4096,), device=dev, generator=g)
    for backend in ("triton", "native"):
        x = logits.clone().requires_grad_()
        lp, e = rk.logprob_from_logits(x, targets, temperature=0.7, return_entropy=True, backend=backend)
        (dx,) = torch.autograd.grad(lp.sum() + 0.5 * e.sum(), (x,))
        out[f"logprob_from_logits[{backend}]"] = {"logprob": digest(lp), "entropy": digest(e), "dlogits": digest(dx)}
        lp = lp0.clone().requires_grad_()
        ratio, kl = rk.ratio_kl(lp, old, ref, kl_type="k3+", backend=backend)
        (dlp,) = torch.autograd.grad((ratio * adv).sum() + kl.sum(), (lp,))
        out[f"ratio_kl[{backend}]"] = {"ratio": digest(ratio), "kl": digest(kl), "dlogprob": digest(dlp)}
        for mode in ("token-mean", "seq-mean-token-sum-norm"):
            lp, en = lp0.clone().requires_grad_(), ent.clone().requires_grad_()
            loss, metrics = rk.policy_loss(
                lp,
                old,
                adv,
                mask,
                ref_logprob=ref,
                clip_ratio_c=3.0,
                kl_type="low_var_kl",
                kl_coef=0.05,
                entropy=en,
                entropy_coef=0.01,
                loss_agg_mode=mode,
                backend=backend,
            )
            dlp, den = torch.autograd.grad(loss, (lp, en))
            out[f"policy_loss[{backend},{mode}]"] = loss_digests(loss, metrics, dlogprob=dlp, dentropy=den)
        out[f"group_advantages[{backend}]"] = {
            "by_size": digest(rk.group_advantages(rewards, group_size=8, backend=backend)),
            "by_index": digest(rk.group_advantages(rewards, group_index=index, backend=backend)),
        }


def other_cases(dev: torch.device, out: dict) -> None:
    from rl_kernel_core.batch_invariant_mode.api import bi_linear, bi_matmul

    g = gen(3, dev)
    a = torch.randn(300, 1024, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(3072, 1024, device=dev, generator=g).to(torch.bfloat16)
    out["bi_matmul[triton]"] = {"out": digest(bi_matmul(a, w.t(), backend="triton"))}
    out["bi_linear[triton]"] = {"out": digest(bi_linear(a, w, backend="triton"))}
    logits = (torch.randn(128, 151936, device=dev, generator=g) * 3).to(torch.bfloat16)
    seeds = torch.arange(128, device=dev) * 7919
    tokens, logprob = rk.sample(logits, top_k=50, top_p=0.9, seeds=seeds, backend="triton")
    out["sample[triton]"] = {"tokens": digest(tokens), "logprob": digest(logprob)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the digests here (JSON)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two digest files; exit 1 when any differs")
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(path))["digests"] for path in args.compare)
        diffs = [
            f"{case}.{name}"
            for case in sorted(set(a) | set(b))
            for name in sorted(set(a.get(case, {})) | set(b.get(case, {})))
            if a.get(case, {}).get(name) != b.get(case, {}).get(name)
        ]
        print(f"{sum(len(v) for v in a.values())} digests, {len(diffs)} differ" + "".join(f"\n  {d}" for d in diffs))
        return 1 if diffs else 0
    dev = torch.device("cuda")
    digests: dict = {}
    for part in (linear_cases, loss_cases, other_cases):
        part(dev, digests)
    doc = {"command": bench.command_line(), "environment": bench.environment(dev), "digests": digests}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{sum(len(v) for v in digests.values())} digests of {len(digests)} cases -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
