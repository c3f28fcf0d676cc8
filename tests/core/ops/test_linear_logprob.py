"""Triton ``linear_logprob`` and ``fused_linear_policy_loss`` against fp64 formulas written here.

Every case runs twice: on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set per test:
the kernels pick interpreted or compiled execution at launch time) with small odd shapes, and on
CUDA (``gpu`` marker) with realistic ones. Both kernel routes (``gemm``: ``tl.dot`` tiles in
registers; ``chunked``: an fp32 logits chunk from cuBLAS) run where the case depends on them.
Tolerances come from ``rl_kernel_core.contract``; invariances are asserted bitwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core.contract import assert_close
from rl_kernel_core.loss import KL_TYPES, LossSettings
from rl_kernel_core.reference import loss as reference_loss
from rl_kernel_core import linear_chunks
from rl_kernel_core.linear_chunks import tuning
from rl_kernel_core.triton.linear_logprob import linear_logprob as linear_logprob_triton
from oracles import leaves, linear_oracle, linear_oracle_grads, make_inputs, small_chunks, upstream

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes

ROUTES = ("gemm", "chunked")
# (N prime, D not a multiple of the K tile, V not a multiple of the vocab tile)
CPU_SHAPE = dict(n=37, d=40, v=300)
GPU_SHAPES = [dict(n=1031, d=896, v=151936), dict(n=257, d=4096, v=128256)]


@pytest.fixture
def device(triton_device):
    """``cpu`` runs the kernels in the Triton interpreter; ``cuda`` compiles them."""
    return triton_device


@pytest.fixture(params=ROUTES)
def route(request, tune):
    """Run the forward, backward and loss on one kernel route."""
    tune(route=request.param)
    return request.param


TILE_VARIANTS = {  # the gemm route's loads and launch: pointer or TMA loads, one program per tile or persistent
    "pointer": dict(tma=False, persistent=False),
    "tma": dict(tma=True, persistent=False),
    "tma_persistent": dict(tma=True, persistent=True),
    "pointer_persistent": dict(tma=False, persistent=True),
}




def shapes(device, all_gpu_shapes=False):
    """The CPU shape, or the first GPU shape (every GPU shape when ``all_gpu_shapes``)."""
    if device.type == "cpu":
        return [CPU_SHAPE]
    return GPU_SHAPES if all_gpu_shapes else GPU_SHAPES[:1]










def run(hidden, weight, bias, targets, temperature, g_lp=None, g_ent=None):
    """Values and (when upstream gradients are given) gradients through the public op."""
    h, w, b = leaves(hidden, weight, bias)
    lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=temperature, return_entropy=True, backend="triton")
    if g_lp is None:
        return lp, ent, ()
    grads = torch.autograd.grad((lp * g_lp.float()).sum() + (ent * g_ent.float()).sum(), [x for x in (h, w, b) if x is not None])
    return lp, ent, grads


# ------------------------------------------------------------------------- linear_logprob


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,with_bias", [(1.0, False), (0.7, True)])
def test_values_and_gradients_match_fp64(seed, device, route, tune, dtype, temperature, with_bias):
    for shape in shapes(device, all_gpu_shapes=with_bias):
        small_chunks(tune, 16 if device.type == "cpu" else 512, shape["v"])
        hidden, weight, bias, targets = make_inputs(device, **shape, dtype=dtype, bias=with_bias)
        g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
        lp, ent, grads = run(hidden, weight, bias, targets, temperature, g_lp, g_ent)
        ref_lp, ref_ent = linear_oracle(hidden, weight, bias, targets, temperature)
        assert lp.dtype == ent.dtype == torch.float32
        assert_close(lp, ref_lp, "logprob", dtype, f"logprob {shape}")
        assert_close(ent, ref_ent, "logprob", dtype, f"entropy {shape}")
        ignored = targets == -100
        assert torch.all(lp[ignored] == 0) and torch.all(ent[ignored] == 0)
        want = linear_oracle_grads(hidden, weight, bias, targets, temperature, g_lp, g_ent)
        for name, got, ref in zip(("hidden", "weight", "bias"), grads, want):
            assert got.dtype == dtype
            assert_close(got, ref, "gradient", dtype, f"d{name} {shape}")
        assert torch.all(grads[0][ignored] == 0)


def test_fp16_and_logprob_only_gradient(seed, device):
    shape = shapes(device)[0]
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.float16)
    g_lp = upstream(shape["n"], device)
    h, w, b = leaves(hidden, weight, bias)
    lp = rk.linear_logprob(h, w, targets, bias=b, temperature=0.7, backend="triton")
    grads = torch.autograd.grad((lp * g_lp.float()).sum(), (h, w, b))
    assert_close(lp, linear_oracle(hidden, weight, bias, targets, 0.7)[0], "logprob", torch.float16, "logprob")
    want = linear_oracle_grads(hidden, weight, bias, targets, 0.7, g_lp, torch.zeros_like(g_lp))
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, want):
        assert_close(got, ref, "gradient", torch.float16, f"d{name}")


@pytest.mark.parametrize("case", ["large", "equal"])
def test_extreme_logits(seed, device, route, case):
    """Logits of magnitude ~100, and all-equal logits (log p = -log V, entropy = log V)."""
    shape = shapes(device)[0]
    # D >= 256: the logits' magnitude is spread over many products, as in a model, so that the
    # bf16 rounding of the logit gradient (times |W| or |h|) stays what it is in practice
    n, d, v = shape["n"], max(256, shape["d"]), shape["v"]
    hidden, weight, _, targets = make_inputs(device, n, d, v, torch.bfloat16, bias=False, scale=33.0)
    if case == "equal":
        weight = (torch.randn(1, d, device=device) * (3.0 / d**0.5)).to(torch.bfloat16).expand(v, d).contiguous()
    g_lp, g_ent = upstream(n, device), upstream(n, device)
    lp, ent, grads = run(hidden, weight, None, targets, 1.0, g_lp, g_ent)
    ref_lp, ref_ent = linear_oracle(hidden, weight, None, targets, 1.0)
    if case == "large":
        logits = hidden.double() @ weight.double().T
        assert logits.abs().max() > 100
    else:
        kept = targets != -100
        assert torch.allclose(ref_lp[kept], torch.full_like(ref_lp[kept], -torch.log(torch.tensor(float(v))).item()))
    assert_close(lp, ref_lp, "logprob", torch.bfloat16, "logprob")
    assert_close(ent, ref_ent, "logprob", torch.bfloat16, "entropy")
    for name, got, ref in zip(("hidden", "weight"), grads, linear_oracle_grads(hidden, weight, None, targets, 1.0, g_lp, g_ent)):
        assert_close(got, ref, "gradient", torch.bfloat16, f"d{name}")


def test_noncontiguous_inputs_same_bits(seed, device, route):
    """Strided views give the same bits as contiguous copies: the backend copies them to the one
    layout its kernels are specialized for (a strided load changes Triton's register layout and so
    a reduction's order; a column-major weight changes cuBLAS's kernel on the chunked route)."""
    shape = shapes(device)[0]
    n, d, v = shape["n"], shape["d"], shape["v"]
    hidden, weight, bias, targets = make_inputs(device, n, d, v, torch.bfloat16)
    wide = torch.randn(n, 2 * d, device=device).to(torch.bfloat16)
    wide[:, ::2] = hidden
    hidden_nc = wide[:, ::2]
    weight_nc = weight.T.contiguous().T
    assert not hidden_nc.is_contiguous()
    for h, w in ((hidden, weight), (hidden_nc, weight_nc)):
        out = linear_logprob_triton(h, w, targets, bias, 0.9, -100, True, None)
        if h is hidden:
            first = out
    assert torch.equal(first[0], out[0]) and torch.equal(first[1], out[1])


def test_deterministic_and_batch_invariant(seed, device, route, tune):
    """Bitwise: two runs agree, and a row's value and dh do not depend on N or on the other rows."""
    shape = shapes(device)[0]
    rows = 16 if device.type == "cpu" else 512
    small_chunks(tune, rows, shape["v"])
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
    full = run(hidden, weight, bias, targets, 0.8, g_lp, g_ent)
    again = run(hidden, weight, bias, targets, 0.8, g_lp, g_ent)
    for a, b in zip(full[:2] + tuple(full[2]), again[:2] + tuple(again[2])):
        assert torch.equal(a, b)
    # the first rows alone, with other rows after them, and a single row
    other = make_inputs(device, **shape, dtype=torch.bfloat16)
    for m in (1, rows + 3):
        m = min(m, shape["n"] - 1)
        h2 = torch.cat([hidden[:m], other[0][: shape["n"] - m]])
        t2 = torch.cat([targets[:m], other[3][: shape["n"] - m]])
        for take in (m, shape["n"]):
            part = run(h2[:take], weight, bias, t2[:take], 0.8, g_lp[:take], g_ent[:take])
            assert torch.equal(part[0][:m], full[0][:m]), f"logprob rows, N={take}"
            assert torch.equal(part[1][:m], full[1][:m]), f"entropy rows, N={take}"
            assert torch.equal(part[2][0][:m], full[2][0][:m]), f"dhidden rows, N={take}"


def test_tile_variants_agree(seed, device, tune):
    """Pointer or TMA loads, one program per tile or a persistent walk: the same tiles and the same
    K order, so the same bits under the interpreter; on a GPU within the contract of each other
    (the default variant is the one the other GPU tests check against fp64)."""
    shape = shapes(device)[0]
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
    outs = {}
    for name, fields in TILE_VARIANTS.items():
        tiles = dataclasses.replace(tuning().gemm_tiles, **fields)
        grad_tiles = dataclasses.replace(tuning().gemm_grad_tiles, **fields)
        with linear_chunks.tuned(route="gemm", gemm_tiles=tiles, gemm_grad_tiles=grad_tiles):
            lp, ent, grads = run(hidden, weight, bias, targets, 0.8, g_lp, g_ent)
        outs[name] = (lp, ent) + tuple(grads)
    labels = ("logprob", "entropy", "dhidden", "dweight", "dbias")
    for name, out in outs.items():
        for label, got, want in zip(labels, out, outs["pointer"]):
            if device.type == "cpu":
                assert torch.equal(got, want), f"{name}: {label}"
            else:
                kind = "logprob" if label in ("logprob", "entropy") else "gradient"
                assert_close(got, want, kind, torch.bfloat16, f"{name}: {label}")


def test_no_grad_forward_saves_nothing(seed, device, route):
    shape = shapes(device)[0]
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    h, w, b = leaves(hidden, weight, bias)
    with_grad, _ = linear_logprob_triton(h, w, targets, b, 0.7, -100, False, None)
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        lp, ent = linear_logprob_triton(h, w, targets, b, 0.7, -100, False, None)
    assert ent is None and lp.grad_fn is None and not lp.requires_grad
    assert torch.equal(lp, with_grad.detach())


def test_triton_backend_refuses_what_it_cannot_run():
    hidden = torch.randn(3, 8, dtype=torch.float64)
    weight = torch.randn(10, 8, dtype=torch.float64)
    reason = dispatch.unavailable_reason("linear_logprob", "triton", torch.device("cuda"), hidden, weight, torch.zeros(3, dtype=torch.long), None, 1.0, -100, False, None)
    assert reason is not None and "fp64" in reason
    reason = dispatch.unavailable_reason("linear_logprob", "triton", torch.device("cuda"), hidden.float(), weight.float(), torch.zeros(3, dtype=torch.long), None, 1.0, -100, False, object())
    assert reason is not None and "tp_group" in reason


# ------------------------------------------------------------------------- fused_linear_policy_loss


def loss_oracle(hidden, weight, bias, targets, old, adv, mask, ref, rw, temperature, knobs):
    """fp64: the log-probs and entropies of the linear_oracle fed to the reference loss formula."""
    h, w, b = leaves(hidden.double(), weight.double(), None if bias is None else bias.double())
    s, t, d = hidden.shape
    lp, ent = linear_oracle(h.reshape(-1, d), w, b, targets.reshape(-1), temperature)
    scored = targets != -100
    mask = mask & scored if mask.dtype == torch.bool else mask.double() * scored
    settings = LossSettings(**{**knobs, "kl_type": KL_TYPES[knobs["kl_type"]]})
    loss, metrics = reference_loss.policy_loss(
        lp.view(s, t), old.double(), adv.double(), mask, ref.double(), ent.view(s, t), None if rw is None else rw.double(), settings
    )
    grads = torch.autograd.grad(loss, [x for x in (h, w, b) if x is not None])
    return loss, metrics, grads


@pytest.mark.parametrize(
    "mode,float_mask,with_rw,kl_type",
    [("token-mean", False, False, "low_var_kl"), ("seq-mean-token-mean", True, True, "k1"), ("seq-mean-token-sum-norm", False, True, "k3+")],
)
def test_fused_linear_policy_loss_matches_fp64(seed, device, route, tune, mode, float_mask, with_rw, kl_type):
    shape = shapes(device)[0]
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
    knobs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, kl_type=kl_type, kl_coef=0.05, entropy_coef=0.01, loss_agg_mode=mode)
    h, w, b = leaves(hidden, weight, bias)
    loss, metrics = rk.fused_linear_policy_loss(
        h, w, targets, old, adv, mask, bias=b, temperature=0.7, ref_logprob=ref, rollout_is_weights=rw, backend="triton", **knobs
    )
    upstream_scale = 1.5
    grads = torch.autograd.grad(loss * upstream_scale, (h, w, b))
    want_loss, want_metrics, want_grads = loss_oracle(hidden, weight, bias, targets, old, adv, mask, ref, rw, 0.7, knobs)
    assert_close(loss, want_loss, "reduction", torch.bfloat16, "loss")
    for name in want_metrics:
        assert_close(metrics[name], want_metrics[name], "reduction", torch.bfloat16, name)
    for name, got, ref_grad in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert got.dtype == torch.bfloat16
        assert_close(got, ref_grad * upstream_scale, "gradient", torch.bfloat16, f"d{name}")


def test_fused_loss_no_grad_and_determinism(seed, device, route):
    shape = shapes(device)[0]
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
        loss_ng, _ = rk.fused_linear_policy_loss(hidden, weight, targets, old, adv, mask, entropy_coef=0.01, backend="triton")
    assert loss_ng.grad_fn is None
    assert_close(loss_ng, runs[0][0], "reduction", torch.float32, "no-grad loss")


def test_fused_loss_second_backward_is_refused(seed, device):
    """The gradient formed in the forward goes to one backward; a second through the same graph raises."""
    shape = shapes(device)[0]
    hidden, weight, _, targets = make_inputs(device, 8, shape["d"], shape["v"], torch.float32, bias=False)
    h, w = leaves(hidden.view(2, 4, -1), weight)
    old, adv, mask = torch.randn(2, 4, device=device) - 4.0, torch.randn(2, 4, device=device), torch.ones(2, 4, dtype=torch.bool, device=device)
    loss, _ = rk.fused_linear_policy_loss(h, w, targets.view(2, 4), old, adv, mask, backend="triton")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


def test_custom_ops_pass_opcheck(seed, device):
    """Schemas, fakes and autograd registrations of the linear ops agree with the kernels."""
    import rl_kernel_core.triton.fused_linear_policy_loss  # noqa: F401  (defines the op)

    shape = shapes(device)[0]
    hidden, weight, bias, targets = make_inputs(device, 12, shape["d"], 96, torch.float32)
    ops = torch.ops.rl_kernel
    key = linear_chunks.tuning_key()
    torch.library.opcheck(ops.triton_linear_logprob, (hidden.requires_grad_(), weight.requires_grad_(), bias, targets, 0.9, -100, True, None, key))
    s, t = 3, 4
    old, adv = torch.randn(s, t, device=device) - 4.0, torch.randn(s, t, device=device)
    mask = torch.rand(s, t, device=device) < 0.8
    torch.library.opcheck(
        ops.triton_fused_linear_policy_loss,
        (hidden.detach().view(s, t, -1).requires_grad_(), weight.detach().requires_grad_(), None, targets.view(s, t), old, adv,
         mask, old, None, 0.9, -100, 0.2, 0.28, 3.0, "k3", 0.05, 0.01, "token-mean", True, True, False),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_compiled_linear_ops_match_eager(seed, device, route):
    """``linear_logprob`` and ``fused_linear_policy_loss`` under torch.compile(fullgraph=True): the
    custom ops with their fakes and backwards, the same values and gradients as eager, bit for bit."""
    shape = shapes(device)[0]
    s, t = 2, 6
    hidden, weight, bias, targets = make_inputs(device, s * t, shape["d"], shape["v"], torch.bfloat16)
    hidden, targets = hidden.view(s, t, -1), targets.view(s, t)
    old, adv = torch.randn(s, t, device=device) - 4.0, torch.randn(s, t, device=device)
    mask = torch.rand(s, t, device=device) < 0.9

    def step(h, w, b):
        lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=0.8, return_entropy=True, backend="triton")
        loss, metrics = rk.fused_linear_policy_loss(h, w, targets, old, adv, mask, bias=b, temperature=0.8,
                                                    kl_coef=0.05, entropy_coef=0.01, backend="triton")
        return loss, lp, ent, metrics["pg_loss"]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
    g_lp, g_ent = upstream(s * t, device).float().view(s, t), upstream(s * t, device).float().view(s, t)
    results = []
    for fn in (step, compiled):
        inputs = leaves(hidden, weight, bias)
        loss, lp, ent, pg = fn(*inputs)
        total = 1.5 * loss + (lp * g_lp).sum() + (ent * g_ent).sum()  # eager in both cases
        results.append((loss.detach(), lp.detach(), ent.detach(), pg, *torch.autograd.grad(total, inputs)))
    for label, a, b in zip(("loss", "logprob", "entropy", "pg_loss", "dhidden", "dweight", "dbias"), *results):
        assert torch.equal(a, b), label


# ------------------------------------------------------------------------- tuning and accumulation paths


def test_fp32_weight_gradient_accumulation(seed, device, route, tune):
    """``wgrad_fp32``: dW accumulated over chunks in fp32, rounded once; within the contract of
    fp64, in the weight's dtype; dh and the forward are untouched by it (bitwise)."""
    shape = shapes(device)[0]
    small_chunks(tune, 16 if device.type == "cpu" else 512, shape["v"])
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
    lp, ent, (dh, dw, db) = run(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    tune(wgrad_fp32=True)
    lp32, ent32, (dh32, dw32, db32) = run(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    assert torch.equal(lp32, lp) and torch.equal(ent32, ent) and torch.equal(dh32, dh) and torch.equal(db32, db)
    assert dw32.dtype == torch.bfloat16
    want = linear_oracle_grads(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    assert_close(dw32, want[1], "gradient", torch.bfloat16, "dweight (fp32 accumulation)")


def test_tuning_is_scoped_validated_and_read_from_the_environment(monkeypatch):
    from rl_kernel_core import linear_chunks

    base = linear_chunks.tuning()
    with linear_chunks.tuned(route="chunked", chunk_bytes=1 << 20) as inner:
        assert linear_chunks.tuning() is inner and inner.route == "chunked" and inner.chunk_bytes == 1 << 20
    assert linear_chunks.tuning() is base
    with pytest.raises(ValueError, match="route must be 'gemm' or 'chunked', got 'fast'"):
        linear_chunks.LinearTuning(route="fast")
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int, got 0"):
        linear_chunks.LinearTuning(chunk_bytes=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.route = "chunked"  # type: ignore[misc]  # the refusal under test
    monkeypatch.setattr(linear_chunks, "_default", None)
    monkeypatch.setenv("RL_KERNEL_WGRAD_FP32", "yes")
    assert linear_chunks.tuning().wgrad_fp32 is True
    monkeypatch.setattr(linear_chunks, "_default", None)
    monkeypatch.setenv("RL_KERNEL_WGRAD_FP32", "ture")
    with pytest.raises(ValueError, match="RL_KERNEL_WGRAD_FP32"):
        linear_chunks.tuning()


@pytest.mark.gpu
def test_weight_gradient_without_fused_fp32_addmm(seed, monkeypatch, tune):
    """A torch without ``addmm(out_dtype=)``: dW is accumulated from fp32 products over row slices, within the contract."""
    from rl_kernel_core import linear_chunks

    device = torch.device("cuda")
    shape = GPU_SHAPES[0]
    tune(route="chunked", wgrad_fp32=True)
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
    monkeypatch.setitem(linear_chunks._DTYPE_MM_OK, "addmm", False)
    _, _, (dh, dw, db) = run(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    want = linear_oracle_grads(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    assert_close(dw, want[1], "gradient", torch.bfloat16, "dweight (row-slice fp32 products)")


def test_backward_on_another_thread_keeps_the_forward_tuning(seed, device, tune):
    """Autograd may run a backward on a worker thread (it does for CUDA tensors), where a
    ``tuned`` block of the caller is not in force: the backward still takes the forward's route
    and chunking, so its gradient has the bits of a same-thread backward."""
    import threading

    shape = shapes(device)[0]
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.float32)
    g_lp = upstream(shape["n"], device).float()
    tune(route="chunked", chunk_bytes=16 * shape["v"] * 4)
    grads = []
    for other_thread in (False, True):
        h, w, b = leaves(hidden, weight, bias)
        lp = rk.linear_logprob(h, w, targets, bias=b, backend="triton")

        def backward():
            grads.append(torch.autograd.grad((lp * g_lp).sum(), (h, w, b)))

        if other_thread:
            worker = threading.Thread(target=backward)
            worker.start()
            worker.join()
        else:
            backward()
    for label, a, b in zip(("dhidden", "dweight", "dbias"), *grads):
        assert torch.equal(a, b), label


@pytest.mark.gpu
def test_chunked_route_without_fp32_mm_runs_the_gemm_route(seed, monkeypatch, tune):
    """A torch whose cuBLAS mm cannot write fp32 logits from 16-bit operands: the chunked route
    runs the gemm route for every pass, with the gemm route's bits."""
    from rl_kernel_core import linear_chunks

    device = torch.device("cuda")
    shape = GPU_SHAPES[0]
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
    tune(route="gemm")
    want = run(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    tune(route="chunked")
    monkeypatch.setitem(linear_chunks._DTYPE_MM_OK, "mm", False)
    assert linear_chunks.tuning().route_for(hidden) == "gemm"
    got = run(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
