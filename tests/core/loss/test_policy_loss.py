"""policy_loss: the shared cases on every backend, the reference against verl's formulas, bad input.

The shared cases run on each backend serving the op (``op_backends.on_backends``: ``torch`` on CPU,
``triton`` under the interpreter on CPU and compiled on CUDA, ``native`` on CUDA): loss, metrics
and gradients (non-uniform upstream) against the fp64 oracle (``oracles.policy_loss_oracle``:
verl's surrogate and aggregation written as loops) and against the reference backend; every
aggregation mode, dual clip, every KL type, float masks, optional terms, long and many sequences,
an empty mask; determinism and strided inputs bitwise. The reference's own cases compare with
verl's formulas written piecewise (``oracles.loss_formula``) and with verl itself where it
installs. Tolerances come from rl_kernel_core.contract only.
"""

from __future__ import annotations

import math

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core._checks import CHECK_VALUES_ENV, values_checked
from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss.api import LOSS_AGG_MODES, METRIC_NAMES
from rl_kernel_core.switches import SwitchError
from op_backends import Backend, on_backends
from oracles import (
    assert_no_host_sync,
    every_term_loss_formula,
    AGG_MODES,
    KL_TYPE_CASES,
    METRICS,
    as_fp64,
    check_policy_loss,
    loss_formula,
    make_loss_inputs,
    make_tokens,
    run_policy_loss,
    upstream,
)

DTYPES = [torch.float32, torch.bfloat16]
on_every_backend = on_backends("policy_loss")
on_fast_backends = on_backends("policy_loss", exclude=("torch",))
on_gpu_backends = on_backends("policy_loss", exclude=("torch", "triton-interpret"))


# ============================================================== shared cases, every backend


@on_every_backend
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_policy_loss_aggregation_modes_and_dual_clip(seed, backend: Backend, mode, dual):
    t = make_tokens((5, 37), backend.device)
    t["mask"][1] = False  # an empty sequence
    kl_type = KL_TYPE_CASES[(AGG_MODES.index(mode) * 2 + (dual is None)) % len(KL_TYPE_CASES)]
    check_policy_loss(t, backend.name, mode=mode, c=dual, kl_type=kl_type)


@on_every_backend
@pytest.mark.parametrize("kl_type", KL_TYPE_CASES)
def test_policy_loss_every_kl_type(seed, backend: Backend, kl_type):
    check_policy_loss(
        make_tokens((3, 41), backend.device), backend.name, kl_type=kl_type, kl_coef=0.3, mode="seq-mean-token-mean"
    )


@on_every_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # fp32: the direct-load path
def test_policy_loss_float_mask(seed, backend: Backend, dtype):
    check_policy_loss(
        make_tokens((4, 33), backend.device, dtype, mask_kind="float"), backend.name, mode="seq-mean-token-sum"
    )


@on_every_backend
@pytest.mark.parametrize(
    "opts",
    [dict(ref=False, ent=False, is_w=False, kl_coef=0.0), dict(ent=False, c=None), dict(is_w=False, kl_coef=0.0)],
)
def test_policy_loss_optional_terms(seed, backend: Backend, opts):
    check_policy_loss(make_tokens((2, 3, 21), backend.device), backend.name, **opts)


@on_every_backend
@pytest.mark.parametrize("shape", [(2, 2100), (1, 9001)])
def test_policy_loss_sequence_shapes(seed, backend: Backend, shape):
    # several token blocks per sequence (T > 1024: partial sums joined, the last block partial),
    # one long sequence
    check_policy_loss(make_tokens(shape, backend.device), backend.name, mode="seq-mean-token-mean")


@on_backends("policy_loss", exclude=("triton-interpret",))  # a program per sequence: 36 s interpreted
def test_policy_loss_many_short_sequences(seed, backend: Backend):
    check_policy_loss(make_tokens((1031, 7), backend.device), backend.name, mode="seq-mean-token-mean")


@on_every_backend
def test_policy_loss_empty_mask_gives_zero_and_zero_gradients(seed, backend: Backend):
    t = make_tokens((3, 9), backend.device)
    t["mask"][:] = False
    t["old"][0, 0] = float("nan")  # outside the mask: must not leak
    loss, metrics, g_lp, g_ent = check_policy_loss(t, backend.name, mode="token-mean")
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
    assert torch.equal(g_lp, torch.zeros_like(g_lp)) and torch.equal(g_ent, torch.zeros_like(g_ent))


@on_every_backend
def test_policy_loss_non_contiguous_inputs(seed, backend: Backend):
    t = make_tokens((4, 60), backend.device)
    strided = {k: v[:, ::2] for k, v in t.items()}
    contiguous = {k: v.contiguous() for k, v in strided.items()}
    g = upstream((), backend.device)
    a, b = run_policy_loss(strided, backend.name, g), run_policy_loss(contiguous, backend.name, g)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    check_policy_loss(strided, backend.name, mode="seq-mean-token-sum-norm")


@on_every_backend
def test_policy_loss_deterministic(seed, backend: Backend):
    t = make_tokens((6, 1500), backend.device)
    g = upstream((), backend.device)
    first = run_policy_loss(t, backend.name, g, mode="seq-mean-token-mean")
    second = run_policy_loss(t, backend.name, g, mode="seq-mean-token-mean")
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    for name in METRIC_NAMES:
        assert torch.equal(first[1][name], second[1][name])


# ============================================================== shared cases, the fast backends


@on_fast_backends
def test_policy_loss_refuses_what_it_does_not_serve(seed, backend: Backend):
    t = make_tokens((2, 8), backend.device)
    with pytest.raises(rk.BackendUnavailableError, match="advantages requires grad"):
        rk.policy_loss(t["lp"], t["old"], t["adv"].clone().requires_grad_(), t["mask"], backend=backend.name)
    with pytest.raises(rk.BackendUnavailableError, match="float64"):
        rk.policy_loss(t["lp"].double(), t["old"], t["adv"], t["mask"], backend=backend.name)


@on_fast_backends
def test_policy_loss_custom_op_passes_opcheck(seed, backend: Backend):
    """The fake impl, schema and autograd registration agree with the real kernels."""
    t = make_tokens((3, 11), backend.device)
    torch.library.opcheck(
        getattr(torch.ops.rl_kernel, f"{backend.name}_policy_loss"),
        (
            t["lp"],
            t["old"],
            t["adv"],
            t["mask"],
            t["ref"],
            t["ent"].requires_grad_(),
            t["is_w"],
            0.2,
            0.28,
            3.0,
            "k3+",
            0.1,
            0.01,
            "seq-mean-token-mean",
        ),
    )


@on_backends("policy_loss", exclude=("torch", "native-cuda"))
def test_triton_eager_path_matches_custom_op_bitwise(seed, backend: Backend):
    """Eager calls take a torch.autograd.Function over the kernels, torch.compile the custom op:
    same values and gradients, bit for bit; neither backward can be differentiated again (the
    eager one refuses create_graph=True at once, naming the op)."""
    from rl_kernel_core.loss import triton as triton_loss

    t = make_tokens((3, 11), backend.device)
    args = (
        t["old"],
        t["adv"],
        t["mask"],
        t["ref"],
        None,
        t["is_w"],
        0.2,
        0.28,
        3.0,
        "k3+",
        0.1,
        0.0,
        "seq-mean-token-mean",
    )
    outs = []
    for op in (torch.ops.rl_kernel.triton_policy_loss, triton_loss._policy_loss_op):
        lp = t["lp"].detach().clone().requires_grad_()
        loss, metrics, _, _ = op(lp, *args)
        (grad,) = torch.autograd.grad(loss, (lp,), retain_graph=True)
        outs.append((loss, metrics, grad))
        scale = torch.ones((), device=backend.device, requires_grad=True)  # an upstream gradient that requires grad
        if op is triton_loss._policy_loss_op:
            with pytest.raises(RuntimeError, match="rl_kernel::triton_policy_loss has no double backward"):
                torch.autograd.grad(loss * scale, (lp,), create_graph=True)
        else:
            (grad2,) = torch.autograd.grad(loss * scale, (lp,), create_graph=True)
            with pytest.raises(RuntimeError, match="no autograd formula was registered"):
                grad2.sum().backward()
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@on_gpu_backends
@pytest.mark.parametrize(
    "shape,mode",
    [((2048, 512), "token-mean"), ((256, 4096), "seq-mean-token-mean"), ((997, 1031), "seq-mean-token-sum-norm")],
)
def test_policy_loss_realistic(seed, backend: Backend, shape, mode):
    check_policy_loss(make_tokens(shape, "cuda"), backend.name, mode=mode, kl_type="k3+")


@on_gpu_backends
def test_losses_never_sync_with_the_host(seed, backend: Backend):
    t = make_tokens((512, 1024), "cuda")
    g = upstream((), "cuda")
    rewards = t["adv"][:, 0].contiguous()

    def step():
        run_policy_loss(t, backend.name, g)
        rk.group_advantages(rewards, group_size=8, backend=backend.name)
        rk.ratio_kl(t["lp"], t["old"], t["ref"], backend=backend.name)

    assert_no_host_sync(step)


# ============================================================== the reference (torch) on CPU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_each_agg_mode_matches_formula(seed, dtype, mode):
    x = make_loss_inputs((6, 19), dtype, spread=0.4, empty_row=True)
    loss, metrics = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], loss_agg_mode=mode)
    exp_loss, exp_metrics = loss_formula(
        as_fp64(x["logprob"]), as_fp64(x["old"]), as_fp64(x["adv"]), x["mask"].double(), mode=mode
    )
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, exp_loss, "reduction", dtype, f"loss[{mode}]")
    for name in METRICS:
        assert_close(metrics[name], exp_metrics[name], "reduction", dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_policy_loss_clipping_and_dual_clip(seed, dtype, clip_ratio_c):
    x = make_loss_inputs((5, 40), dtype, spread=1.5)  # ratios from ~0.01 to ~100: every branch is taken
    lo, hi = 0.2, 0.28
    loss, metrics = rk.policy_loss(
        x["logprob"], x["old"], x["adv"], x["mask"], clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=clip_ratio_c
    )
    exp_loss, exp_metrics = loss_formula(
        as_fp64(x["logprob"]), as_fp64(x["old"]), as_fp64(x["adv"]), x["mask"].double(), lo=lo, hi=hi, c=clip_ratio_c
    )
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
    x = make_loss_inputs((4, 23), dtype, spread=0.5, empty_row=True)
    kw = dict(
        ref_logprob=x["ref"],
        clip_ratio_c=3.0,
        kl_type="low_var_kl",
        kl_coef=0.1,
        entropy=x["entropy"],
        entropy_coef=0.01,
        loss_agg_mode=mode,
        rollout_is_weights=x["is_w"],
    )
    loss, metrics = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], **kw)
    exp_loss, exp_metrics = every_term_loss_formula(
        x, as_fp64(x["logprob"]), as_fp64(x["entropy"]), kl_coef=0.1, ent_coef=0.01, mode=mode
    )
    assert_close(loss, exp_loss, "reduction", dtype, "loss")
    for name in METRICS:
        assert_close(metrics[name], exp_metrics[name], "reduction", dtype, name)
    assert float(metrics["kl_loss"]) > 0 and float(metrics["entropy"]) > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_gradients_match_fp64_autograd(seed, dtype, mode):
    x = make_loss_inputs((4, 15), dtype, spread=0.5, empty_row=True)
    lp = x["logprob"].clone().requires_grad_()
    ent = x["entropy"].clone().requires_grad_()
    loss, _ = rk.policy_loss(
        lp,
        x["old"],
        x["adv"],
        x["mask"],
        ref_logprob=x["ref"],
        clip_ratio_c=3.0,
        kl_type="k3",
        kl_coef=0.2,
        entropy=ent,
        entropy_coef=0.05,
        loss_agg_mode=mode,
        rollout_is_weights=x["is_w"],
    )
    loss.backward()
    lp64, ent64 = as_fp64(lp).requires_grad_(), as_fp64(ent).requires_grad_()
    exp_loss, _ = every_term_loss_formula(x, lp64, ent64, kl_coef=0.2, ent_coef=0.05, mode=mode)
    g_lp, g_ent = torch.autograd.grad(exp_loss, (lp64, ent64))
    assert lp.grad.dtype == dtype and ent.grad.dtype == dtype
    assert_close(lp.grad, g_lp, "gradient", dtype, "d/dlogprob")
    assert_close(ent.grad, g_ent, "gradient", dtype, "d/dentropy")
    assert bool((lp.grad[~x["mask"]] == 0).all())


def test_policy_loss_gradcheck_fp64(seed):
    x = make_loss_inputs((3, 6), spread=0.5)
    args = {k: as_fp64(v) for k, v in x.items() if k != "mask"}
    lp = args["logprob"].requires_grad_()
    ent = args["entropy"].requires_grad_()
    for mode in AGG_MODES:

        def fn(lp_, ent_):
            return rk.policy_loss(
                lp_,
                args["old"],
                args["adv"],
                x["mask"],
                ref_logprob=args["ref"],
                clip_ratio_c=3.0,
                kl_coef=0.1,
                entropy=ent_,
                entropy_coef=0.01,
                loss_agg_mode=mode,
                rollout_is_weights=args["is_w"],
            )[0]

        torch.autograd.gradcheck(fn, (lp, ent))


def test_policy_loss_metrics_are_detached_0d_and_loss_is_attached(seed):
    x = make_loss_inputs((3, 8))
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
            t(),
            t(),
            t(),
            mask,
            ref_logprob=t(),
            clip_ratio_c=3.0,
            kl_coef=0.1,
            entropy=t(),
            entropy_coef=0.1,
            loss_agg_mode=mode,
            rollout_is_weights=t(),
        )
        assert loss.device.type == "meta" and loss.dim() == 0
        assert all(v.device.type == "meta" and v.dim() == 0 for v in metrics.values())


def test_policy_loss_float_mask_weighs_tokens(seed):
    x = make_loss_inputs((5, 12), empty_row=True)
    binary = x["mask"].float()
    for mode in AGG_MODES:
        a = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], loss_agg_mode=mode, entropy=x["entropy"])
        b = rk.policy_loss(x["logprob"], x["old"], x["adv"], binary, loss_agg_mode=mode, entropy=x["entropy"])
        assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in METRICS)
    weights = x["mask"] * (torch.rand(5, 12) + 0.1)
    for mode in AGG_MODES:
        loss, metrics = rk.policy_loss(x["logprob"], x["old"], x["adv"], weights, loss_agg_mode=mode)
        exp_loss, exp_metrics = loss_formula(
            as_fp64(x["logprob"]), as_fp64(x["old"]), as_fp64(x["adv"]), weights.double(), mode=mode
        )
        assert_close(loss, exp_loss, "reduction", torch.float32, f"weighted loss[{mode}]")
        assert_close(metrics["ppo_kl"], exp_metrics["ppo_kl"], "reduction", torch.float32, "weighted ppo_kl")


def test_policy_loss_ignores_non_finite_values_outside_the_mask(seed):
    x = make_loss_inputs((4, 10))
    poisoned = {k: x[k].clone() for k in ("logprob", "old", "adv", "entropy")}
    for k, v in poisoned.items():
        v[~x["mask"]] = float("nan") if k != "adv" else float("inf")
    for mode in AGG_MODES:
        a = rk.policy_loss(
            x["logprob"], x["old"], x["adv"], x["mask"], kl_coef=0.1, entropy=x["entropy"], loss_agg_mode=mode
        )
        b = rk.policy_loss(
            poisoned["logprob"],
            poisoned["old"],
            poisoned["adv"],
            x["mask"],
            kl_coef=0.1,
            entropy=poisoned["entropy"],
            loss_agg_mode=mode,
        )
        assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in METRICS)


def test_policy_loss_shapes_leading_dims_and_one_sequence(seed):
    x = make_loss_inputs((2, 3, 11), empty_row=True)
    flat = {k: v.reshape(6, 11) for k, v in x.items()}
    for mode in AGG_MODES:
        a = rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], loss_agg_mode=mode)
        b = rk.policy_loss(flat["logprob"], flat["old"], flat["adv"], flat["mask"], loss_agg_mode=mode)
        assert torch.equal(a[0], b[0])
    one = make_loss_inputs((13,))
    a = rk.policy_loss(one["logprob"], one["old"], one["adv"], one["mask"], loss_agg_mode="seq-mean-token-sum")
    b = rk.policy_loss(*(one[k][None] for k in ("logprob", "old", "adv", "mask")), loss_agg_mode="seq-mean-token-sum")
    assert torch.equal(a[0], b[0])


def test_policy_loss_non_contiguous_equals_contiguous(seed):
    x = make_loss_inputs((9, 5))  # transposed below: [5, 9] views with strides (1, 5)
    views = {k: v.t() for k, v in x.items()}
    assert not views["logprob"].is_contiguous()
    for mode in AGG_MODES:
        kw = dict(
            ref_logprob=views["ref"],
            kl_coef=0.1,
            entropy=views["entropy"],
            entropy_coef=0.1,
            rollout_is_weights=views["is_w"],
            loss_agg_mode=mode,
            clip_ratio_c=3.0,
        )
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
        loss, metrics = rk.policy_loss(
            lp,
            torch.randn(shape),
            torch.randn(shape),
            torch.ones(shape, dtype=torch.bool),
            kl_coef=0.1,
            entropy=torch.rand(shape),
            entropy_coef=0.1,
            loss_agg_mode=mode,
        )
        assert loss.dim() == 0 and float(loss.detach()) == 0.0
        assert all(float(v) == 0.0 for v in metrics.values())
        loss.backward()
        assert lp.grad is not None and lp.grad.shape == lp.shape


def test_policy_loss_all_masked_gives_zero_not_nan(seed):
    x = make_loss_inputs((3, 6))
    none = torch.zeros(3, 6, dtype=torch.bool)
    for mode in AGG_MODES:
        loss, metrics = rk.policy_loss(x["logprob"], x["old"], x["adv"], none, kl_coef=0.1, loss_agg_mode=mode)
        assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values())


def test_policy_loss_backend_choice_and_errors(seed):
    x = make_loss_inputs((2, 5))
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
    x = make_loss_inputs((6, 21), spread=1.0, empty_row=True)
    cfg = _VerlActorConfig(0.2, 0.28, 3.0)
    for kl_type in ("k1", "abs", "k2", "low_var_kl", "k3+"):
        lp_verl, lp_ours = x["logprob"].clone().requires_grad_(), x["logprob"].clone().requires_grad_()
        pg, pg_metrics = core_algos.compute_policy_loss_vanilla(
            old_log_prob=x["old"],
            log_prob=lp_verl,
            advantages=x["adv"],
            response_mask=x["mask"],
            loss_agg_mode=mode,
            config=cfg,
            rollout_is_weights=x["is_w"],
        )
        kl_loss = core_algos.agg_loss(core_algos.kl_penalty(lp_verl, x["ref"], kl_type), x["mask"], mode)
        entropy_loss = core_algos.agg_loss(x["entropy"], x["mask"], mode)
        expected = pg - 0.01 * entropy_loss + 0.1 * kl_loss  # how verl's ppo_loss combines them
        expected.backward()
        loss, metrics = rk.policy_loss(
            lp_ours,
            x["old"],
            x["adv"],
            x["mask"],
            ref_logprob=x["ref"],
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_c=3.0,
            kl_type=kl_type,
            kl_coef=0.1,
            entropy=x["entropy"],
            entropy_coef=0.01,
            loss_agg_mode=mode,
            rollout_is_weights=x["is_w"],
        )
        loss.backward()
        assert_close(loss, expected.double(), "reduction", torch.float32, f"loss[{mode}, {kl_type}]")
        assert_close(lp_ours.grad, lp_verl.grad.double(), "gradient", torch.float32, "d/dlogprob")
        for ours, theirs in (("pg_loss", pg), ("kl_loss", kl_loss), ("entropy", entropy_loss)):
            assert_close(metrics[ours], theirs.detach().double(), "reduction", torch.float32, ours)
        for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
            assert_close(
                metrics[name],
                torch.tensor(pg_metrics[f"actor/{name}"], dtype=torch.float64),
                "reduction",
                torch.float32,
                name,
            )


# ----------------------------------------------------------------------------- bad input


def _good():
    x = make_loss_inputs((3, 4))
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
        (
            dict(clip_ratio_c=10**400),
            ValueError,
            "clip_ratio_c must be None or a finite number > 1 .*, got an int of 1329 bits",
        ),
        (
            dict(clip_ratio_low=10**400),
            ValueError,
            "clip_ratio_low must be a finite number >= 0, got an int of 1329 bits",
        ),
        (dict(kl_coef=10**400), ValueError, "kl_coef must be a finite number >= 0, got an int of"),
        (dict(clip_ratio_high=float("nan")), ValueError, "clip_ratio_high must be a finite number >= 0, got nan"),
        (dict(kl_type="k4"), ValueError, "kl_type"),
        (dict(kl_type="full"), ValueError, "kl_type='full'.*logits"),
        (dict(kl_type=3), TypeError, "kl_type"),
        (dict(kl_coef=-1.0), ValueError, "kl_coef"),
        (dict(entropy_coef=0.1), ValueError, "entropy"),
        (dict(loss_agg_mode="seq-sum"), ValueError, "loss_agg_mode"),
        (
            dict(mask=torch.tensor([[1.0, -0.5, 1.0, 0.0]] * 3)),
            ValueError,
            r"mask weights must be >= 0 .*3 entries outside it \(0 NaN, the smallest -0.5\)",
        ),
        (dict(mask=torch.tensor([[1.0, float("nan"), 1.0, 0.0]] * 3)), ValueError, r"mask weights .*\(3 NaN\)"),
    ],
)
def test_policy_loss_bad_input_names_the_argument(over, err, name):
    with pytest.raises(err, match=name):
        _call_policy(**over)


# ----------------------------------------------------------------------------- value checks, GPU, aggregation weights


@pytest.mark.parametrize(
    "raw,on", [(None, False), ("", False), ("0", False), ("off", False), ("1", True), ("true", True), (" Yes ", True)]
)
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
    x = {k: v.cuda() for k, v in make_loss_inputs((3, 4)).items()}
    bad = torch.tensor([[1.0, -0.5, 1.0, 0.0]] * 3, device="cuda")
    monkeypatch.delenv("RL_KERNEL_CHECK_VALUES", raising=False)
    rk.policy_loss(x["logprob"], x["old"], x["adv"], bad)
    monkeypatch.setenv("RL_KERNEL_CHECK_VALUES", "true")
    with pytest.raises(ValueError, match="mask weights must be >= 0"):
        rk.policy_loss(x["logprob"], x["old"], x["adv"], bad)


@pytest.mark.gpu
def test_policy_loss_cuda_matches_cpu_and_is_deterministic(seed):
    x = make_loss_inputs((8, 64), spread=0.6, empty_row=True)
    kw = dict(clip_ratio_c=3.0, kl_coef=0.1, loss_agg_mode="seq-mean-token-mean")
    cpu, cpu_m = rk.policy_loss(
        x["logprob"], x["old"], x["adv"], x["mask"], ref_logprob=x["ref"], entropy=x["entropy"], entropy_coef=0.01, **kw
    )
    gpu = {k: v.cuda() for k, v in x.items()}
    runs = [
        rk.policy_loss(
            gpu["logprob"],
            gpu["old"],
            gpu["adv"],
            gpu["mask"],
            ref_logprob=gpu["ref"],
            entropy=gpu["entropy"],
            entropy_coef=0.01,
            **kw,
        )
        for _ in range(2)
    ]
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
    from rl_kernel_core.loss.reference import aggregate, aggregation_weights

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
    from rl_kernel_core.loss.api import GlobalBatch

    x = make_loss_inputs((6, 32), empty_row=True)
    ent = torch.rand(6, 32) * 2
    common = dict(ref_logprob=x["old"] + 0.1, kl_coef=0.05, entropy=ent, entropy_coef=0.01)

    def run(mode, **kw):
        return rk.policy_loss(x["logprob"], x["old"], x["adv"], x["mask"], loss_agg_mode=mode, **common, **kw)

    local_seqs = int((x["mask"].sum(-1) > 0).sum())
    cases = [
        ("token-mean", GlobalBatch(dp_size=4, batch_num_tokens=1000), "token-sum", 4 / 1000),
        ("token-mean", GlobalBatch(), "token-mean", 1.0),
        ("token-sum", GlobalBatch(dp_size=2), "token-sum", 2.0),
        (
            "seq-mean-token-mean",
            GlobalBatch(dp_size=2, global_batch_size=64),
            "seq-mean-token-mean",
            local_seqs * 2 / 64,
        ),
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
