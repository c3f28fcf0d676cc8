"""ratio_kl, policy_loss and fused_linear_policy_loss against fp64 formulas written here.

The formulas below are written from verl 0.9.1's definitions in a different form from the
implementation (the clipped surrogate piecewise by the sign of the advantage, aggregation as
Python loops over sequences), so a shared mistake is unlikely. Tolerances come from
rl_kernel_core.contract only.
"""

from __future__ import annotations

import math

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core._checks import CHECK_VALUES_ENV, values_checked
from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss import LOSS_AGG_MODES
from rl_kernel_core.switches import SwitchError

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_ALIASES = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
DTYPES = [torch.float32, torch.bfloat16]
METRICS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss", "entropy")


# ----------------------------------------------------------------------------- fp64 formulas

def kl_formula(lp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Schulman's estimators with verl's clamps, fp64."""
    if kind == "k1":
        return lp - ref
    if kind == "abs":
        return torch.abs(lp - ref)
    if kind == "k2":
        return (lp - ref) ** 2 / 2
    x = torch.minimum(torch.maximum(ref - lp, torch.full_like(lp, -20.0)), torch.full_like(lp, 20.0))
    k3 = torch.exp(x) - x - 1
    return torch.minimum(torch.maximum(k3, torch.full_like(lp, -10.0)), torch.full_like(lp, 10.0))


def ratio_formula(lp: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.minimum(torch.maximum(lp - old, torch.full_like(lp, -20.0)), torch.full_like(lp, 20.0)))


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


def loss_formula(lp, old, adv, w, *, ref=None, lo=0.2, hi=0.2, c=None, kl="k3", kl_coef=0.0, ent=None, ent_coef=0.0, mode="token-mean", is_w=None):
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
        "pg_loss": pg, "pg_clipfrac": tmean(clipped), "pg_clipfrac_lower": tmean(lower),
        "ppo_kl": tmean(-(torch.log(ratio_formula(lp, old)))), "kl_loss": kl_loss, "entropy": ent_loss,
    }
    return loss, metrics


# ----------------------------------------------------------------------------- inputs

def make_inputs(shape, dtype=torch.float32, *, spread=0.3, empty_row=False):
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
    return dict(logprob=cast(logprob), old=cast(old), ref=cast(ref), adv=cast(adv), mask=mask, entropy=cast(entropy), is_w=cast(is_w))


def d(t):
    return None if t is None else t.detach().double()


# ----------------------------------------------------------------------------- ratio_kl

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kl_type", list(KL_ALIASES))
def test_ratio_kl_matches_formula_including_clamps(seed, dtype, kl_type):
    shape = (7, 33)
    lp = -(torch.rand(shape) * 5 + 0.01)
    ref = lp + (torch.rand(shape) * 60 - 30)  # log-ratios up to ±30: k3 hits ±20 and its result hits 10
    old = lp + (torch.rand(shape) * 60 - 30)
    lp, ref, old = lp.to(dtype), ref.to(dtype), old.to(dtype)
    assert ((ref.double() - lp.double()).abs() > 20).any() and ((old.double() - lp.double()).abs() > 20).any()
    raw = (ref.double() - lp.double()).clamp(-20, 20)
    assert ((raw.exp() - raw - 1) > 10).any()

    ratio, kl = rk.ratio_kl(lp, old, ref, kl_type=kl_type)
    assert ratio.dtype == torch.float32 and kl.dtype == torch.float32 and kl.shape == shape
    assert_close(ratio, ratio_formula(d(lp), d(old)), "elementwise", dtype, "ratio")
    assert_close(kl, kl_formula(d(lp), d(ref), KL_ALIASES[kl_type]), "elementwise", dtype, f"kl[{kl_type}]")
    if KL_ALIASES[kl_type] == "k3":
        assert float(kl.max()) == 10.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_ratio_kl_infinite_log_ratios_stay_finite_through_the_clamps(seed, dtype):
    """The ±20 clamps are what keep k3 and the ratio finite when a log-prob is -inf."""
    lp = -(torch.rand(2, 8) * 3 + 0.1)
    ref = lp + torch.randn(2, 8)
    lp[0, :3] = float("-inf")
    ref[1, :3] = float("-inf")
    lp, ref = lp.to(dtype), ref.to(dtype)
    ratio, kl = rk.ratio_kl(lp, ref, ref, kl_type="k3")
    assert bool(torch.isfinite(kl).all()) and bool(torch.isfinite(ratio).all())
    assert_close(kl, kl_formula(d(lp), d(ref), "k3"), "elementwise", dtype, "kl")
    assert_close(ratio, ratio_formula(d(lp), d(ref)), "elementwise", dtype, "ratio")


@pytest.mark.parametrize("kl_type", list(KL_ALIASES))
def test_ratio_kl_without_ref_measures_against_old(seed, kl_type):
    x = make_inputs((4, 9))
    _, kl = rk.ratio_kl(x["logprob"], x["old"], kl_type=kl_type)
    assert_close(kl, kl_formula(d(x["logprob"]), d(x["old"]), KL_ALIASES[kl_type]), "elementwise", torch.float32, "kl")


def test_ratio_kl_any_shape_empty_and_non_contiguous(seed):
    for shape in [(0,), (3, 0), ()]:
        lp = -torch.rand(shape) - 0.1
        old = lp - torch.rand(shape) - 0.1
        ratio, kl = rk.ratio_kl(lp, old, kl_type="k2")
        assert ratio.shape == shape and kl.shape == shape and ratio.dtype == torch.float32
        assert_close(kl, kl_formula(d(lp), d(old), "k2"), "elementwise", torch.float32, "kl")
        assert_close(ratio, ratio_formula(d(lp), d(old)), "elementwise", torch.float32, "ratio")
    x = make_inputs((6, 4))
    views = [x[k].t() for k in ("logprob", "old", "ref")]
    a = rk.ratio_kl(*views, kl_type="low_var_kl")
    b = rk.ratio_kl(*(v.contiguous() for v in views), kl_type="low_var_kl")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kl_type", list(KL_ALIASES))
def test_ratio_kl_gradients_match_fp64_autograd(seed, dtype, kl_type):
    shape = (5, 17)
    lp0 = -(torch.rand(shape) * 4 + 0.05)
    ref = (lp0 + 3 * torch.randn(shape)).to(dtype)
    old = (lp0 + 0.5 * torch.randn(shape)).to(dtype)
    lp = lp0.to(dtype).requires_grad_()
    upstream_r, upstream_k = torch.rand(shape) + 0.5, torch.rand(shape) + 0.5
    ratio, kl = rk.ratio_kl(lp, old, ref, kl_type=kl_type)
    ((ratio * upstream_r).sum() + (kl * upstream_k).sum()).backward()

    lp64 = d(lp).requires_grad_()
    expected = (ratio_formula(lp64, d(old)) * upstream_r.double()).sum() + (kl_formula(lp64, d(ref), KL_ALIASES[kl_type]) * upstream_k.double()).sum()
    (grad,) = torch.autograd.grad(expected, lp64)
    assert lp.grad is not None and lp.grad.dtype == dtype
    assert_close(lp.grad, grad, "gradient", dtype, "d/dlogprob")


@pytest.mark.parametrize("kl_type", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_straight_through_kl_has_base_value_and_k2_gradient(seed, kl_type):
    x = make_inputs((3, 11), spread=1.0)
    lp = x["logprob"].clone().requires_grad_()
    _, kl = rk.ratio_kl(lp, x["old"], x["ref"], kl_type=kl_type)
    base = KL_ALIASES[kl_type[:-1]]
    assert_close(kl, kl_formula(d(lp), d(x["ref"]), base), "elementwise", torch.float32, "kl value")
    kl.sum().backward()
    assert_close(lp.grad, d(lp) - d(x["ref"]), "gradient", torch.float32, "k2 gradient")


def test_ratio_kl_gradcheck_fp64(seed):
    x = make_inputs((3, 5))
    lp = d(x["logprob"]).requires_grad_()
    for kl_type in ("k1", "abs", "k2", "k3"):
        torch.autograd.gradcheck(lambda t: rk.ratio_kl(t, d(x["old"]), d(x["ref"]), kl_type=kl_type), (lp,))


# ----------------------------------------------------------------------------- policy_loss

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_each_agg_mode_matches_formula(seed, dtype, mode):
    x = make_inputs((6, 19), dtype, spread=0.4, empty_row=True)
    loss, metrics = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], loss_agg_mode=mode)
    exp_loss, exp_metrics = loss_formula(d(x["logprob"]), d(x["old"]), d(x["adv"]), x["mask"].double(), mode=mode)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, exp_loss, "reduction", dtype, f"loss[{mode}]")
    for name in METRICS:
        assert_close(metrics[name], exp_metrics[name], "reduction", dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_policy_loss_clipping_and_dual_clip(seed, dtype, clip_ratio_c):
    x = make_inputs((5, 40), dtype, spread=1.5)  # ratios from ~0.01 to ~100: every branch is taken
    lo, hi = 0.2, 0.28
    loss, metrics = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=clip_ratio_c)
    exp_loss, exp_metrics = loss_formula(d(x["logprob"]), d(x["old"]), d(x["adv"]), x["mask"].double(), lo=lo, hi=hi, c=clip_ratio_c)
    assert_close(loss, exp_loss, "reduction", dtype, "loss")
    for name in METRICS:
        assert_close(metrics[name], exp_metrics[name], "reduction", dtype, name)
    assert float(metrics["pg_clipfrac"]) > 0
    if clip_ratio_c is None:
        assert float(metrics["pg_clipfrac_lower"]) == 0.0
    else:
        assert float(metrics["pg_clipfrac_lower"]) > 0
        plain, _ = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], clip_ratio_low=lo, clip_ratio_high=hi)
        assert float(loss) < float(plain)  # the dual clip bounds the loss of negative-advantage tokens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_kl_entropy_and_is_weights(seed, dtype, mode):
    x = make_inputs((4, 23), dtype, spread=0.5, empty_row=True)
    kw = dict(ref_logprob=x["ref"], clip_ratio_c=3.0, kl_type="low_var_kl", kl_coef=0.1, entropy=x["entropy"], entropy_coef=0.01, loss_agg_mode=mode, rollout_is_weights=x["is_w"])
    loss, metrics = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], **kw)
    exp_loss, exp_metrics = loss_formula(
        d(x["logprob"]), d(x["old"]), d(x["adv"]), x["mask"].double(), ref=d(x["ref"]), c=3.0, kl="k3", kl_coef=0.1,
        ent=d(x["entropy"]), ent_coef=0.01, mode=mode, is_w=d(x["is_w"]),
    )
    assert_close(loss, exp_loss, "reduction", dtype, "loss")
    for name in METRICS:
        assert_close(metrics[name], exp_metrics[name], "reduction", dtype, name)
    assert float(metrics["kl_loss"]) > 0 and float(metrics["entropy"]) > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_gradients_match_fp64_autograd(seed, dtype, mode):
    x = make_inputs((4, 15), dtype, spread=0.5, empty_row=True)
    lp = x["logprob"].clone().requires_grad_()
    ent = x["entropy"].clone().requires_grad_()
    loss, _ = rk.policy_loss(
        lp, x["old"], x["adv"], x["mask"], ref_logprob=x["ref"], clip_ratio_c=3.0, kl_type="k3", kl_coef=0.2,
        entropy=ent, entropy_coef=0.05, loss_agg_mode=mode, rollout_is_weights=x["is_w"],
    )
    loss.backward()
    lp64, ent64 = d(lp).requires_grad_(), d(ent).requires_grad_()
    exp_loss, _ = loss_formula(
        lp64, d(x["old"]), d(x["adv"]), x["mask"].double(), ref=d(x["ref"]), c=3.0, kl="k3", kl_coef=0.2,
        ent=ent64, ent_coef=0.05, mode=mode, is_w=d(x["is_w"]),
    )
    g_lp, g_ent = torch.autograd.grad(exp_loss, (lp64, ent64))
    assert lp.grad.dtype == dtype and ent.grad.dtype == dtype
    assert_close(lp.grad, g_lp, "gradient", dtype, "d/dlogprob")
    assert_close(ent.grad, g_ent, "gradient", dtype, "d/dentropy")
    assert bool((lp.grad[~x["mask"]] == 0).all())


def test_policy_loss_gradcheck_fp64(seed):
    x = make_inputs((3, 6), spread=0.5)
    args = {k: d(v) for k, v in x.items() if k != "mask"}
    lp = args["logprob"].requires_grad_()
    ent = args["entropy"].requires_grad_()
    for mode in AGG_MODES:
        def fn(lp_, ent_):
            return rk.policy_loss(
                lp_, args["old"], args["adv"], x["mask"], ref_logprob=args["ref"], clip_ratio_c=3.0, kl_coef=0.1,
                entropy=ent_, entropy_coef=0.01, loss_agg_mode=mode, rollout_is_weights=args["is_w"],
            )[0]
        torch.autograd.gradcheck(fn, (lp, ent))


def test_policy_loss_metrics_are_detached_0d_and_loss_is_attached(seed):
    x = make_inputs((3, 8))
    lp = x["logprob"].clone().requires_grad_()
    ent = x["entropy"].clone().requires_grad_()
    loss, metrics = rk.policy_loss(lp, x["old"], x["adv"], x["mask"], kl_coef=0.1, entropy=ent, entropy_coef=0.1)
    assert loss.dim() == 0 and loss.requires_grad
    assert sorted(metrics) == sorted(METRICS)
    for name, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, name
        assert not value.requires_grad and value.grad_fn is None, name
        assert value.dtype == torch.float32 and value.device == lp.device, name


def test_policy_loss_runs_on_meta_tensors_so_never_syncs(seed):
    """A host sync (.item(), a Python branch on a tensor value) cannot run on the meta device."""
    shape = (4, 9)
    t = lambda: torch.empty(shape, device="meta")  # noqa: E731
    mask = torch.empty(shape, device="meta", dtype=torch.bool)
    for mode in AGG_MODES:
        loss, metrics = rk.policy_loss(
            t(), t(), t(), mask, ref_logprob=t(), clip_ratio_c=3.0, kl_coef=0.1, entropy=t(), entropy_coef=0.1,
            loss_agg_mode=mode, rollout_is_weights=t(),
        )
        assert loss.device.type == "meta" and loss.dim() == 0
        assert all(v.device.type == "meta" and v.dim() == 0 for v in metrics.values())


def test_policy_loss_float_mask_weighs_tokens(seed):
    x = make_inputs((5, 12), empty_row=True)
    binary = x["mask"].float()
    for mode in AGG_MODES:
        a = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], loss_agg_mode=mode, entropy=x["entropy"])
        b = rk.policy_loss(x["logprob"], x["old"], x["adv"], binary, loss_agg_mode=mode, entropy=x["entropy"])
        assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in METRICS)
    weights = x["mask"] * (torch.rand(5, 12) + 0.1)
    for mode in AGG_MODES:
        loss, metrics = rk.policy_loss(x["logprob"], x["old"], x["adv"], weights, loss_agg_mode=mode)
        exp_loss, exp_metrics = loss_formula(d(x["logprob"]), d(x["old"]), d(x["adv"]), weights.double(), mode=mode)
        assert_close(loss, exp_loss, "reduction", torch.float32, f"weighted loss[{mode}]")
        assert_close(metrics["ppo_kl"], exp_metrics["ppo_kl"], "reduction", torch.float32, "weighted ppo_kl")


def test_policy_loss_ignores_non_finite_values_outside_the_mask(seed):
    x = make_inputs((4, 10))
    poisoned = {k: x[k].clone() for k in ("logprob", "old", "adv", "entropy")}
    for k, v in poisoned.items():
        v[~x["mask"]] = float("nan") if k != "adv" else float("inf")
    for mode in AGG_MODES:
        a = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], kl_coef=0.1, entropy=x["entropy"], loss_agg_mode=mode)
        b = rk.policy_loss(poisoned["logprob"], poisoned["old"], poisoned["adv"], x["mask"], kl_coef=0.1, entropy=poisoned["entropy"], loss_agg_mode=mode)
        assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in METRICS)


def test_policy_loss_shapes_leading_dims_and_one_sequence(seed):
    x = make_inputs((2, 3, 11), empty_row=True)
    flat = {k: v.reshape(6, 11) for k, v in x.items()}
    for mode in AGG_MODES:
        a = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], loss_agg_mode=mode)
        b = rk.policy_loss(flat["logprob"], flat["old"], flat["adv"], flat["mask"], loss_agg_mode=mode)
        assert torch.equal(a[0], b[0])
    one = make_inputs((13,))
    a = rk.policy_loss(one["logprob"], one["old"], one["adv"], one["mask"], loss_agg_mode="seq-mean-token-sum")
    b = rk.policy_loss(*(one[k][None] for k in ("logprob", "old", "adv", "mask")), loss_agg_mode="seq-mean-token-sum")
    assert torch.equal(a[0], b[0])


def test_policy_loss_non_contiguous_equals_contiguous(seed):
    x = make_inputs((9, 5))  # transposed below: [5, 9] views with strides (1, 5)
    views = {k: v.t() for k, v in x.items()}
    assert not views["logprob"].is_contiguous()
    for mode in AGG_MODES:
        kw = dict(ref_logprob=views["ref"], kl_coef=0.1, entropy=views["entropy"], entropy_coef=0.1, rollout_is_weights=views["is_w"], loss_agg_mode=mode, clip_ratio_c=3.0)
        a, ma = rk.policy_loss(views["logprob"], views["old"], views["adv"], views["mask"], **kw)
        kw = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        b, mb = rk.policy_loss(*(views[k].contiguous() for k in ("logprob", "old", "adv", "mask")), **kw)
        assert_close(a, b.double(), "reduction", torch.float32, "loss")
        for name in METRICS:
            assert_close(ma[name], mb[name].double(), "reduction", torch.float32, name)


@pytest.mark.parametrize("shape", [(0, 7), (3, 0), (0,)])
def test_policy_loss_empty_inputs_give_zero_loss_and_metrics(shape):
    for mode in AGG_MODES:
        lp = torch.randn(shape).requires_grad_()
        loss, metrics = rk.policy_loss(lp, torch.randn(shape), torch.randn(shape), torch.ones(shape, dtype=torch.bool), kl_coef=0.1, entropy=torch.rand(shape), entropy_coef=0.1, loss_agg_mode=mode)
        assert loss.dim() == 0 and float(loss.detach()) == 0.0
        assert all(float(v) == 0.0 for v in metrics.values())
        loss.backward()
        assert lp.grad is not None and lp.grad.shape == lp.shape


def test_policy_loss_all_masked_gives_zero_not_nan(seed):
    x = make_inputs((3, 6))
    none = torch.zeros(3, 6, dtype=torch.bool)
    for mode in AGG_MODES:
        loss, metrics = rk.policy_loss(x["logprob"], x["old"], x["adv"], none, kl_coef=0.1, loss_agg_mode=mode)
        assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())


def test_policy_loss_backend_choice_and_errors(seed):
    x = make_inputs((2, 5))
    args = (x["logprob"], x["old"], x["adv"], x["mask"])
    a = rk.policy_loss(*args)
    b = rk.policy_loss(*args, backend="torch")
    assert torch.equal(a[0], b[0])
    assert dispatch.explain("policy_loss").backend == "torch"
    with pytest.raises(rk.BackendUnavailableError, match="native"):
        rk.policy_loss(*args, backend="native")
    with pytest.raises(ValueError, match="backend"):
        rk.policy_loss(*args, backend="cuda")
    with pytest.raises(rk.BackendUnavailableError, match="native"):
        rk.ratio_kl(x["logprob"], x["old"], backend="native")


class _VerlActorConfig(dict):
    """The fields of verl's ActorConfig that compute_policy_loss_vanilla reads."""

    def __init__(self, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float):
        super().__init__(clip_ratio_c=clip_ratio_c)
        self.clip_ratio = clip_ratio_low
        self.clip_ratio_low = clip_ratio_low
        self.clip_ratio_high = clip_ratio_high
        self.global_batch_info: dict[str, object] = {}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_matches_verl_core_algos_when_installed(seed, mode):
    """Parity with verl's own functions (skipped where verl is not installed)."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    x = make_inputs((6, 21), spread=1.0, empty_row=True)
    cfg = _VerlActorConfig(0.2, 0.28, 3.0)
    for kl_type in ("k1", "abs", "k2", "low_var_kl", "k3+"):
        lp_verl, lp_ours = x["logprob"].clone().requires_grad_(), x["logprob"].clone().requires_grad_()
        pg, pg_metrics = core_algos.compute_policy_loss_vanilla(
            old_log_prob=x["old"], log_prob=lp_verl, advantages=x["adv"], response_mask=x["mask"], loss_agg_mode=mode,
            config=cfg, rollout_is_weights=x["is_w"],
        )
        kl_loss = core_algos.agg_loss(core_algos.kl_penalty(lp_verl, x["ref"], kl_type), x["mask"], mode)
        entropy_loss = core_algos.agg_loss(x["entropy"], x["mask"], mode)
        expected = pg - 0.01 * entropy_loss + 0.1 * kl_loss  # how verl's ppo_loss combines them
        expected.backward()
        loss, metrics = rk.policy_loss(
            lp_ours, x["old"], x["adv"], x["mask"], ref_logprob=x["ref"], clip_ratio_low=0.2, clip_ratio_high=0.28,
            clip_ratio_c=3.0, kl_type=kl_type, kl_coef=0.1, entropy=x["entropy"], entropy_coef=0.01,
            loss_agg_mode=mode, rollout_is_weights=x["is_w"],
        )
        loss.backward()
        assert_close(loss, expected.double(), "reduction", torch.float32, f"loss[{mode}, {kl_type}]")
        assert_close(lp_ours.grad, lp_verl.grad.double(), "gradient", torch.float32, "d/dlogprob")
        for ours, theirs in (("pg_loss", pg), ("kl_loss", kl_loss), ("entropy", entropy_loss)):
            assert_close(metrics[ours], theirs.detach().double(), "reduction", torch.float32, ours)
        for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
            assert_close(metrics[name], torch.tensor(pg_metrics[f"actor/{name}"], dtype=torch.float64), "reduction", torch.float32, name)


# ----------------------------------------------------------------------------- bad input

def _good():
    x = make_inputs((3, 4))
    return dict(logprob=x["logprob"], old_logprob=x["old"], advantages=x["adv"], mask=x["mask"])


def _call_policy(**over):
    kw = _good()
    kw.update(over)
    return rk.policy_loss(kw.pop("logprob"), kw.pop("old_logprob"), kw.pop("advantages"), kw.pop("mask"), **kw)


META = torch.device("meta")


@pytest.mark.parametrize(
    "over, err, name",
    [
        (dict(logprob=[0.1, 0.2]), TypeError, "logprob"),
        (dict(logprob=torch.ones(3, 4, dtype=torch.int64)), TypeError, "logprob"),
        (dict(logprob=torch.tensor(-1.0)), ValueError, "logprob"),
        (dict(old_logprob=torch.randn(3, 5)), ValueError, "old_logprob"),
        (dict(old_logprob=None), TypeError, "old_logprob"),
        (dict(advantages=None), TypeError, "advantages"),
        (dict(mask=None), ValueError, "exactly one of mask and loss_spans must be given, got neither"),
        (dict(advantages=torch.ones(3, 4, dtype=torch.int32)), TypeError, "advantages"),
        (dict(mask=torch.ones(3, 4, dtype=torch.int64)), TypeError, "mask"),
        (dict(mask=torch.ones(4, 3, dtype=torch.bool)), ValueError, "mask"),
        (dict(ref_logprob=torch.randn(3, 4, device=META)), ValueError, "ref_logprob"),
        (dict(entropy=torch.randn(2, 4)), ValueError, "entropy"),
        (dict(rollout_is_weights=torch.randn(3, 4, device=META)), ValueError, "rollout_is_weights"),
        (dict(advantages=torch.randn(3, 4).to_sparse()), TypeError, "advantages must be a dense"),
        (dict(mask=torch.ones(3, 4, dtype=torch.bool).to_sparse()), TypeError, "mask must be a dense"),
        (dict(clip_ratio_low=-0.1), ValueError, "clip_ratio_low"),
        (dict(clip_ratio_high="0.2"), TypeError, "clip_ratio_high"),
        (dict(clip_ratio_c=1.0), ValueError, "clip_ratio_c"),
        (dict(clip_ratio_c=0.5), ValueError, "clip_ratio_c"),
        (dict(clip_ratio_c="3"), TypeError, "clip_ratio_c"),
        (dict(clip_ratio_c=10**400), ValueError, "clip_ratio_c must be None or a finite number > 1 .*, got an int of 1329 bits"),
        (dict(clip_ratio_low=10**400), ValueError, "clip_ratio_low must be a finite number >= 0, got an int of 1329 bits"),
        (dict(kl_coef=10**400), ValueError, "kl_coef must be a finite number >= 0, got an int of"),
        (dict(clip_ratio_high=float("nan")), ValueError, "clip_ratio_high must be a finite number >= 0, got nan"),
        (dict(kl_type="k4"), ValueError, "kl_type"),
        (dict(kl_type="full"), ValueError, "kl_type='full'.*logits"),
        (dict(kl_type=3), TypeError, "kl_type"),
        (dict(kl_coef=-1.0), ValueError, "kl_coef"),
        (dict(entropy_coef=0.1), ValueError, "entropy"),
        (dict(loss_agg_mode="seq-sum"), ValueError, "loss_agg_mode"),
        (dict(mask=torch.tensor([[1.0, -0.5, 1.0, 0.0]] * 3)), ValueError, r"mask weights must be >= 0 .*3 entries outside it \(0 NaN, the smallest -0.5\)"),
        (dict(mask=torch.tensor([[1.0, float("nan"), 1.0, 0.0]] * 3)), ValueError, r"mask weights .*\(3 NaN\)"),
    ],
)
def test_policy_loss_bad_input_names_the_argument(over, err, name):
    with pytest.raises(err, match=name):
        _call_policy(**over)


@pytest.mark.parametrize(
    "args, kw, err, name",
    [
        ((torch.randn(3), torch.randn(4)), {}, ValueError, "old_logprob"),
        ((torch.randn(3), torch.randn(3, dtype=torch.float64).to(torch.int64)), {}, TypeError, "old_logprob"),
        ((torch.randn(3), torch.randn(3)), dict(ref_logprob=torch.randn(3, device=META)), ValueError, "ref_logprob"),
        ((torch.randn(3), torch.randn(3)), dict(kl_type="full"), ValueError, "kl_type"),
        (("x", torch.randn(3)), {}, TypeError, "logprob"),
        ((torch.randn(3), None), {}, TypeError, "old_logprob"),
    ],
)
def test_ratio_kl_bad_input_names_the_argument(args, kw, err, name):
    with pytest.raises(err, match=name):
        rk.ratio_kl(*args, **kw)


# ----------------------------------------------------------------------------- fused_linear_policy_loss

def _fused_inputs(dtype, seqs=3, seq_len=7, dim=16, vocab=50):
    hidden = (torch.randn(seqs, seq_len, dim) * 0.5).to(dtype)
    weight = (torch.randn(vocab, dim) * 0.3).to(dtype)
    bias = (torch.randn(vocab) * 0.1).to(dtype)
    targets = torch.randint(0, vocab, (seqs, seq_len))
    x = make_inputs((seqs, seq_len), spread=0.4, empty_row=seqs > 1)
    return hidden, weight, bias, targets, x


def _logprob_entropy_fp64(hidden, weight, bias, targets, temperature):
    logits = (hidden.double() @ weight.double().T + bias.double()) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    safe = targets.clamp(min=0)
    lp = logp.gather(-1, safe[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_matches_fp64_formula_values_and_gradients(seed, dtype):
    hidden, weight, bias, targets, x = _fused_inputs(dtype)
    temp = 0.7
    kw = dict(clip_ratio_c=3.0, kl_coef=0.1, entropy_coef=0.02, loss_agg_mode="seq-mean-token-mean")
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    loss, metrics = rk.fused_linear_policy_loss(
        h, w, targets, x["old"], x["adv"], x["mask"], bias=b, temperature=temp, ref_logprob=x["ref"], rollout_is_weights=x["is_w"], **kw,
    )
    loss.backward()

    h64, w64, b64 = (d(t).requires_grad_() for t in (hidden, weight, bias))
    lp, ent = _logprob_entropy_fp64(h64, w64, b64, targets, temp)
    exp_loss, exp_metrics = loss_formula(
        lp, d(x["old"]), d(x["adv"]), x["mask"].double(), ref=d(x["ref"]), c=3.0, kl="k3", kl_coef=0.1, ent=ent,
        ent_coef=0.02, mode="seq-mean-token-mean", is_w=d(x["is_w"]),
    )
    grads = torch.autograd.grad(exp_loss, (h64, w64, b64))
    assert_close(loss, exp_loss, "logprob", dtype, "loss")
    for name in METRICS:
        assert_close(metrics[name], exp_metrics[name], "logprob", dtype, name)
    for got, want, name in zip((h.grad, w.grad, b.grad), grads, ("hidden", "weight", "bias")):
        assert got.dtype == dtype
        assert_close(got, want, "gradient", dtype, f"d/d{name}")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fused_equals_linear_logprob_then_policy_loss(seed, mode):
    hidden, weight, bias, targets, x = _fused_inputs(torch.float32)
    targets[0, 2] = -100
    targets[2, 5] = -100
    kw = dict(clip_ratio_c=3.0, kl_type="k2", kl_coef=0.1, loss_agg_mode=mode, rollout_is_weights=x["is_w"], ref_logprob=x["ref"])
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    loss, metrics = rk.fused_linear_policy_loss(h1, weight, targets, x["old"], x["adv"], x["mask"], bias=bias, temperature=1.3, entropy_coef=0.05, **kw)
    lp, ent = rk.linear_logprob(h2, weight, targets, bias=bias, temperature=1.3, return_entropy=True)
    scored = x["mask"] & (targets != -100)
    exp_loss, exp_metrics = rk.policy_loss(lp, x["old"], x["adv"], scored, entropy=ent, entropy_coef=0.05, **kw)
    loss.backward()
    exp_loss.backward()
    assert_close(loss, exp_loss.double(), "logprob", torch.float32, "loss")
    for name in METRICS:
        assert_close(metrics[name], exp_metrics[name].double(), "logprob", torch.float32, name)
    assert_close(h1.grad, h2.grad.double(), "gradient", torch.float32, "d/dhidden")
    assert bool((h1.grad[0, 2] == 0).all()) and bool((h1.grad[2, 5] == 0).all())


def test_fused_one_sequence_and_empty(seed):
    hidden, weight, _, targets, x = _fused_inputs(torch.float32, seqs=1)
    a = rk.fused_linear_policy_loss(hidden[0], weight, targets[0], x["old"][0], x["adv"][0], x["mask"][0])
    b = rk.fused_linear_policy_loss(hidden, weight, targets, x["old"], x["adv"], x["mask"])
    assert torch.equal(a[0], b[0])
    h = torch.randn(0, 5, 16, requires_grad=True)
    empty = torch.randn(0, 5)
    loss, metrics = rk.fused_linear_policy_loss(h, weight, torch.zeros(0, 5, dtype=torch.int64), empty, empty, empty > 0)
    assert float(loss.detach()) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
    loss.backward()
    assert h.grad is not None and h.grad.shape == h.shape


@pytest.mark.parametrize(
    "over, err, name",
    [
        (dict(hidden=torch.randn(16)), ValueError, "hidden"),
        (dict(weight=torch.randn(50, 15)), ValueError, "weight"),
        (dict(weight=torch.randn(50, 16, dtype=torch.float64)), TypeError, "weight"),
        (dict(targets=torch.randint(0, 50, (3, 6))), ValueError, "targets"),
        (dict(targets=torch.rand(3, 7)), TypeError, "targets"),
        (dict(targets=torch.full((3, 7), 50)), ValueError, "targets"),
        (dict(bias=torch.randn(49)), ValueError, "bias"),
        (dict(old_logprob=torch.randn(3, 6)), ValueError, "old_logprob"),
        (dict(advantages=None), TypeError, "advantages"),
        (dict(mask=torch.ones(3, 7, dtype=torch.int64)), TypeError, "mask"),
        (dict(weight=torch.randn(50, 16, device=META)), ValueError, "weight"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=1e-40), ValueError, "temperature"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(ignore_index=2**70), ValueError, "ignore_index"),
        (dict(mask=-torch.ones(3, 7)), ValueError, "mask weights"),
        (dict(hidden=torch.randn(3, 7, 16, device=META), weight=torch.randn(50, 16, device=META), bias=None,
              targets=torch.zeros(3, 7, dtype=torch.long, device=META), old_logprob=torch.randn(3, 7, device=META),
              advantages=torch.randn(3, 7, device=META), mask=torch.ones(3, 7, dtype=torch.bool, device=META)), ValueError, "targets must hold data"),
        (dict(hidden=torch.randn(3, 7, 16).to_sparse()), TypeError, "hidden must be a dense"),
        (dict(kl_type="full"), ValueError, "kl_type"),
        (dict(clip_ratio_c=1.0), ValueError, "clip_ratio_c"),
        (dict(loss_agg_mode="sum"), ValueError, "loss_agg_mode"),
    ],
)
def test_fused_bad_input_names_the_argument(over, err, name):
    hidden, weight, bias, targets, x = _fused_inputs(torch.float32)
    kw = dict(hidden=hidden, weight=weight, targets=targets, old_logprob=x["old"], advantages=x["adv"], mask=x["mask"], bias=bias)
    kw.update(over)
    pos = [kw.pop(k) for k in ("hidden", "weight", "targets", "old_logprob", "advantages", "mask")]
    with pytest.raises(err, match=name):
        rk.fused_linear_policy_loss(*pos, **kw)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.parametrize("raw,on", [(None, False), ("", False), ("0", False), ("off", False), ("1", True), ("true", True), (" Yes ", True)])
def test_check_values_is_a_boolean_switch(monkeypatch, raw, on):
    """Off the CPU (a meta tensor here), values are checked only with the switch on, in any accepted spelling."""
    if raw is None:
        monkeypatch.delenv(CHECK_VALUES_ENV, raising=False)
    else:
        monkeypatch.setenv(CHECK_VALUES_ENV, raw)
    assert values_checked(torch.empty(2, device="meta")) is on
    assert values_checked(torch.empty(2)) is True


def test_check_values_refuses_an_unknown_spelling(monkeypatch):
    monkeypatch.setenv(CHECK_VALUES_ENV, "sure")
    with pytest.raises(SwitchError, match="RL_KERNEL_CHECK_VALUES must be one of"):
        values_checked(torch.empty(2, device="meta"))


@pytest.mark.gpu
def test_mask_weights_checked_on_gpu_only_when_asked(seed, monkeypatch):
    """GPU mask values are read back (a host sync) only with RL_KERNEL_CHECK_VALUES on."""
    x = {k: v.cuda() for k, v in make_inputs((3, 4)).items()}
    bad = torch.tensor([[1.0, -0.5, 1.0, 0.0]] * 3, device="cuda")
    monkeypatch.delenv("RL_KERNEL_CHECK_VALUES", raising=False)
    rk.policy_loss(x["logprob"], x["old"], x["adv"], bad)
    monkeypatch.setenv("RL_KERNEL_CHECK_VALUES", "true")
    with pytest.raises(ValueError, match="mask weights must be >= 0"):
        rk.policy_loss(x["logprob"], x["old"], x["adv"], bad)


@pytest.mark.gpu
def test_policy_loss_cuda_matches_cpu_and_is_deterministic(seed):
    x = make_inputs((8, 64), spread=0.6, empty_row=True)
    kw = dict(clip_ratio_c=3.0, kl_coef=0.1, loss_agg_mode="seq-mean-token-mean")
    cpu, cpu_m = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], ref_logprob=x["ref"], entropy=x["entropy"], entropy_coef=0.01, **kw)
    gpu = {k: v.cuda() for k, v in x.items()}
    runs = [rk.policy_loss(gpu["logprob"], gpu["old"], gpu["adv"], gpu["mask"], ref_logprob=gpu["ref"], entropy=gpu["entropy"], entropy_coef=0.01, **kw) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0])
    assert_close(runs[0][0], cpu.double(), "reduction", torch.float32, "loss")
    for name in METRICS:
        assert_close(runs[0][1][name], cpu_m[name].double(), "reduction", torch.float32, name)
    assert math.isfinite(float(runs[0][0]))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("float_mask", [False, True])
def test_aggregation_weights_are_the_gradient_of_the_aggregate(seed, mode, float_mask):
    """The closed-form token weights the fused loss uses equal autograd's ``d aggregate / d v``
    (empty sequences, an empty row and float weights included)."""
    from rl_kernel_core.reference.loss import aggregate, aggregation_weights

    mask = torch.rand(5, 7) < 0.6
    mask[1] = False
    if float_mask:
        mask = mask * (torch.rand(5, 7) * 2)
    v = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    weight = mask.to(torch.float64)
    keep = mask if mask.dtype == torch.bool else mask != 0
    (want,) = torch.autograd.grad(aggregate(v, weight, keep, mode), v)
    got = aggregation_weights(mask, mode)
    assert got.dtype == torch.float32
    assert_close(got, want, "reduction", torch.float32, f"aggregation weights, {mode}")


def test_global_batch_makes_the_aggregate_a_share_of_the_global_one(seed):
    """``global_batch``: verl's normalisation by global batch quantities, applied to the loss and the
    aggregate metrics (pg_loss, kl_loss, entropy); the token-mean metrics stay local."""
    from rl_kernel_core.loss import GlobalBatch

    x = make_inputs((6, 32), empty_row=True)
    ent = torch.rand(6, 32) * 2
    common = dict(ref_logprob=x["old"] + 0.1, kl_coef=0.05, entropy=ent, entropy_coef=0.01)

    def run(mode, **kw):
        return rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], loss_agg_mode=mode, **common, **kw)

    local_seqs = int((x["mask"].sum(-1) > 0).sum())
    cases = [
        ("token-mean", GlobalBatch(dp_size=4, batch_num_tokens=1000), "token-sum", 4 / 1000),
        ("token-mean", GlobalBatch(), "token-mean", 1.0),
        ("token-sum", GlobalBatch(dp_size=2), "token-sum", 2.0),
        ("seq-mean-token-mean", GlobalBatch(dp_size=2, global_batch_size=64), "seq-mean-token-mean", local_seqs * 2 / 64),
        ("seq-mean-token-sum-norm", GlobalBatch(loss_scale_factor=16.0), "seq-mean-token-sum-norm", 32 / 16),
    ]
    for mode, batch, local_mode, factor in cases:
        loss, metrics = run(mode, global_batch=batch)
        want_loss, want = run(local_mode)
        assert_close(loss, want_loss.double() * factor, "reduction", torch.float32, f"loss, {mode}, {batch}")
        for name in ("pg_loss", "kl_loss", "entropy"):
            assert_close(metrics[name], want[name].double() * factor, "reduction", torch.float32, f"{name}, {mode}")
        for name in ("pg_clipfrac", "ppo_kl"):
            assert_close(metrics[name], want[name].double(), "reduction", torch.float32, f"{name}, {mode}")
    with pytest.raises(ValueError, match="batch_num_tokens .* is required for token-mean when dp_size > 1"):
        run("token-mean", global_batch=GlobalBatch(dp_size=2))
    with pytest.raises(ValueError, match="global_batch_size is required for seq-mean-token-sum when dp_size > 1"):
        run("seq-mean-token-sum", global_batch=GlobalBatch(dp_size=2))
    with pytest.raises(ValueError, match="dp_size must be an int >= 1, got 0"):
        run("token-sum", global_batch=GlobalBatch(dp_size=0))
    with pytest.raises(TypeError, match="global_batch must be a GlobalBatch or None, got dict"):
        run("token-sum", global_batch={"dp_size": 2})
