"""fp64 oracles, input makers and check helpers that several test modules share, one home for each.

Test modules import from here, never from each other. Every oracle is written independently of
the package (plain fp64 PyTorch or NumPy), so a backend is checked against the math, not
against another backend.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close, tolerance
from rl_kernel_core.loss.api import METRIC_NAMES

# ============================================================== logprob_from_logits, ratio_kl, policy_loss, group_advantages


AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


KL_TYPE_CASES = ["k1", "abs", "k2", "k3", "k1+", "abs+", "k3+"]


def upstream(shape, device):
    """A non-uniform upstream gradient, never zero (what an RL loss sends back)."""
    g = (torch.rand(shape, dtype=torch.float64) + 0.5) * torch.where(torch.rand(shape) < 0.5, -1.0, 1.0).double()
    return g.to(device)


def logprob_oracle(logits, targets, temperature, ignore_index):
    """fp64 log p(target) and entropy of softmax(logits / T); rows at ignore_index give 0."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    keep = targets != ignore_index
    lp = logp.gather(-1, torch.where(keep, targets, 0).long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


def make_logits(n, v, dtype, device, scale=4.0, ignore_frac=0.2):
    logits = (torch.randn(n, v) * scale).to(dtype).to(device)
    targets = torch.randint(0, v, (n,))
    drop = torch.rand(n) < ignore_frac
    drop[0] = n > 1 and ignore_frac > 0
    targets[drop] = -100
    return logits, targets.to(device)


def check_logprob(
    logits, targets, temperature=1.0, with_entropy=True, ignore_index=-100, oracle=logprob_oracle, backend="triton"
):
    """Values and logits-gradient of ``backend`` against the fp64 ``oracle`` (non-uniform upstream)."""
    x = logits.detach().clone().requires_grad_()
    out = rk.logprob_from_logits(
        x, targets, temperature=temperature, ignore_index=ignore_index, return_entropy=with_entropy, backend=backend
    )
    lp, ent = out if with_entropy else (out, None)
    x64 = logits.detach().double().requires_grad_()
    lp64, ent64 = oracle(x64, targets, temperature, ignore_index)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    assert_close(lp, lp64, "logprob", logits.dtype, "logprob")
    g_lp = upstream(lp.shape, lp.device)
    loss, loss64 = (lp * g_lp.float()).sum(), (lp64 * g_lp).sum()
    if with_entropy:
        assert ent is not None
        assert_close(ent, ent64, "logprob", logits.dtype, "entropy")
        g_ent = upstream(ent.shape, ent.device)
        loss, loss64 = loss + (ent * g_ent.float()).sum(), loss64 + (ent64 * g_ent).sum()
    loss.backward()
    loss64.backward()
    assert x.grad.dtype == logits.dtype and x.grad.shape == logits.shape
    assert_close(x.grad, x64.grad, "gradient", logits.dtype, "d logits")
    return lp, ent, x.grad


def clamp(x, lo, hi):
    return torch.minimum(torch.maximum(x, torch.full_like(x, lo)), torch.full_like(x, hi))


def kl_oracle(lp, ref, kl_type):
    """verl's estimators (:func:`kl_formula`); a '+' keeps the value and takes k2's gradient."""
    base = kl_type.rstrip("+")
    kl = kl_formula(lp, ref, base)
    if kl_type.endswith("+"):
        k2 = kl_formula(lp, ref, "k2")
        kl = kl.detach() + k2 - k2.detach()
    return kl


def policy_loss_oracle(lp, old, adv, weight, ref, ent, is_w, *, lo, hi, c, kl_type, kl_coef, ent_coef, mode):
    """fp64 loss and metrics, with the aggregation written as loops over sequences."""
    keep = weight != 0
    log_ratio = clamp(lp - old, -20.0, 20.0)
    r = log_ratio.exp()
    unclipped, clipped = -adv * r, -adv * clamp(r, 1 - lo, 1 + hi)
    pg = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).double()
    lower = torch.zeros_like(pg)
    if c is not None:
        lower = ((pg > -adv * c) & (adv < 0)).double()
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * c), pg)
    if is_w is not None:
        pg = pg * is_w

    def masked(v):
        return torch.where(keep, v, 0.0) * weight

    def token_mean(v):
        total = masked(v).sum()
        return total / weight.sum() if float(weight.sum()) > 0 else total * 0

    def agg(v):
        if mode == "token-mean":
            return token_mean(v)
        if mode == "token-sum":
            return masked(v).sum()
        seqs = []
        for s in range(v.shape[0]):
            n = weight[s].sum()
            if float(n) > 0:
                seq_sum = (torch.where(keep[s], v[s], 0.0) * weight[s]).sum()
                seqs.append(seq_sum / n if mode == "seq-mean-token-mean" else seq_sum)
        out = torch.stack(seqs).mean() if seqs else v.sum() * 0
        return out / v.shape[1] if mode == "seq-mean-token-sum-norm" else out

    pg_loss, kl_loss = agg(pg), agg(kl_oracle(lp, ref, kl_type))
    ent_loss = agg(ent) if ent is not None else torch.zeros((), dtype=torch.float64, device=lp.device)
    loss = pg_loss + kl_coef * kl_loss - ent_coef * ent_loss
    metrics = {
        "pg_loss": pg_loss,
        "pg_clipfrac": token_mean(clipfrac),
        "pg_clipfrac_lower": token_mean(lower),
        "ppo_kl": token_mean(-log_ratio),
        "kl_loss": kl_loss,
        "entropy": ent_loss,
    }
    return loss, metrics


def make_tokens(shape, device, dtype=torch.float32, spread=0.4, mask_kind="bool"):
    lp = torch.rand(shape) * -3 - 0.05
    old = lp + torch.randn(shape) * spread
    ref = lp + torch.randn(shape) * spread * 2
    flat_old, flat_ref = old.view(-1), ref.view(-1)
    if flat_old.numel() >= 4:  # across the ±20 log-ratio clamps and k3's +10 clamp
        flat_old[0], flat_old[1], flat_ref[2], flat_ref[3] = (
            lp.view(-1)[0] + 25,
            lp.view(-1)[1] - 25,
            lp.view(-1)[2] + 30,
            lp.view(-1)[3] + 3,
        )
    adv = torch.randn(shape)
    if mask_kind == "bool":
        mask = torch.rand(shape) < 0.8
    else:
        mask = torch.rand(shape) * torch.where(torch.rand(shape) < 0.8, 1.0, 0.0)
    ent = torch.rand(shape) * 3
    is_w = torch.rand(shape) * 1.5 + 0.25
    to = lambda t, dt=dtype: t.to(dt).to(device)  # noqa: E731
    return dict(
        lp=to(lp),
        old=to(old),
        ref=to(ref),
        adv=to(adv, torch.float32),
        mask=mask.to(device),
        ent=to(ent),
        is_w=to(is_w, torch.float32),
    )


LOSS_DEFAULTS = dict(
    ref=True, ent=True, is_w=True, lo=0.2, hi=0.28, c=3.0, kl_type="k3", kl_coef=0.1, ent_coef=0.01, mode="token-mean"
)


def run_policy_loss(t, backend, g, **kw):
    """Loss, metrics and the gradients of ``g * loss`` w.r.t. logprob and entropy."""
    o = {**LOSS_DEFAULTS, **kw}
    lp = t["lp"].detach().clone().requires_grad_()
    entropy = t["ent"].detach().clone().requires_grad_() if o["ent"] else None
    loss, metrics = rk.policy_loss(
        lp,
        t["old"],
        t["adv"],
        t["mask"],
        ref_logprob=t["ref"] if o["ref"] else None,
        clip_ratio_low=o["lo"],
        clip_ratio_high=o["hi"],
        clip_ratio_c=o["c"],
        kl_type=o["kl_type"],
        kl_coef=o["kl_coef"],
        entropy=entropy,
        entropy_coef=o["ent_coef"] if o["ent"] else 0.0,
        loss_agg_mode=o["mode"],
        rollout_is_weights=t["is_w"] if o["is_w"] else None,
        backend=backend,
    )
    (loss * g.float()).backward()
    return loss.detach(), metrics, lp.grad, (None if entropy is None else entropy.grad)


def check_policy_loss(t, backend="triton", **kw):
    """``backend``'s policy_loss: loss, metrics and gradients against the fp64 oracle and the reference backend."""
    o = {**LOSS_DEFAULTS, **kw}
    g = upstream((), t["lp"].device)
    loss, metrics, g_lp, g_ent = run_policy_loss(t, backend, g, **kw)
    dt = t["lp"].dtype
    d = {k: v.detach().double().requires_grad_(k in ("lp", "ent")) for k, v in t.items()}
    loss64, metrics64 = policy_loss_oracle(
        d["lp"],
        d["old"],
        d["adv"],
        d["mask"].double(),
        d["ref"] if o["ref"] else d["old"],
        d["ent"] if o["ent"] else None,
        d["is_w"] if o["is_w"] else None,
        lo=o["lo"],
        hi=o["hi"],
        c=o["c"],
        kl_type=o["kl_type"],
        kl_coef=o["kl_coef"],
        ent_coef=o["ent_coef"] if o["ent"] else 0.0,
        mode=o["mode"],
    )
    assert loss.shape == () and loss.dtype == torch.float32
    assert_close(loss, loss64, "reduction", dt, "loss")
    assert set(metrics) == set(METRIC_NAMES)
    for name in METRIC_NAMES:
        m = metrics[name]
        assert m.shape == () and m.dtype == torch.float32 and not m.requires_grad and m.device == loss.device, name
        assert_close(m, metrics64[name], "reduction", dt, name)
    (loss64 * g).backward()
    assert g_lp.dtype == dt
    assert_close(g_lp, d["lp"].grad, "gradient", dt, "d logprob")
    if o["ent"]:
        assert g_ent.dtype == dt
        assert_close(g_ent, d["ent"].grad, "gradient", dt, "d entropy")
    ref_loss, ref_metrics, ref_g_lp, _ = run_policy_loss(t, "torch", g, **kw)
    assert_close(loss, ref_loss.double(), "reduction", dt, "loss vs reference")
    for name in METRIC_NAMES:
        assert_close(metrics[name], ref_metrics[name].double(), "reduction", dt, f"{name} vs reference")
    assert_close(g_lp, ref_g_lp.double(), "gradient", dt, "d logprob vs reference")
    return loss, metrics, g_lp, g_ent


def check_ratio_kl(t, backend, kl_type):
    """``backend``'s ratio_kl on the tokens ``t`` (:func:`make_tokens`): ratio, KL and the logprob
    gradient against the fp64 formulas, and the values against the reference backend."""
    dtype, device = t["lp"].dtype, t["lp"].device
    lp = t["lp"].clone().requires_grad_()
    ratio, kl = rk.ratio_kl(lp, t["old"], t["ref"], kl_type=kl_type, backend=backend)
    lp64 = t["lp"].double().requires_grad_()
    ratio64 = clamp(lp64 - t["old"].double(), -20.0, 20.0).exp()
    kl64 = kl_oracle(lp64, t["ref"].double(), kl_type)
    assert ratio.dtype == kl.dtype == torch.float32 and ratio.shape == lp.shape
    assert_close(ratio, ratio64, "elementwise", dtype, "ratio")
    assert_close(kl, kl64, "elementwise", dtype, "kl")
    g1, g2 = upstream(ratio.shape, device), upstream(kl.shape, device)
    ((ratio * g1.float()).sum() + (kl * g2.float()).sum()).backward()
    ((ratio64 * g1).sum() + (kl64 * g2).sum()).backward()
    assert lp.grad is not None and lp.grad.dtype == dtype
    assert_close(lp.grad, lp64.grad, "gradient", dtype, "d logprob")
    ref_ratio, ref_kl = rk.ratio_kl(t["lp"], t["old"], t["ref"], kl_type=kl_type, backend="torch")
    assert_close(ratio, ref_ratio.double(), "elementwise", dtype, "ratio vs reference")
    assert_close(kl, ref_kl.double(), "elementwise", dtype, "kl vs reference")


def advantages_oracle(rewards, groups, estimator, norm_by_std, eps):
    """Per group, in fp64: mean, unbiased std; a group of one has mean 0 and std 1."""
    r = rewards.double().cpu()
    out = torch.empty_like(r)
    for members in groups:
        v = r[members]
        n = len(members)
        mean = v.mean() if n > 1 else torch.zeros((), dtype=torch.float64)
        std = v.std() if n > 1 else torch.ones((), dtype=torch.float64)
        if estimator == "rloo":
            out[members] = (v - mean) * n / (n - 1) if n > 1 else v
        elif estimator == "grpo" and norm_by_std:
            out[members] = (v - mean) / (std + eps)
        else:
            out[members] = v - mean
    return out


# ============================================================== linear_logprob and fused_linear_policy_loss


def small_chunks(tune, rows: int, vocab: int) -> None:
    """Make the backward/loss chunk ``rows`` rows so the cases cross chunk boundaries and padding."""
    tune(chunk_bytes=rows * vocab * 4)


def make_inputs(device, n, d, v, dtype, bias=True, scale=3.0, ignore_frac=0.2):
    """Random hidden/weight/bias/targets, logit std about ``scale``; some rows at ignore_index.

    Above a logit std of 3 the magnitude is split evenly between hidden and weight (as large
    logits arise in a real model), not loaded onto one of them.
    """
    h_scale = max(1.0, (scale / 3.0) ** 0.5)
    hidden = (torch.randn(n, d, device=device) * h_scale).to(dtype)
    weight = (torch.randn(v, d, device=device) * (scale / h_scale / d**0.5)).to(dtype)
    b = torch.randn(v, device=device).to(dtype) if bias else None
    targets = torch.randint(0, v, (n,), device=device)
    drop = torch.rand(n, device=device) < ignore_frac
    drop[0], drop[1] = True, False
    targets[drop] = -100
    return hidden, weight, b, targets


def linear_oracle(hidden, weight, bias, targets, temperature, ignore_index=-100):
    """fp64 log p(target) and entropy of softmax((h W^T + b) / T); rows at ``ignore_index`` 0."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    return logprob_oracle(logits, targets, temperature, ignore_index)


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def linear_oracle_grads(hidden, weight, bias, targets, temperature, g_lp, g_ent):
    h, w, b = leaves(hidden.double(), weight.double(), None if bias is None else bias.double())
    lp, ent = linear_oracle(h, w, b, targets, temperature)
    loss = (lp * g_lp).sum() + (ent * g_ent).sum()
    return torch.autograd.grad(loss, [x for x in (h, w, b) if x is not None])


# (N prime, D not a multiple of the K tile, V not a multiple of the vocab tile)
LINEAR_CPU_SHAPE = dict(n=37, d=40, v=300)
LINEAR_GPU_SHAPES = [dict(n=1031, d=896, v=151936), dict(n=257, d=4096, v=128256)]


def linear_shapes(device, all_gpu_shapes=False):
    """The CPU shape, or the first GPU shape (every GPU shape when ``all_gpu_shapes``)."""
    if device.type == "cpu":
        return [LINEAR_CPU_SHAPE]
    return LINEAR_GPU_SHAPES if all_gpu_shapes else LINEAR_GPU_SHAPES[:1]


def run_linear(hidden, weight, bias, targets, temperature, g_lp=None, g_ent=None, backend="triton"):
    """``(logprob, entropy, grads of (hidden, weight[, bias]))`` through the public op on
    ``backend`` (no grads without ``g_lp``)."""
    h, w, b = leaves(hidden, weight, bias)
    lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=temperature, return_entropy=True, backend=backend)
    if g_lp is None:
        return lp, ent, ()
    grads = torch.autograd.grad(
        (lp * g_lp.float()).sum() + (ent * g_ent.float()).sum(), [x for x in (h, w, b) if x is not None]
    )
    return lp, ent, grads


# ============================================================== sample


SIGMAS = 6.0  # width of the statistical acceptance bounds, in standard deviations


def random_seeds(n: int) -> torch.Tensor:
    info = torch.iinfo(torch.int64)
    return torch.randint(info.min, info.max, (n,), dtype=torch.int64)


def allowed_tokens(logits_row: np.ndarray, t: float, top_k, top_p, min_p) -> tuple[np.ndarray, np.ndarray]:
    """Independent fp64 spec: (allowed token ids, their renormalised probabilities)."""
    z = logits_row.astype(np.float64) / t
    p = np.exp(z - z.max())
    p /= p.sum()
    idx = np.arange(p.size)
    if min_p is not None:
        idx = idx[p[idx] >= min_p * p.max()]
    if top_k is not None:
        kth = np.sort(p[idx])[::-1][min(top_k, idx.size) - 1]
        idx = idx[p[idx] >= kth]
    if top_p is not None and top_p < 1.0:
        q = p[idx] / p[idx].sum()
        mass, last = 0.0, None
        for j in np.argsort(-q, kind="stable"):
            if mass >= top_p:
                break
            mass += q[j]
            last = q[j]
        idx = idx[q >= last]
    q = p[idx] / p[idx].sum()
    return idx, q


def row_params(b: int, kind: str, v: int) -> dict:
    """Random per-row (tensor) or scalar filter parameters for ``b`` rows."""
    if kind == "scalars":
        return {"temperature": 0.8, "top_k": int(torch.randint(2, v, ()).item()), "top_p": 0.7, "min_p": 0.05}
    params = {"temperature": torch.rand(b) * 1.5 + 0.3}
    if kind in ("top_k", "all"):
        params["top_k"] = torch.randint(1, v + 5, (b,))
    if kind in ("top_p", "all"):
        params["top_p"] = torch.rand(b) * 0.95 + 0.05
    if kind in ("min_p", "all"):
        params["min_p"] = torch.rand(b) * 0.5
    return params


# ============================================================== sample: distribution checks


SAMPLING_GPU_SHAPE = (128, 151936)


TAIL_FLOOR = 0.5 * math.erfc(SIGMAS / math.sqrt(2))
"""The smallest accepted tail probability of a goodness-of-fit statistic: a normal variable's beyond
:data:`SIGMAS` (the other bounds' false-alarm rate)."""


def chi_square_tail(chi2: float, dof: int) -> float:
    """``P(X >= chi2)`` for ``X`` chi-square with ``dof`` degrees of freedom (exact, closed form in
    ``dof``; a normal approximation is far too thin-tailed at a few degrees of freedom)."""
    half = chi2 / 2
    if dof % 2 == 0:
        return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(dof // 2))
    return math.erfc(math.sqrt(half)) + math.exp(-half) * sum(
        half ** (i - 0.5) / math.gamma(i + 0.5) for i in range(1, (dof + 1) // 2)
    )


def chi_square_check(row: torch.Tensor, tokens: torch.Tensor, params: dict) -> None:
    v = row.numel()
    allowed, q = allowed_tokens(
        row.double().cpu().numpy(),
        params.get("temperature", 1.0),
        params.get("top_k"),
        params.get("top_p"),
        params.get("min_p"),
    )
    counts = torch.bincount(tokens.cpu(), minlength=v).double().numpy()
    outside = np.setdiff1d(np.nonzero(counts)[0], allowed)
    assert outside.size == 0, f"drew tokens {outside.tolist()} outside the allowed set {allowed.tolist()}"
    dof = allowed.size - 1
    assert dof > 0, "the filters left one token: the test would not test the distribution"
    expected = q * tokens.numel()
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    assert chi_square_tail(chi2, dof) >= TAIL_FLOOR, (
        f"chi-square {chi2:.1f} with {dof} dof: {counts[allowed]} vs {expected.round(1)}"
    )


CHI_SQUARE_CASES = [
    {"temperature": 0.8, "top_k": 4},
    {"temperature": 1.0, "top_p": 0.7},
    {"temperature": 1.2, "min_p": 0.15},
    {"temperature": 0.9, "top_k": 5, "top_p": 0.85, "min_p": 0.05},
]


# ============================================================== varlen_attention


def dense_attention(q, k, v, cu_q, cu_k, causal):
    """fp64 attention per sequence with an explicit mask."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b] : cu_q[b + 1]].double().transpose(0, 1)
        ks = k[cu_k[b] : cu_k[b + 1]].double().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[cu_k[b] : cu_k[b + 1]].double().repeat_interleave(group, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[2])
        lq, lk = qs.shape[1], ks.shape[1]
        if causal:
            allowed = (
                torch.arange(lk, device=q.device)[None, :] <= (lk - lq + torch.arange(lq, device=q.device))[:, None]
            )
            s = s.masked_fill(~allowed, -math.inf)
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
    return torch.cat(outs)


# ============================================================== a compiled RL loss step


COMPILE_GROUP = 4


def make_batch(device, dtype, seqs=8, seq_len=16, vocab=128):
    logits = (torch.randn(seqs, seq_len, vocab) * 3).to(dtype).to(device)
    targets = torch.randint(0, vocab, (seqs, seq_len))
    targets[:, -3:] = -100  # padding
    old = torch.log_softmax(torch.randn(seqs, seq_len, vocab), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ref = old + 0.1 * torch.randn(seqs, seq_len)
    rewards = torch.randn(seqs)
    mask = (targets != -100) & (torch.rand(seqs, seq_len) < 0.9)
    return logits, targets.to(device), old.to(device), ref.to(device), rewards.to(device), mask.to(device)


def loss_step(backend):
    def step(logits, targets, old, ref, rewards, mask):
        advantages = rk.group_advantages(rewards, group_size=COMPILE_GROUP, backend=backend)
        logprob, entropy = rk.logprob_from_logits(
            logits, targets, temperature=0.9, return_entropy=True, backend=backend
        )
        ratio, kl = rk.ratio_kl(logprob, old, ref, kl_type="low_var_kl", backend=backend)
        loss, metrics = rk.policy_loss(
            logprob,
            old,
            advantages[:, None].expand_as(logprob),
            mask,
            ref_logprob=ref,
            clip_ratio_c=3.0,
            kl_coef=0.05,
            entropy=entropy,
            entropy_coef=0.01,
            loss_agg_mode="seq-mean-token-mean",
            backend=backend,
        )
        return loss + 0.1 * (ratio * kl * mask).mean(), metrics

    return step


def run_step(fn, batch):
    logits = batch[0].detach().clone().requires_grad_()
    loss, metrics = fn(logits, *batch[1:])
    loss.backward()
    return loss.detach(), metrics, logits.grad


def check_compiled_equals_eager(backend, compiler, device, dtype):
    batch = make_batch(device, dtype)
    step = loss_step(backend)
    compiled = torch.compile(step, fullgraph=True, backend=compiler)
    eager_loss, eager_metrics, eager_grad = run_step(step, batch)
    for _ in range(2):  # the second call reuses the compiled graph
        loss, metrics, grad = run_step(compiled, batch)
        assert_close(loss, eager_loss.double(), "reduction", dtype, "compiled loss")
        for name in METRIC_NAMES:
            assert_close(metrics[name], eager_metrics[name].double(), "reduction", dtype, f"compiled {name}")
        assert grad.dtype == dtype
        assert_close(grad, eager_grad.double(), "gradient", dtype, "compiled d logits")


# ============================================================== ratio_kl, policy_loss, fused_linear_policy_loss: verl's formulas, piecewise

# Written from verl 0.9.1's definitions in a different form from the implementation (the clipped
# surrogate piecewise by the sign of the advantage, aggregation as Python loops over sequences),
# so a shared mistake is unlikely; the loss-side tests of every backend read them.

KL_ALIASES = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
METRICS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss", "entropy")


def kl_formula(lp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Schulman's estimators with verl's clamps, fp64."""
    if kind == "k1":
        return lp - ref
    if kind == "abs":
        return torch.abs(lp - ref)
    if kind == "k2":
        return (lp - ref) ** 2 / 2
    x = clamp(ref - lp, -20.0, 20.0)
    return clamp(torch.exp(x) - x - 1, -10.0, 10.0)


def ratio_formula(lp: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.exp(clamp(lp - old, -20.0, 20.0))


def surrogate_formula(lp, old, adv, lo, hi, c):
    """Per-token PPO loss, clip flags, dual-clip flags; piecewise in the sign of A."""
    r = ratio_formula(lp, old)
    pos = -adv * torch.minimum(r, torch.full_like(r, 1 + hi))
    neg_ratio = torch.maximum(r, torch.full_like(r, 1 - lo))
    if c is not None:
        neg_ratio = torch.minimum(neg_ratio, torch.full_like(r, c))
    neg = -adv * neg_ratio
    loss = torch.where(adv > 0, pos, torch.where(adv < 0, neg, torch.zeros_like(r)))
    clipped = ((adv > 0) & (r > 1 + hi)) | ((adv < 0) & (r < 1 - lo))
    lower = (adv < 0) & (r > c) if c is not None else torch.zeros_like(clipped)
    return loss, clipped, lower


def agg_formula(values: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
    """verl's agg_loss (dp_size 1) as loops; an empty mask gives 0."""
    num_seqs, seq_len = values.shape
    if mode in ("token-mean", "token-sum"):
        total = (values * w).sum()
        if mode == "token-sum":
            return total
        return total / w.sum() if float(w.sum()) > 0 else total * 0
    per_seq = []
    for s in range(num_seqs):
        tokens = w[s].sum()
        if float(tokens) == 0:
            continue
        seq_sum = (values[s] * w[s]).sum()
        per_seq.append(seq_sum / tokens if mode == "seq-mean-token-mean" else seq_sum)
    out = sum(per_seq, torch.zeros((), dtype=values.dtype)) / len(per_seq) if per_seq else values.sum() * 0
    return out / seq_len if mode == "seq-mean-token-sum-norm" else out


def loss_formula(
    lp,
    old,
    adv,
    w,
    *,
    ref=None,
    lo=0.2,
    hi=0.2,
    c=None,
    kl="k3",
    kl_coef=0.0,
    ent=None,
    ent_coef=0.0,
    mode="token-mean",
    is_w=None,
):
    """fp64 loss and metrics; inputs [S, T] fp64 (w: mask as numbers)."""
    ref = old if ref is None else ref
    pg_tok, clipped, lower = surrogate_formula(lp, old, adv, lo, hi, c)
    if is_w is not None:
        pg_tok = pg_tok * is_w
    pg = agg_formula(pg_tok, w, mode)
    kl_loss = agg_formula(kl_formula(lp, ref, kl), w, mode)
    ent_loss = agg_formula(ent, w, mode) if ent is not None else lp.sum() * 0
    loss = pg + kl_coef * kl_loss - ent_coef * ent_loss
    tmean = lambda v: agg_formula(v.double(), w, "token-mean")  # noqa: E731
    metrics = {
        "pg_loss": pg,
        "pg_clipfrac": tmean(clipped),
        "pg_clipfrac_lower": tmean(lower),
        "ppo_kl": tmean(-(torch.log(ratio_formula(lp, old)))),
        "kl_loss": kl_loss,
        "entropy": ent_loss,
    }
    return loss, metrics


def make_loss_inputs(shape, dtype=torch.float32, *, spread=0.3, empty_row=False):
    """Random, never-zero per-token inputs; ratios spread across both clip bounds."""
    logprob = -(torch.rand(shape) * 4 + 0.05)
    old = logprob + spread * torch.randn(shape)
    ref = logprob + 0.5 * torch.randn(shape)
    adv = torch.randn(shape)
    adv = adv + 0.05 * torch.sign(adv)
    mask = torch.rand(shape) > 0.3
    mask[..., 0] = True
    if empty_row:
        mask.reshape(-1, shape[-1])[1] = False
    entropy = torch.rand(shape) * 3 + 0.1
    is_w = torch.rand(shape) * 1.5 + 0.25
    cast = lambda t: t.to(dtype)  # noqa: E731
    return dict(
        logprob=cast(logprob),
        old=cast(old),
        ref=cast(ref),
        adv=cast(adv),
        mask=mask,
        entropy=cast(entropy),
        is_w=cast(is_w),
    )


def as_fp64(t):
    """``t`` detached in fp64 (``None`` stays ``None``)."""
    return None if t is None else t.detach().double()


def every_term_loss_formula(x, lp, ent, *, kl_coef, ent_coef, mode):
    """:func:`loss_formula` with every term on, for the inputs ``x`` of :func:`make_loss_inputs`:
    the dual clip at 3, the k3 KL to ``x["ref"]``, the entropy ``ent`` and ``x["is_w"]``. ``lp`` and
    ``ent``: fp64 ``[S, T]``, given so that a test can take their gradients."""
    old, adv, ref, is_w = (as_fp64(x[k]) for k in ("old", "adv", "ref", "is_w"))
    w = x["mask"].double()
    return loss_formula(
        lp, old, adv, w, ref=ref, c=3.0, kl="k3", kl_coef=kl_coef, ent=ent, ent_coef=ent_coef, mode=mode, is_w=is_w
    )


# ============================================================== rms_norm, bi_matmul, bi_linear, bi_log_softmax, bi_mean


BI_CPU_SHAPE = dict(n=45, k=40, m=70, sizes=(1, 7, 45))
BI_GPU_SHAPE = dict(n=1031, k=1024, m=3072, sizes=(1, 7, 64, 300, 1031))


def bi_shape(device):
    """The batch-invariant ops' shapes: small odd ones for the interpreter on CPU, model-sized on CUDA
    (``n`` rows of ``k`` features into ``m``; ``sizes``: the batch prefixes that rows must keep their bits in)."""
    return BI_CPU_SHAPE if device.type == "cpu" else BI_GPU_SHAPE


def close_in_dtype(actual, expected, op_class, dtype, name):
    """``actual`` within the contract's ``op_class``/``dtype`` tolerance plus one rounding to ``dtype``
    of the fp64 ``expected``, and finite."""
    tol = tolerance(op_class, dtype)
    a, e = actual.double().cpu(), expected.double().cpu()
    bound = tol.atol + (tol.rtol + torch.finfo(dtype).eps) * e.abs()
    err = (a - e).abs()
    assert bool(torch.isfinite(a).all()), f"{name}: non-finite values"
    assert bool((err <= bound).all()), (
        f"{name}: worst error {float((err - bound).max()):.3g} above the {op_class}/{dtype} bound"
    )


def rows_invariant(fn, x, sizes, move_rows=True):
    """``fn``'s rows bitwise equal (``torch.equal``) for each batch prefix ``x[:n]`` and, with
    ``move_rows``, for the rows of ``x`` permuted to other positions."""
    full = fn(x)
    for n in sizes:
        assert torch.equal(fn(x[:n]), full[:n]), f"rows changed at N={n}"
    if not move_rows:
        return
    perm = torch.randperm(x.shape[0], device=x.device)
    assert torch.equal(fn(x[perm]), full[perm]), "rows changed when moved to other positions"


def assert_no_host_sync(step):
    """Run ``step()`` once to compile and warm up, then again with CUDA's sync debug mode set to
    ``"error"``: any host synchronisation in the second run raises."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
