"""Triton backends of logprob_from_logits, ratio_kl, policy_loss and group_advantages.

Every op is checked against an fp64 formula written here (log-softmax of the upcast logits, verl's
surrogate and aggregation written as loops, group statistics per group) and against the
reference backend; tolerances come from rl_kernel_core.contract. Gradients use non-uniform
upstream gradients. Determinism and row independence are asserted bitwise.

Where they run: on a CUDA machine the small-shape tests run compiled on the GPU, and the
``gpu``-marked tests add realistic shapes. Without CUDA they run on CPU under the Triton
interpreter, which Triton binds when ``triton.language`` is first imported (``tl.sum``/``tl.max``
are themselves jit functions), so ``TRITON_INTERPRET=1`` must be set before anything imports
Triton. When this module is collected in a process where that did not happen,
``test_cpu_suite_under_interpreter`` re-runs it in a child pytest with ``TRITON_INTERPRET=1`` and
the in-process tests skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss import METRIC_NAMES


def _interpreter_bound() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


DEVICE = "cpu" if _interpreter_bound() else ("cuda" if torch.cuda.is_available() else None)
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_TYPES = ["k1", "abs", "k2", "k3", "k1+", "abs+", "k3+"]


@pytest.fixture(autouse=True)
def _triton_runs_here(request):
    if DEVICE is None and request.node.name != "test_cpu_suite_under_interpreter":
        pytest.skip("Triton is not bound to its interpreter in this process: test_cpu_suite_under_interpreter runs this")


@pytest.mark.skipif(DEVICE is not None, reason="the suite runs in this process")
def test_cpu_suite_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", __file__],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"interpreted suite failed (exit {proc.returncode}):\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    summary = proc.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    skipped = re.search(r"(\d+) skipped", summary)
    # only this test may skip there: every other test must have run under the interpreter
    assert passed and int(passed.group(1)) > 0 and (skipped is None or int(skipped.group(1)) <= 1), summary


def upstream(shape, device):
    """A non-uniform upstream gradient, never zero (what an RL loss sends back)."""
    g = (torch.rand(shape, dtype=torch.float64) + 0.5) * torch.where(torch.rand(shape) < 0.5, -1.0, 1.0).double()
    return g.to(device)


# ============================================================== logprob_from_logits


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


def check_logprob(logits, targets, temperature=1.0, with_entropy=True, ignore_index=-100, oracle=logprob_oracle, backend="triton"):
    """Values and logits-gradient of ``backend`` against the fp64 ``oracle`` (non-uniform upstream)."""
    x = logits.detach().clone().requires_grad_()
    out = rk.logprob_from_logits(x, targets, temperature=temperature, ignore_index=ignore_index, return_entropy=with_entropy, backend=backend)
    lp, ent = out if with_entropy else (out, None)
    x64 = logits.detach().double().requires_grad_()
    lp64, ent64 = oracle(x64, targets, temperature, ignore_index)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    assert_close(lp, lp64, "logprob", logits.dtype, "logprob")
    g_lp = upstream(lp.shape, lp.device)
    loss, loss64 = (lp * g_lp.float()).sum(), (lp64 * g_lp).sum()
    if with_entropy:
        assert_close(ent, ent64, "logprob", logits.dtype, "entropy")
        g_ent = upstream(ent.shape, ent.device)
        loss, loss64 = loss + (ent * g_ent.float()).sum(), loss64 + (ent64 * g_ent).sum()
    loss.backward()
    loss64.backward()
    assert x.grad.dtype == logits.dtype and x.grad.shape == logits.shape
    assert_close(x.grad, x64.grad, "gradient", logits.dtype, "d logits")
    return lp, ent, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_values_and_gradients(seed, dtype, temperature):
    logits, targets = make_logits(6, 300, dtype, DEVICE)
    check_logprob(logits, targets, temperature)


def test_logprob_several_vocab_blocks_partial_last(seed):
    # V > 4096: the online log-sum-exp crosses blocks; the last block is partial
    logits, targets = make_logits(3, 4096 + 37, torch.bfloat16, DEVICE)
    check_logprob(logits, targets, 0.7)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_logprob_large_magnitude_and_all_equal_logits(seed, with_entropy):
    logits, targets = make_logits(5, 257, torch.float32, DEVICE, ignore_frac=0.0)
    logits[0] = torch.where(torch.rand(257, device=DEVICE) < 0.5, -100.0, 100.0)
    logits[1] = 100.0 * torch.rand(257, device=DEVICE)
    logits[2] = -100.0
    logits[3] = 3.25
    check_logprob(logits, targets, 0.7, with_entropy)


def test_logprob_gradient_through_entropy_only_and_logprob_only(seed):
    logits, targets = make_logits(4, 129, torch.float32, DEVICE)
    x = logits.clone().requires_grad_()
    x64 = logits.double().requires_grad_()
    _, ent = rk.logprob_from_logits(x, targets, return_entropy=True, backend="triton")
    ent.sum().backward()
    logprob_oracle(x64, targets, 1.0, -100)[1].sum().backward()
    assert_close(x.grad, x64.grad, "gradient", torch.float32, "d logits via entropy")
    x.grad, x64.grad = None, None
    lp, _ = rk.logprob_from_logits(x, targets, return_entropy=True, backend="triton")
    lp.sum().backward()
    logprob_oracle(x64, targets, 1.0, -100)[0].sum().backward()
    assert_close(x.grad, x64.grad, "gradient", torch.float32, "d logits via logprob")


def test_logprob_ignored_rows_are_zero_with_zero_gradient(seed):
    logits, targets = make_logits(5, 64, torch.float32, DEVICE, ignore_frac=0.0)
    targets[1:3] = 7  # a custom ignore id that is also a valid vocabulary id elsewhere
    lp, ent, grad = check_logprob(logits, targets, 1.0, True, ignore_index=7)
    assert torch.equal(lp[1:3], torch.zeros(2, device=DEVICE)) and torch.equal(ent[1:3], torch.zeros(2, device=DEVICE))
    assert torch.equal(grad[1:3], torch.zeros_like(grad[1:3]))


def test_logprob_row_strided_logits_and_leading_dims(seed):
    base = (torch.randn(2, 3, 90) * 3).to(DEVICE)
    logits = base[..., 5:85]  # rows strided (90), unit stride along V: passed without a copy
    targets = torch.randint(0, 80, (2, 3), device=DEVICE)
    x = logits.detach().clone().requires_grad_()
    lp_strided = rk.logprob_from_logits(logits, targets, backend="triton")
    lp_contig = rk.logprob_from_logits(x, targets, backend="triton")
    assert lp_strided.shape == (2, 3)
    assert torch.equal(lp_strided, lp_contig)
    assert_close(lp_strided, logprob_oracle(logits, targets, 1.0, -100)[0], "logprob", torch.float32, "strided logprob")


def test_logprob_matches_reference_backend(seed):
    logits, targets = make_logits(7, 333, torch.bfloat16, DEVICE)
    ours = rk.logprob_from_logits(logits, targets, temperature=0.9, return_entropy=True, backend="triton")
    ref = rk.logprob_from_logits(logits, targets, temperature=0.9, return_entropy=True, backend="torch")
    for a, b, name in zip(ours, ref, ("logprob", "entropy")):
        assert_close(a, b.double(), "logprob", torch.bfloat16, name)


def test_logprob_deterministic_and_row_independent(seed):
    logits, targets = make_logits(9, 4096 + 100, torch.bfloat16, DEVICE)
    g_lp, g_ent = upstream(9, DEVICE).float(), upstream(9, DEVICE).float()

    def run(x, t, rows=slice(None)):
        x = x.detach().clone().requires_grad_()
        lp, ent = rk.logprob_from_logits(x, t, temperature=0.7, return_entropy=True, backend="triton")
        ((lp * g_lp[rows]).sum() + (ent * g_ent[rows]).sum()).backward()
        return lp, ent, x.grad

    first, second = run(logits, targets), run(logits, targets)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    # the old/ref passes skip the entropy and the gradient: the same log-prob bits (ratio exactly 1)
    with torch.no_grad():
        assert torch.equal(rk.logprob_from_logits(logits, targets, temperature=0.7, backend="triton"), first[0])
    # a row's bits do not depend on N or on the other rows
    sub = run(logits[3:5].flip(0), targets[3:5].flip(0), torch.tensor([4, 3], device=DEVICE))
    for a, b in zip(sub, first):
        assert torch.equal(a, b[3:5].flip(0))


def test_logprob_no_grad_builds_no_graph(seed):
    logits, targets = make_logits(4, 50, torch.float32, DEVICE)
    logits.requires_grad_()
    with torch.no_grad():
        lp, ent = rk.logprob_from_logits(logits, targets, return_entropy=True, backend="triton")
    assert lp.grad_fn is None and ent.grad_fn is None


def test_logprob_triton_refuses_fp64_by_name(seed):
    logits, targets = make_logits(3, 20, torch.float64, DEVICE)
    with pytest.raises(rk.BackendUnavailableError, match="logits is float64"):
        rk.logprob_from_logits(logits, targets, backend="triton")


# ============================================================== ratio_kl / policy_loss oracles (fp64)


def clamp(x, lo, hi):
    return torch.minimum(torch.maximum(x, torch.full_like(x, lo)), torch.full_like(x, hi))


def kl_oracle(lp, ref, kl_type):
    """verl's estimators; a '+' keeps the value and takes k2's gradient."""
    base = kl_type.rstrip("+")
    d = lp - ref
    if base == "k1":
        kl = d
    elif base == "abs":
        kl = d.abs()
    elif base == "k2":
        kl = 0.5 * d * d
    else:
        x = clamp(-d, -20.0, 20.0)
        kl = clamp(x.exp() - x - 1, -10.0, 10.0)
    if kl_type.endswith("+"):
        k2 = 0.5 * d * d
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
    metrics = {"pg_loss": pg_loss, "pg_clipfrac": token_mean(clipfrac), "pg_clipfrac_lower": token_mean(lower),
               "ppo_kl": token_mean(-log_ratio), "kl_loss": kl_loss, "entropy": ent_loss}
    return loss, metrics


def make_tokens(shape, device, dtype=torch.float32, spread=0.4, mask_kind="bool"):
    lp = (torch.rand(shape) * -3 - 0.05)
    old = lp + torch.randn(shape) * spread
    ref = lp + torch.randn(shape) * spread * 2
    flat_old, flat_ref = old.view(-1), ref.view(-1)
    if flat_old.numel() >= 4:  # across the ±20 log-ratio clamps and k3's +10 clamp
        flat_old[0], flat_old[1], flat_ref[2], flat_ref[3] = lp.view(-1)[0] + 25, lp.view(-1)[1] - 25, lp.view(-1)[2] + 30, lp.view(-1)[3] + 3
    adv = torch.randn(shape)
    if mask_kind == "bool":
        mask = torch.rand(shape) < 0.8
    else:
        mask = torch.rand(shape) * torch.where(torch.rand(shape) < 0.8, 1.0, 0.0)
    ent = torch.rand(shape) * 3
    is_w = torch.rand(shape) * 1.5 + 0.25
    to = lambda t, dt=dtype: t.to(dt).to(device)  # noqa: E731
    return dict(lp=to(lp), old=to(old), ref=to(ref), adv=to(adv, torch.float32), mask=mask.to(device), ent=to(ent), is_w=to(is_w, torch.float32))


LOSS_DEFAULTS = dict(ref=True, ent=True, is_w=True, lo=0.2, hi=0.28, c=3.0, kl_type="k3", kl_coef=0.1, ent_coef=0.01, mode="token-mean")


def run_policy_loss(t, backend, g, **kw):
    """Loss, metrics and the gradients of ``g * loss`` w.r.t. logprob and entropy."""
    o = {**LOSS_DEFAULTS, **kw}
    lp = t["lp"].detach().clone().requires_grad_()
    entropy = t["ent"].detach().clone().requires_grad_() if o["ent"] else None
    loss, metrics = rk.policy_loss(
        lp, t["old"], t["adv"], t["mask"], ref_logprob=t["ref"] if o["ref"] else None, clip_ratio_low=o["lo"],
        clip_ratio_high=o["hi"], clip_ratio_c=o["c"], kl_type=o["kl_type"], kl_coef=o["kl_coef"], entropy=entropy,
        entropy_coef=o["ent_coef"] if o["ent"] else 0.0, loss_agg_mode=o["mode"],
        rollout_is_weights=t["is_w"] if o["is_w"] else None, backend=backend,
    )
    (loss * g.float()).backward()
    return loss.detach(), metrics, lp.grad, (entropy.grad if o["ent"] else None)


def check_policy_loss(t, backend="triton", **kw):
    """``backend``'s policy_loss: loss, metrics and gradients against the fp64 oracle and the reference backend."""
    o = {**LOSS_DEFAULTS, **kw}
    g = upstream((), t["lp"].device)
    loss, metrics, g_lp, g_ent = run_policy_loss(t, backend, g, **kw)
    dt = t["lp"].dtype
    d = {k: v.detach().double().requires_grad_(k in ("lp", "ent")) for k, v in t.items()}
    loss64, metrics64 = policy_loss_oracle(
        d["lp"], d["old"], d["adv"], d["mask"].double(), d["ref"] if o["ref"] else d["old"],
        d["ent"] if o["ent"] else None, d["is_w"] if o["is_w"] else None, lo=o["lo"], hi=o["hi"], c=o["c"],
        kl_type=o["kl_type"], kl_coef=o["kl_coef"], ent_coef=o["ent_coef"] if o["ent"] else 0.0, mode=o["mode"],
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


# ============================================================== ratio_kl


@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ratio_kl_values_and_gradients(seed, kl_type, dtype):
    t = make_tokens((3, 50), DEVICE, dtype)
    lp = t["lp"].clone().requires_grad_()
    ratio, kl = rk.ratio_kl(lp, t["old"], t["ref"], kl_type=kl_type, backend="triton")
    lp64 = t["lp"].double().requires_grad_()
    ratio64 = clamp(lp64 - t["old"].double(), -20.0, 20.0).exp()
    kl64 = kl_oracle(lp64, t["ref"].double(), kl_type)
    assert ratio.dtype == kl.dtype == torch.float32 and ratio.shape == lp.shape
    assert_close(ratio, ratio64, "elementwise", dtype, "ratio")
    assert_close(kl, kl64, "elementwise", dtype, "kl")
    g1, g2 = upstream(ratio.shape, DEVICE), upstream(kl.shape, DEVICE)
    ((ratio * g1.float()).sum() + (kl * g2.float()).sum()).backward()
    ((ratio64 * g1).sum() + (kl64 * g2).sum()).backward()
    assert_close(lp.grad, lp64.grad, "gradient", dtype, "d logprob")
    ref_ratio, ref_kl = rk.ratio_kl(t["lp"], t["old"], t["ref"], kl_type=kl_type, backend="torch")
    assert_close(ratio, ref_ratio.double(), "elementwise", dtype, "ratio vs reference")
    assert_close(kl, ref_kl.double(), "elementwise", dtype, "kl vs reference")


def test_ratio_kl_gradient_of_one_output_and_default_ref(seed):
    t = make_tokens((70,), DEVICE)
    lp = t["lp"].clone().requires_grad_()
    ratio, kl = rk.ratio_kl(lp, t["old"], backend="triton")
    kl.sum().backward()
    lp64 = t["lp"].double().requires_grad_()
    kl_oracle(lp64, t["old"].double(), "k3").sum().backward()
    assert_close(lp.grad, lp64.grad, "gradient", torch.float32, "d logprob via kl against old")


def test_ratio_kl_refuses_gradients_it_does_not_form(seed):
    t = make_tokens((10,), DEVICE)
    with pytest.raises(rk.BackendUnavailableError, match="old_logprob requires grad"):
        rk.ratio_kl(t["lp"], t["old"].requires_grad_(), backend="triton")


# ============================================================== policy_loss


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_aggregation_modes_and_dual_clip(seed, mode, dual):
    t = make_tokens((5, 37), DEVICE)
    t["mask"][1] = False  # an empty sequence
    kl_type = KL_TYPES[(AGG_MODES.index(mode) * 2 + (dual is None)) % len(KL_TYPES)]
    check_policy_loss(t, mode=mode, c=dual, kl_type=kl_type)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_policy_loss_every_kl_type(seed, kl_type):
    check_policy_loss(make_tokens((3, 40), DEVICE), kl_type=kl_type, kl_coef=0.3, mode="seq-mean-token-mean")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_policy_loss_low_precision_inputs_float_mask(seed, dtype):
    check_policy_loss(make_tokens((4, 33), DEVICE, dtype, mask_kind="float"), mode="seq-mean-token-sum")


@pytest.mark.parametrize("opts", [dict(ref=False, ent=False, is_w=False, kl_coef=0.0), dict(ent=False, c=None), dict(is_w=False, kl_coef=0.0)])
def test_policy_loss_optional_terms(seed, opts):
    check_policy_loss(make_tokens((2, 3, 21), DEVICE), **opts)


def test_policy_loss_long_sequences_several_blocks(seed):
    # T > 1024: several partial sums per sequence, the last block partial
    check_policy_loss(make_tokens((2, 2100), DEVICE), mode="seq-mean-token-mean")


def test_policy_loss_empty_mask_gives_zero_and_zero_gradients(seed):
    t = make_tokens((3, 9), DEVICE)
    t["mask"][:] = False
    t["old"][0, 0] = float("nan")  # outside the mask: must not leak
    loss, metrics, g_lp, g_ent = check_policy_loss(t, mode="token-mean")
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
    assert torch.equal(g_lp, torch.zeros_like(g_lp)) and torch.equal(g_ent, torch.zeros_like(g_ent))


def test_policy_loss_non_contiguous_inputs(seed):
    t = make_tokens((4, 60), DEVICE)
    strided = {k: v[:, ::2] for k, v in t.items()}
    contiguous = {k: v.contiguous() for k, v in strided.items()}
    g = upstream((), DEVICE)
    a, b = run_policy_loss(strided, "triton", g), run_policy_loss(contiguous, "triton", g)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    check_policy_loss(strided, mode="seq-mean-token-sum-norm")


def test_policy_loss_deterministic(seed):
    t = make_tokens((6, 1500), DEVICE)
    g = upstream((), DEVICE)
    first = run_policy_loss(t, "triton", g, mode="seq-mean-token-mean")
    second = run_policy_loss(t, "triton", g, mode="seq-mean-token-mean")
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    for name in METRIC_NAMES:
        assert torch.equal(first[1][name], second[1][name])


def test_policy_loss_refuses_what_it_does_not_serve(seed):
    t = make_tokens((2, 8), DEVICE)
    with pytest.raises(rk.BackendUnavailableError, match="advantages requires grad"):
        rk.policy_loss(t["lp"], t["old"], t["adv"].requires_grad_(), t["mask"], backend="triton")
    with pytest.raises(rk.BackendUnavailableError, match="float64"):
        rk.policy_loss(t["lp"].double(), t["old"], t["adv"].detach(), t["mask"], backend="triton")


# ============================================================== group_advantages


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


@pytest.mark.parametrize("estimator,norm_by_std", [("grpo", True), ("grpo", False), ("dr_grpo", True), ("rloo", True)])
def test_group_advantages_by_size_and_by_index(seed, estimator, norm_by_std):
    rewards = torch.randn(48).to(DEVICE)
    kw = dict(estimator=estimator, norm_by_std=norm_by_std, eps=1e-6, backend="triton")
    by_size = rk.group_advantages(rewards, group_size=8, **kw)
    assert by_size.dtype == torch.float32 and by_size.shape == (48,)
    assert_close(by_size, advantages_oracle(rewards, [list(range(g, g + 8)) for g in range(0, 48, 8)], estimator, norm_by_std, 1e-6), "reduction", torch.float32, "by size")
    index = torch.randint(0, 9, (48,))
    index[:2] = 100  # a group of two, and (likely) some of one
    index[2] = 101
    groups = [torch.nonzero(index == g).flatten().tolist() for g in index.unique()]
    by_index = rk.group_advantages(rewards, group_index=index.to(DEVICE), **kw)
    expected = advantages_oracle(rewards, groups, estimator, norm_by_std, 1e-6)
    assert_close(by_index, expected, "reduction", torch.float32, "by index")
    ref = rk.group_advantages(rewards, group_index=index.to(DEVICE), **{**kw, "backend": "torch"})
    assert_close(by_index, ref.double(), "reduction", torch.float32, "by index vs reference")
    assert torch.equal(by_index, rk.group_advantages(rewards, group_index=index.to(DEVICE), **kw))


def test_group_advantages_large_groups_bf16_rewards(seed):
    rewards = (torch.randn(2 * 1500) * 2 + 1).to(torch.bfloat16).to(DEVICE)  # groups span several blocks
    out = rk.group_advantages(rewards, group_size=1500, backend="triton")
    assert_close(out, advantages_oracle(rewards, [list(range(0, 1500)), list(range(1500, 3000))], "grpo", True, 1e-6), "reduction", torch.bfloat16, "advantages")


# ============================================================== custom ops and torch.compile


def test_custom_ops_pass_opcheck(seed):
    """Fake impls, schemas and autograd registrations agree with the real kernels."""
    logits, targets = make_logits(4, 40, torch.float32, DEVICE)
    ops = torch.ops.rl_kernel
    torch.library.opcheck(ops.triton_logprob_from_logits, (logits.requires_grad_(), targets, 0.8, -100, True))
    t = make_tokens((3, 11), DEVICE)
    torch.library.opcheck(ops.triton_ratio_kl, (t["lp"].requires_grad_(), t["old"], t["ref"], "k3"))
    torch.library.opcheck(
        ops.triton_policy_loss,
        (t["lp"], t["old"], t["adv"], t["mask"], t["ref"], t["ent"].requires_grad_(), t["is_w"], 0.2, 0.28, 3.0, "k3+", 0.1, 0.01, "seq-mean-token-mean"),
    )
    torch.library.opcheck(ops.triton_group_advantages, (torch.randn(12, device=DEVICE), 4, None, "grpo", True, 1e-6))


def test_eager_path_matches_custom_op_bitwise(seed):
    """Eager calls take a torch.autograd.Function over the kernels, torch.compile the custom op:
    same values and gradients, bit for bit; neither backward can be differentiated again (the
    eager one refuses create_graph=True at once, naming the op)."""
    from rl_kernel_core.triton import loss as triton_loss

    t = make_tokens((3, 11), DEVICE)
    args = (t["old"], t["adv"], t["mask"], t["ref"], None, t["is_w"], 0.2, 0.28, 3.0, "k3+", 0.1, 0.0, "seq-mean-token-mean")
    outs = []
    for op in (torch.ops.rl_kernel.triton_policy_loss, triton_loss._policy_loss_op):
        lp = t["lp"].detach().clone().requires_grad_()
        loss, metrics, _, _ = op(lp, *args)
        (grad,) = torch.autograd.grad(loss, (lp,), retain_graph=True)
        outs.append((loss, metrics, grad))
        scale = torch.ones((), device=DEVICE, requires_grad=True)  # an upstream gradient that requires grad
        if op is triton_loss._policy_loss_op:
            with pytest.raises(RuntimeError, match="rl_kernel::triton_policy_loss has no double backward"):
                torch.autograd.grad(loss * scale, (lp,), create_graph=True)
        else:
            (grad2,) = torch.autograd.grad(loss * scale, (lp,), create_graph=True)
            with pytest.raises(RuntimeError, match="no autograd formula was registered"):
                grad2.sum().backward()
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_compiled_loss_step_fullgraph_triton(seed):
    """logprob_from_logits -> ratio_kl -> policy_loss under torch.compile(fullgraph=True) (a graph break raises)."""
    logits, targets = make_logits(2 * 12, 96, torch.float32, DEVICE)
    logits, targets = logits.view(2, 12, 96), targets.view(2, 12)
    t = make_tokens((2, 12), DEVICE)

    def step(x):
        lp, ent = rk.logprob_from_logits(x, targets, temperature=0.9, return_entropy=True, backend="triton")
        ratio, kl = rk.ratio_kl(lp, t["old"], t["ref"], backend="triton")
        loss, metrics = rk.policy_loss(lp, t["old"], t["adv"], t["mask"] & (targets != -100), ref_logprob=t["ref"], kl_coef=0.1,
                                       entropy=ent, entropy_coef=0.01, clip_ratio_c=3.0, backend="triton")
        return loss + 0.5 * (ratio * kl).mean(), metrics

    backend = "inductor" if DEVICE == "cuda" else "aot_eager"  # inductor's CPU C++ build is too slow for CI
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    results = []
    for fn in (step, compiled):
        x = logits.clone().requires_grad_()
        loss, metrics = fn(x)
        loss.backward()
        results.append((loss.detach(), metrics, x.grad))
    (eager_loss, eager_m, eager_g), (comp_loss, comp_m, comp_g) = results
    assert_close(comp_loss, eager_loss.double(), "reduction", torch.float32, "compiled loss")
    for name in METRIC_NAMES:
        assert_close(comp_m[name], eager_m[name].double(), "reduction", torch.float32, f"compiled {name}")
    assert_close(comp_g, eager_g.double(), "gradient", torch.float32, "compiled d logits")


# ============================================================== realistic shapes on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("n,v", [(1021, 151936), (2048, 128256), (1000, 32000)])
def test_gpu_logprob_realistic(seed, n, v):
    logits, targets = make_logits(n, v, torch.bfloat16, "cuda", scale=3.0)
    logits[:7] = logits[:7] * 30  # logits of magnitude ~100
    check_logprob(logits, targets, 0.7)
    again = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True, backend="triton")
    first = rk.logprob_from_logits(logits, targets, temperature=0.7, return_entropy=True, backend="triton")
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    half = rk.logprob_from_logits(logits[: n // 2], targets[: n // 2], temperature=0.7, backend="triton")
    assert torch.equal(half, first[0][: n // 2])


@pytest.mark.gpu
@pytest.mark.parametrize("shape,mode", [((2048, 512), "token-mean"), ((256, 4096), "seq-mean-token-mean"), ((997, 1031), "seq-mean-token-sum-norm")])
def test_gpu_policy_loss_realistic(seed, shape, mode):
    t = make_tokens(shape, "cuda", torch.float32)
    check_policy_loss(t, mode=mode, kl_type="k3+")


@pytest.mark.gpu
def test_gpu_policy_loss_never_syncs(seed):
    t = make_tokens((512, 1024), "cuda")
    g = upstream((), "cuda")
    rewards = t["adv"][:, 0].contiguous()
    run_policy_loss(t, "triton", g)  # compile and warm up outside the guarded region
    rk.group_advantages(rewards, group_size=8, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_policy_loss(t, "triton", g)
        rk.group_advantages(rewards, group_size=8, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
