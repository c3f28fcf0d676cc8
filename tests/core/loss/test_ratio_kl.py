"""ratio_kl: the shared cases on every backend, the reference against verl's formulas, bad input.

The shared cases run on each backend serving the op (``op_backends.on_backends``: ``torch`` on CPU,
``triton`` under the interpreter on CPU and compiled on CUDA, ``native`` on CUDA) against the fp64
formulas and the reference backend, with non-uniform upstream gradients, inputs across the ±20
log-ratio clamps and k3's +10 clamp. The reference's own cases compare with verl's estimators
written piecewise (``oracles``: ``kl_formula``, ``ratio_formula``). Tolerances come from
rl_kernel_core.contract only.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close
from op_backends import Backend, on_backends
from oracles import (
    KL_ALIASES,
    KL_TYPE_CASES,
    as_fp64,
    check_ratio_kl,
    kl_formula,
    kl_oracle,
    make_loss_inputs,
    make_tokens,
    ratio_formula,
)

DTYPES = [torch.float32, torch.bfloat16]
META = torch.device("meta")


# ============================================================== shared cases, every backend


@on_backends("ratio_kl")
@pytest.mark.parametrize("kl_type", KL_TYPE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ratio_kl_values_and_gradients(seed, backend: Backend, kl_type, dtype):
    check_ratio_kl(make_tokens((3, 53), backend.device, dtype), backend.name, kl_type)


@on_backends("ratio_kl")
def test_ratio_kl_gradient_of_one_output_and_default_ref(seed, backend: Backend):
    t = make_tokens((71,), backend.device)
    lp = t["lp"].clone().requires_grad_()
    _, kl = rk.ratio_kl(lp, t["old"], backend=backend.name)
    kl.sum().backward()
    lp64 = t["lp"].double().requires_grad_()
    kl_oracle(lp64, t["old"].double(), "k3").sum().backward()
    assert_close(lp.grad, lp64.grad, "gradient", torch.float32, "d logprob via kl against old")


@on_backends("ratio_kl", exclude=("torch",))
def test_ratio_kl_fast_backends_refuse_gradients_they_do_not_form(seed, backend: Backend):
    t = make_tokens((10,), backend.device)
    with pytest.raises(rk.BackendUnavailableError, match="old_logprob requires grad"):
        rk.ratio_kl(t["lp"], t["old"].clone().requires_grad_(), backend=backend.name)


@on_backends("ratio_kl", exclude=("torch",))
def test_ratio_kl_custom_op_passes_opcheck(seed, backend: Backend):
    """The fake impl, schema and autograd registration agree with the real kernels."""
    t = make_tokens((3, 11), backend.device)
    op = getattr(torch.ops.rl_kernel, f"{backend.name}_ratio_kl")
    torch.library.opcheck(op, (t["lp"].requires_grad_(), t["old"], t["ref"], "k3"))


# ============================================================== the reference (torch) on CPU


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
    assert_close(ratio, ratio_formula(as_fp64(lp), as_fp64(old)), "elementwise", dtype, "ratio")
    assert_close(kl, kl_formula(as_fp64(lp), as_fp64(ref), KL_ALIASES[kl_type]), "elementwise", dtype, f"kl[{kl_type}]")
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
    assert_close(kl, kl_formula(as_fp64(lp), as_fp64(ref), "k3"), "elementwise", dtype, "kl")
    assert_close(ratio, ratio_formula(as_fp64(lp), as_fp64(ref)), "elementwise", dtype, "ratio")


@pytest.mark.parametrize("kl_type", list(KL_ALIASES))
def test_ratio_kl_without_ref_measures_against_old(seed, kl_type):
    x = make_loss_inputs((4, 9))
    _, kl = rk.ratio_kl(x["logprob"], x["old"], kl_type=kl_type)
    assert_close(
        kl,
        kl_formula(as_fp64(x["logprob"]), as_fp64(x["old"]), KL_ALIASES[kl_type]),
        "elementwise",
        torch.float32,
        "kl",
    )


def test_ratio_kl_any_shape_empty_and_non_contiguous(seed):
    for shape in [(0,), (3, 0), ()]:
        lp = -torch.rand(shape) - 0.1
        old = lp - torch.rand(shape) - 0.1
        ratio, kl = rk.ratio_kl(lp, old, kl_type="k2")
        assert ratio.shape == shape and kl.shape == shape and ratio.dtype == torch.float32
        assert_close(kl, kl_formula(as_fp64(lp), as_fp64(old), "k2"), "elementwise", torch.float32, "kl")
        assert_close(ratio, ratio_formula(as_fp64(lp), as_fp64(old)), "elementwise", torch.float32, "ratio")
    x = make_loss_inputs((6, 4))
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

    lp64 = as_fp64(lp).requires_grad_()
    expected = (ratio_formula(lp64, as_fp64(old)) * upstream_r.double()).sum() + (
        kl_formula(lp64, as_fp64(ref), KL_ALIASES[kl_type]) * upstream_k.double()
    ).sum()
    (grad,) = torch.autograd.grad(expected, lp64)
    assert lp.grad is not None and lp.grad.dtype == dtype
    assert_close(lp.grad, grad, "gradient", dtype, "d/dlogprob")


@pytest.mark.parametrize("kl_type", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+", "k2+", "mse+"])
def test_straight_through_kl_has_base_value_and_k2_gradient(seed, kl_type):
    x = make_loss_inputs((3, 11), spread=1.0)
    lp = x["logprob"].clone().requires_grad_()
    _, kl = rk.ratio_kl(lp, x["old"], x["ref"], kl_type=kl_type)
    base = KL_ALIASES[kl_type[:-1]]
    assert_close(kl, kl_formula(as_fp64(lp), as_fp64(x["ref"]), base), "elementwise", torch.float32, "kl value")
    kl.sum().backward()
    assert_close(lp.grad, as_fp64(lp) - as_fp64(x["ref"]), "gradient", torch.float32, "k2 gradient")


def test_ratio_kl_gradcheck_fp64(seed):
    x = make_loss_inputs((3, 5))
    lp = as_fp64(x["logprob"]).requires_grad_()
    for kl_type in ("k1", "abs", "k2", "k3"):
        torch.autograd.gradcheck(lambda t: rk.ratio_kl(t, as_fp64(x["old"]), as_fp64(x["ref"]), kl_type=kl_type), (lp,))


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
