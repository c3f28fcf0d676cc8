"""One GRPO loss step on random data through rl-kernel's public ops.

Stands in for the end-to-end recipe until ``recipes/grpo_gsm8k.sh`` lands: it runs the ops a
GRPO step runs (group advantages, old log-probs without grad, log-probs with entropy from hidden
states, the clipped policy loss, backward) and prints what each produced and which backend ran.
Runs on CPU or GPU: ``python recipes/demo_step.py [--device cuda]``.
"""

from __future__ import annotations

import argparse

import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    b, t, d, v = args.groups * args.group_size, args.seq_len, args.hidden, args.vocab

    rewards = torch.randint(0, 2, (b,), device=device).float()
    adv = rk.group_advantages(rewards, group_size=args.group_size, estimator="grpo")
    hidden = torch.randn(b, t, d, device=device, requires_grad=True)
    weight = (torch.randn(v, d, device=device) / d**0.5).requires_grad_(True)
    tokens = torch.randint(0, v, (b, t), device=device)
    mask = torch.rand(b, t, device=device) > 0.1

    with torch.no_grad():
        old_lp = rk.linear_logprob(hidden + 0.01 * torch.randn_like(hidden), weight, tokens)
    lp, ent = rk.linear_logprob(hidden, weight, tokens, return_entropy=True)
    loss, metrics = rk.policy_loss(lp, old_lp, adv[:, None].expand(b, t), mask, entropy=ent, entropy_coef=0.001)
    loss.backward()

    print(f"device={device}  tokens={b * t}  vocab={v}  (logits [N, V] never materialised)")
    print(f"advantages: mean={adv.mean().item():+.4f} std={adv.std().item():.4f}")
    print(f"log-prob:   mean={lp[mask].mean().item():+.4f}  entropy mean={ent[mask].mean().item():.4f}")
    print(f"loss={loss.item():+.6f}  " + "  ".join(f"{k}={float(x):+.4g}" for k, x in metrics.items()))
    print(f"grad norms: hidden={hidden.grad.norm().item():.4g} weight={weight.grad.norm().item():.4g}")
    for op in ("group_advantages", "linear_logprob", "policy_loss"):
        decision = dispatch.explain(op)
        print(f"backend {op}: {decision.backend if decision else 'n/a'}")


if __name__ == "__main__":
    main()
