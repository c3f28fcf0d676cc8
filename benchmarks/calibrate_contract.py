"""Measure how close each backend comes to the numerical contract's bounds on this machine.

For every op class, input dtype, input regime (unit-scale, large-magnitude logits up to ~±100,
all-equal logits) and available backend, draw fresh random inputs, run the op and its backward,
and compare with the reference backend run on the same inputs upcast to fp64. The reference
itself is checked against independently written fp64 formulas in tests/core.

Writes ``worst_fraction`` = max |actual - expected| / (atol + rtol |expected|) per entry (1.0 is
exactly at the bound) and the raw max abs error.

    python benchmarks/calibrate_contract.py --out benchmarks/results/contract_calibration_<gpu>.json
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

import rl_kernel_core as rk
from rl_kernel_core import contract, dispatch
from rl_kernel_core.tools import bench

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fraction(actual: torch.Tensor, expected: torch.Tensor, op_class: str, dtype: torch.dtype) -> dict:
    a, e = actual.detach().double(), expected.detach().double().to(actual.device)
    if not torch.isfinite(a).all():
        return {"worst_fraction": float("inf"), "max_abs_err": float("inf")}
    err = (a - e).abs()
    return {
        "worst_fraction": float((err / contract.error_bound(e, op_class, dtype)).max()),
        "max_abs_err": float(err.max()),
    }


def _linear_inputs(n: int, d: int, v: int, regime: str, dtype: torch.dtype, device: torch.device):
    hidden = torch.randn(n, d, device=device)
    weight = torch.randn(v, d, device=device) / d**0.5
    if regime == "large":  # logits of magnitude up to ~100
        hidden = hidden * 25
    elif regime == "equal":  # every logit of a row equal
        weight = weight[:1].expand(v, d).contiguous()
    targets = torch.randint(0, v, (n,), device=device)
    targets[::7] = -100
    return hidden.to(dtype), weight.to(dtype), targets


def calibrate_linear_logprob(backend: str, dtype: torch.dtype, regime: str, device: torch.device, shape) -> dict:
    n, d, v = shape
    hidden, weight, targets = _linear_inputs(n, d, v, regime, dtype, device)
    upstream_lp, upstream_ent = torch.rand(n, device=device), torch.rand(n, device=device)

    def run(h, w, be):
        h = h.detach().requires_grad_(True)
        w = w.detach().requires_grad_(True)
        lp, ent = rk.linear_logprob(h, w, targets, temperature=0.7, return_entropy=True, backend=be)
        gh, gw = torch.autograd.grad(
            (lp * upstream_lp.to(lp.dtype)).sum() + (ent * upstream_ent.to(ent.dtype)).sum(), (h, w)
        )
        return lp, ent, gh, gw

    lp, ent, gh, gw = run(hidden, weight, backend)
    rlp, rent, rgh, rgw = run(hidden.double(), weight.double(), "torch")
    return {
        "logprob": _fraction(lp, rlp, "logprob", dtype),
        "entropy": _fraction(ent, rent, "logprob", dtype),
        "grad_hidden": _fraction(gh, rgh, "gradient", dtype),
        "grad_weight": _fraction(gw, rgw, "gradient", dtype),
    }


def calibrate_logprob_from_logits(backend: str, dtype: torch.dtype, regime: str, device: torch.device, shape) -> dict:
    n, _, v = shape
    scale = {"unit": 3.0, "large": 100.0, "equal": 0.0}[regime]
    logits = (torch.rand(n, v, device=device) * 2 - 1) * scale + (1.5 if regime == "equal" else 0.0)
    logits = logits.to(dtype)
    targets = torch.randint(0, v, (n,), device=device)
    upstream = torch.rand(n, device=device)

    def run(x, be):
        x = x.detach().requires_grad_(True)
        lp, ent = rk.logprob_from_logits(x, targets, temperature=0.7, return_entropy=True, backend=be)
        (g,) = torch.autograd.grad((lp * upstream.to(lp.dtype)).sum() + ent.sum(), (x,))
        return lp, ent, g

    lp, ent, g = run(logits, backend)
    rlp, rent, rg = run(logits.double(), "torch")
    return {
        "logprob": _fraction(lp, rlp, "logprob", dtype),
        "entropy": _fraction(ent, rent, "logprob", dtype),
        "grad_logits": _fraction(g, rg, "gradient", dtype),
    }


def calibrate_policy_loss(backend: str, dtype: torch.dtype, regime: str, device: torch.device, shape) -> dict:
    b, t = 64, 1024
    spread = {"unit": 0.3, "large": 30.0, "equal": 0.0}[regime]
    logprob = (-torch.rand(b, t, device=device) * 5).to(dtype)
    old = (logprob.float() + torch.randn(b, t, device=device) * spread).to(dtype)
    ref = (logprob.float() + torch.randn(b, t, device=device) * spread).to(dtype)
    adv = torch.randn(b, t, device=device).to(dtype)
    mask = torch.rand(b, t, device=device) > 0.2
    out = {}
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):

        def run(lp, be):
            lp = lp.detach().requires_grad_(True)
            loss, _ = rk.policy_loss(
                lp,
                old.to(lp.dtype),
                adv.to(lp.dtype),
                mask,
                ref_logprob=ref.to(lp.dtype),
                clip_ratio_c=3.0,
                kl_coef=0.1,
                loss_agg_mode=mode,
                backend=be,
            )
            (g,) = torch.autograd.grad(loss, (lp,))
            return loss, g

        loss, g = run(logprob, backend)
        rloss, rg = run(logprob.double(), "torch")
        out[f"loss[{mode}]"] = _fraction(loss, rloss, "reduction", dtype)
        out[f"grad[{mode}]"] = _fraction(g, rg, "gradient", dtype)
    for kind in ("k1", "abs", "k2", "low_var_kl"):
        ratio, kl = rk.ratio_kl(logprob, old, ref, kl_type=kind, backend=backend)
        rratio, rkl = rk.ratio_kl(logprob.double(), old.double(), ref.double(), kl_type=kind, backend="torch")
        out[f"ratio[{kind}]"] = _fraction(ratio, rratio, "elementwise", dtype)
        out[f"kl[{kind}]"] = _fraction(kl, rkl, "elementwise", dtype)
    return out


def calibrate_group_advantages(backend: str, dtype: torch.dtype, regime: str, device: torch.device, shape) -> dict:
    rewards = torch.randn(4096 * 16, device=device) * (100.0 if regime == "large" else 1.0)
    if regime == "equal":
        rewards = torch.ones_like(rewards)
    rewards = rewards.to(dtype)
    out = {}
    for est in ("grpo", "dr_grpo", "rloo"):
        a = rk.group_advantages(rewards, group_size=16, estimator=est, backend=backend)
        e = rk.group_advantages(rewards.double(), group_size=16, estimator=est, backend="torch")
        out[est] = _fraction(a, e, "reduction", dtype)
    return out


OPS: dict[str, Callable] = {
    "linear_logprob": calibrate_linear_logprob,
    "logprob_from_logits": calibrate_logprob_from_logits,
    "policy_loss": calibrate_policy_loss,
    "group_advantages": calibrate_group_advantages,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--shape", default="2048,4096,32000", help="N,D,V for the log-prob ops")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = tuple(int(x) for x in args.shape.split(","))
    backends = [
        b for b in dispatch.BACKENDS if dispatch.backend_status()[b] is None and (b == "torch" or device.type == "cuda")
    ]
    rows = []
    for op, fn in OPS.items():
        for backend in (b for b in backends if dispatch.serves(b, op)):
            for dname, dtype in DTYPES.items():
                for regime in ("unit", "large", "equal"):
                    torch.manual_seed(len(rows))
                    try:
                        result = fn(backend, dtype, regime, device, shape)
                    except dispatch.BackendUnavailableError as exc:
                        result = {"unavailable": str(exc)}
                    rows.append({"op": op, "backend": backend, "dtype": dname, "regime": regime, "results": result})
                    if "unavailable" in result:
                        print(f"{op:<22}{backend:<8}{dname:<6}{regime:<7} not run: {result['unavailable']}", flush=True)
                        continue
                    worst = max(r["worst_fraction"] for r in result.values())
                    print(f"{op:<22}{backend:<8}{dname:<6}{regime:<7} worst fraction of bound {worst:8.4f}", flush=True)
    payload = {
        "command": bench.command_line(),
        "shape_NDV": shape,
        "environment": bench.environment(device),
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
