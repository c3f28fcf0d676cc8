"""fused_linear_policy_loss: the reference against verl's formulas and against linear_logprob then
policy_loss, and the Triton kernels on both routes against fp64.

* The reference (``torch``) on CPU: loss, metrics and gradients against fp64 log-probs fed to
  verl's formulas written piecewise (``oracles.loss_formula``), equality with the two-op path,
  one sequence, empty inputs, bad input.
* Triton on CPU under the Triton interpreter with small odd shapes and on CUDA (``gpu``) with
  realistic ones, on both kernel routes (``route``): against the fp64 log-probs fed to the
  reference loss formula, determinism, the no-grad path, the one-backward rule, the custom op.

(No native implementation exists.) Tolerances come from ``rl_kernel_core.contract``.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss.api import KL_TYPES, LossSettings
from rl_kernel_core.loss import reference as reference_loss
from oracles import (
    every_term_loss_formula,
    AGG_MODES,
    METRICS,
    as_fp64,
    leaves,
    linear_oracle,
    linear_shapes,
    make_inputs,
    make_loss_inputs,
    small_chunks,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes

DTYPES = [torch.float32, torch.bfloat16]
META = torch.device("meta")


# ------------------------------------------------------------------------- Triton (interpreter on CPU, compiled on CUDA)


def loss_oracle(hidden, weight, bias, targets, old, adv, mask, ref, rw, temperature, knobs):
    """fp64: the log-probs and entropies of the linear_oracle fed to the reference loss formula."""
    h, w, b = leaves(hidden.double(), weight.double(), None if bias is None else bias.double())
    s, t, d = hidden.shape
    lp, ent = linear_oracle(h.reshape(-1, d), w, b, targets.reshape(-1), temperature)
    scored = targets != -100
    mask = mask & scored if mask.dtype == torch.bool else mask.double() * scored
    settings = LossSettings(**{**knobs, "kl_type": KL_TYPES[knobs["kl_type"]]})
    loss, metrics = reference_loss.policy_loss(
        lp.view(s, t),
        old.double(),
        adv.double(),
        mask,
        ref.double(),
        ent.view(s, t),
        None if rw is None else rw.double(),
        settings,
    )
    grads = torch.autograd.grad(loss, [x for x in (h, w, b) if x is not None])
    return loss, metrics, grads


@pytest.mark.parametrize(
    "mode,float_mask,with_rw,kl_type",
    [
        ("token-mean", False, False, "low_var_kl"),
        ("seq-mean-token-mean", True, True, "k1"),
        ("seq-mean-token-sum-norm", False, True, "k3+"),
    ],
)
def test_fused_linear_policy_loss_matches_fp64(seed, device, route, tune, mode, float_mask, with_rw, kl_type):
    shape = linear_shapes(device)[0]
    s = 3 if device.type == "cpu" else 8
    t = shape["n"] // s
    small_chunks(tune, 16 if device.type == "cpu" else 512, shape["v"])
    hidden, weight, bias, targets = make_inputs(device, s * t, shape["d"], shape["v"], torch.bfloat16)
    hidden, targets = hidden.view(s, t, -1), targets.view(s, t)
    old = torch.randn(s, t, device=device) * 0.5 - 4.0
    adv = torch.randn(s, t, device=device)
    ref = torch.randn(s, t, device=device) * 0.5 - 4.0
    mask = torch.rand(s, t, device=device) if float_mask else torch.rand(s, t, device=device) < 0.8
    rw = torch.rand(s, t, device=device) + 0.5 if with_rw else None
    knobs = dict(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        kl_type=kl_type,
        kl_coef=0.05,
        entropy_coef=0.01,
        loss_agg_mode=mode,
    )
    h, w, b = leaves(hidden, weight, bias)
    loss, metrics = rk.fused_linear_policy_loss(
        h,
        w,
        targets,
        old,
        adv,
        mask,
        bias=b,
        temperature=0.7,
        ref_logprob=ref,
        rollout_is_weights=rw,
        backend="triton",
        **knobs,
    )
    upstream_scale = 1.5
    grads = torch.autograd.grad(loss * upstream_scale, (h, w, b))
    want_loss, want_metrics, want_grads = loss_oracle(
        hidden, weight, bias, targets, old, adv, mask, ref, rw, 0.7, knobs
    )
    assert_close(loss, want_loss, "reduction", torch.bfloat16, "loss")
    for name in want_metrics:
        assert_close(metrics[name], want_metrics[name], "reduction", torch.bfloat16, name)
    for name, got, ref_grad in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert got.dtype == torch.bfloat16
        assert_close(got, ref_grad * upstream_scale, "gradient", torch.bfloat16, f"d{name}")


def test_fused_loss_no_grad_and_determinism(seed, device, route):
    shape = linear_shapes(device)[0]
    s, t = 2, shape["n"] // 2
    hidden, weight, _, targets = make_inputs(device, s * t, shape["d"], shape["v"], torch.bfloat16, bias=False)
    hidden, targets = hidden.view(s, t, -1), targets.view(s, t)
    old, adv = torch.randn(s, t, device=device) - 4.0, torch.randn(s, t, device=device)
    mask = torch.rand(s, t, device=device) < 0.9
    runs = []
    for _ in range(2):
        h, w = leaves(hidden, weight)
        loss, _ = rk.fused_linear_policy_loss(h, w, targets, old, adv, mask, entropy_coef=0.01, backend="triton")
        runs.append((loss, *torch.autograd.grad(loss, (h, w))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    with torch.no_grad():
        loss_ng, _ = rk.fused_linear_policy_loss(
            hidden, weight, targets, old, adv, mask, entropy_coef=0.01, backend="triton"
        )
    assert loss_ng.grad_fn is None
    assert_close(loss_ng, runs[0][0], "reduction", torch.float32, "no-grad loss")


@pytest.mark.parametrize("extra_vocab", [0, 1])
def test_kept_logits_give_the_recomputed_bits(seed, device, tune, extra_vocab):
    """On the gemm route the loss's gradient pass can read the logits its statistics pass kept
    (``loss_keeps_logits_from_dim``) instead of forming them again: the same loss and metrics bit
    for bit, with the same chunk rows (dl is elementwise in the logits, which are the same bits).
    The gradients are cuBLAS products of that dl, which is a strided view of the fp32 chunk when
    kept: within the contract (cuBLAS may pick another kernel for another stride; an odd vocab
    gives rows of another alignment)."""
    shape = linear_shapes(device)[0]
    s = 3 if device.type == "cpu" else 8
    t = shape["n"] // s
    rows = 16 if device.type == "cpu" else 512
    vocab = shape["v"] + extra_vocab
    hidden, weight, bias, targets = make_inputs(device, s * t, shape["d"], vocab, torch.bfloat16)
    hidden, targets = hidden.view(s, t, -1), targets.view(s, t)
    old, adv = torch.randn(s, t, device=device) - 4.0, torch.randn(s, t, device=device)
    mask = torch.rand(s, t, device=device) < 0.9
    runs = []
    # the kept fp32 logits take the rows of a 16-bit dl chunk: the same rows per chunk either way
    for from_dim in (1, 10**9):
        tune(route="gemm", loss_keeps_logits_from_dim=from_dim, chunk_bytes=rows * vocab * 2)
        h, w, b = leaves(hidden, weight, bias)
        loss, metrics = rk.fused_linear_policy_loss(
            h, w, targets, old, adv, mask, bias=b, temperature=0.7, kl_coef=0.05, entropy_coef=0.01, backend="triton"
        )
        runs.append(((loss.detach(), *(metrics[m] for m in METRICS)), torch.autograd.grad(loss, (h, w, b))))
    (values, grads), (want_values, want_grads) = runs
    for label, a, b in zip(("loss", *METRICS), values, want_values):
        assert torch.equal(a, b), label
    for label, a, b in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
        assert_close(a, b.double(), "gradient", torch.bfloat16, label)


@pytest.mark.parametrize("keeps", [True, False], ids=["kept", "formed_again"])
def test_fused_loss_is_linear_logprob_then_policy_loss_bit_for_bit(seed, device, tune, keeps):
    """On the gemm route, logits kept or formed again, the fused loss's log-probs and entropies
    are ``linear_logprob``'s bits: its loss and metrics equal the reference ``policy_loss`` (the
    one the fused op calls) over ``linear_logprob``'s outputs, bit for bit."""
    tune(route="gemm", loss_keeps_logits_from_dim=1 if keeps else 10**9)
    shape = linear_shapes(device)[0]
    s = 3 if device.type == "cpu" else 8
    t = shape["n"] // s
    hidden, weight, bias, targets = make_inputs(device, s * t, shape["d"], shape["v"], torch.bfloat16)
    old, adv = torch.randn(s, t, device=device) - 4.0, torch.randn(s, t, device=device)
    ref = torch.randn(s, t, device=device) - 4.0
    mask = torch.rand(s, t, device=device) < 0.9
    knobs = dict(ref_logprob=ref, kl_coef=0.05, entropy_coef=0.01, clip_ratio_c=3.0)
    h, w, b = leaves(
        hidden.view(s, t, -1), weight, bias
    )  # leaves: the fused op's gradient path, where the logits are kept
    loss, metrics = rk.fused_linear_policy_loss(
        h, w, targets.view(s, t), old, adv, mask, bias=b, temperature=0.7, backend="triton", **knobs
    )
    lp, ent = rk.linear_logprob(
        hidden, weight, targets, bias=bias, temperature=0.7, return_entropy=True, backend="triton"
    )
    scored = mask & (targets.view(s, t) != -100)
    want_loss, want_metrics = rk.policy_loss(
        lp.view(s, t), old, adv, scored, entropy=ent.view(s, t), backend="torch", **knobs
    )
    assert torch.equal(loss.detach(), want_loss), "loss"
    for name in METRICS:
        assert torch.equal(metrics[name], want_metrics[name]), name


def test_only_the_gemm_route_keeps_logits(device):
    from rl_kernel_core.linear.chunks import ChunkBuffers
    from rl_kernel_core.linear.triton import PASSES

    h, w = torch.randn(4, 16, device=device), torch.randn(32, 16, device=device)
    with pytest.raises(ValueError, match="keep_logits: only the gemm route keeps its logits, got route 'chunked'"):
        ChunkBuffers(h, w, "chunked", PASSES, need_dl=True, keep_logits=True)


def test_fused_loss_second_backward_is_refused(seed, device):
    """The gradient formed in the forward goes to one backward; a second through the same graph raises."""
    shape = linear_shapes(device)[0]
    hidden, weight, _, targets = make_inputs(device, 8, shape["d"], shape["v"], torch.float32, bias=False)
    h, w = leaves(hidden.view(2, 4, -1), weight)
    old, adv, mask = (
        torch.randn(2, 4, device=device) - 4.0,
        torch.randn(2, 4, device=device),
        torch.ones(2, 4, dtype=torch.bool, device=device),
    )
    loss, _ = rk.fused_linear_policy_loss(h, w, targets.view(2, 4), old, adv, mask, backend="triton")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


def test_custom_op_passes_opcheck(seed, device):
    """The schema, fake and autograd registration of the Triton fused_linear_policy_loss agree with the kernels."""
    import rl_kernel_core.linear.triton_fused_loss  # noqa: F401  (defines the op)

    shape = linear_shapes(device)[0]
    hidden, weight, _, targets = make_inputs(device, 12, shape["d"], 96, torch.float32)
    s, t = 3, 4
    old, adv = torch.randn(s, t, device=device) - 4.0, torch.randn(s, t, device=device)
    mask = torch.rand(s, t, device=device) < 0.8
    torch.library.opcheck(
        torch.ops.rl_kernel.triton_fused_linear_policy_loss,
        (
            hidden.view(s, t, -1).requires_grad_(),
            weight.requires_grad_(),
            None,
            targets.view(s, t),
            old,
            adv,
            mask,
            old,
            None,
            0.9,
            -100,
            0.2,
            0.28,
            3.0,
            "k3",
            0.05,
            0.01,
            "token-mean",
            True,
            True,
            False,
        ),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


# ------------------------------------------------------------------------- the reference (torch) on CPU


def _fused_inputs(dtype, seqs=3, seq_len=7, dim=16, vocab=50):
    hidden = (torch.randn(seqs, seq_len, dim) * 0.5).to(dtype)
    weight = (torch.randn(vocab, dim) * 0.3).to(dtype)
    bias = (torch.randn(vocab) * 0.1).to(dtype)
    targets = torch.randint(0, vocab, (seqs, seq_len))
    x = make_loss_inputs((seqs, seq_len), spread=0.4, empty_row=seqs > 1)
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
        h,
        w,
        targets,
        x["old"],
        x["adv"],
        x["mask"],
        bias=b,
        temperature=temp,
        ref_logprob=x["ref"],
        rollout_is_weights=x["is_w"],
        **kw,
    )
    loss.backward()

    h64, w64, b64 = (as_fp64(t).requires_grad_() for t in (hidden, weight, bias))
    lp, ent = _logprob_entropy_fp64(h64, w64, b64, targets, temp)
    exp_loss, exp_metrics = every_term_loss_formula(x, lp, ent, kl_coef=0.1, ent_coef=0.02, mode="seq-mean-token-mean")
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
    kw = dict(
        clip_ratio_c=3.0,
        kl_type="k2",
        kl_coef=0.1,
        loss_agg_mode=mode,
        rollout_is_weights=x["is_w"],
        ref_logprob=x["ref"],
    )
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    loss, metrics = rk.fused_linear_policy_loss(
        h1, weight, targets, x["old"], x["adv"], x["mask"], bias=bias, temperature=1.3, entropy_coef=0.05, **kw
    )
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
    loss, metrics = rk.fused_linear_policy_loss(
        h, weight, torch.zeros(0, 5, dtype=torch.int64), empty, empty, empty > 0
    )
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
        (
            dict(
                hidden=torch.randn(3, 7, 16, device=META),
                weight=torch.randn(50, 16, device=META),
                bias=None,
                targets=torch.zeros(3, 7, dtype=torch.long, device=META),
                old_logprob=torch.randn(3, 7, device=META),
                advantages=torch.randn(3, 7, device=META),
                mask=torch.ones(3, 7, dtype=torch.bool, device=META),
            ),
            ValueError,
            "targets must hold data",
        ),
        (dict(hidden=torch.randn(3, 7, 16).to_sparse()), TypeError, "hidden must be a dense"),
        (dict(kl_type="full"), ValueError, "kl_type"),
        (dict(clip_ratio_c=1.0), ValueError, "clip_ratio_c"),
        (dict(loss_agg_mode="sum"), ValueError, "loss_agg_mode"),
    ],
)
def test_fused_bad_input_names_the_argument(over, err, name):
    hidden, weight, bias, targets, x = _fused_inputs(torch.float32)
    kw = dict(
        hidden=hidden,
        weight=weight,
        targets=targets,
        old_logprob=x["old"],
        advantages=x["adv"],
        mask=x["mask"],
        bias=bias,
    )
    kw.update(over)
    pos = [kw.pop(k) for k in ("hidden", "weight", "targets", "old_logprob", "advantages", "mask")]
    with pytest.raises(err, match=name):
        rk.fused_linear_policy_loss(*pos, **kw)
