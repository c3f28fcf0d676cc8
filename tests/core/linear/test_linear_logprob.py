"""linear_logprob: the reference, the Triton kernels on both routes, and the shared GPU cases.

* The reference (``torch``) on CPU against fp64 ``log_softmax`` of the upcast inputs (no chunking,
  no shift tricks), gradients by fp64 autograd and ``gradcheck``, chunk boundaries, bad input.
* Triton on CPU under the interpreter (``TRITON_INTERPRET=1`` set per test: the kernels pick
  interpreted or compiled execution at launch time) with small odd shapes, and on CUDA (``gpu``
  marker) with realistic ones. Both kernel routes (``gemm``: ``tl.dot`` tiles in registers;
  ``chunked``: an fp32 logits chunk from cuBLAS) run where the case depends on them.
* Triton and native on CUDA (``gpu``, ``op_backends.on_backends``): values, entropy and gradients at
  the real heads' shapes (N prime, D not a multiple of 64, V odd or a Qwen2 / Llama-3 head) with
  several chunks and a zero-padded last chunk, fp16, logits of magnitude 100, determinism and
  batch invariance bitwise.

Vocab-parallel runs are in test_linear_logprob_tp.py. Tolerances come from
``rl_kernel_core.contract``; invariances are asserted bitwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_core.contract import assert_close
from rl_kernel_core.logprob import reference as reference  # CHUNK_ELEMENTS: the row chunk both log-prob references take
from rl_kernel_core.linear import chunks as linear_chunks
from rl_kernel_core.linear import triton_tile
from rl_kernel_core.linear.triton import linear_logprob as linear_logprob_triton
from op_backends import Backend, on_backends
from oracles import (
    LINEAR_GPU_SHAPES,
    leaves,
    linear_oracle,
    linear_oracle_grads,
    linear_shapes,
    make_inputs,
    run_linear,
    small_chunks,
    upstream,
)
from peak_memory import measure_peak, skip_without_proc

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TILE_VARIANTS = {  # the gemm route's loads and launch: pointer or TMA loads, one program per tile or persistent
    "pointer": dict(tma=False, persistent=False),
    "tma": dict(tma=True, persistent=False),
    "tma_persistent": dict(tma=True, persistent=True),
    "pointer_persistent": dict(tma=False, persistent=True),
}


# ------------------------------------------------------------------------- Triton (interpreter on CPU, compiled on CUDA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,with_bias", [(1.0, False), (0.7, True)])
def test_values_and_gradients_match_fp64(seed, device, route, tune, dtype, temperature, with_bias):
    for shape in linear_shapes(device, all_gpu_shapes=with_bias):
        small_chunks(tune, 16 if device.type == "cpu" else 512, shape["v"])
        hidden, weight, bias, targets = make_inputs(device, **shape, dtype=dtype, bias=with_bias)
        g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
        lp, ent, grads = run_linear(hidden, weight, bias, targets, temperature, g_lp, g_ent)
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
    shape = linear_shapes(device)[0]
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
    shape = linear_shapes(device)[0]
    # D >= 256: the logits' magnitude is spread over many products, as in a model, so that the
    # bf16 rounding of the logit gradient (times |W| or |h|) stays what it is in practice
    n, d, v = shape["n"], max(256, shape["d"]), shape["v"]
    hidden, weight, _, targets = make_inputs(device, n, d, v, torch.bfloat16, bias=False, scale=33.0)
    if case == "equal":
        weight = (torch.randn(1, d, device=device) * (3.0 / d**0.5)).to(torch.bfloat16).expand(v, d).contiguous()
    g_lp, g_ent = upstream(n, device), upstream(n, device)
    lp, ent, grads = run_linear(hidden, weight, None, targets, 1.0, g_lp, g_ent)
    ref_lp, ref_ent = linear_oracle(hidden, weight, None, targets, 1.0)
    if case == "large":
        logits = hidden.double() @ weight.double().T
        assert logits.abs().max() > 100
    else:
        kept = targets != -100
        assert torch.allclose(ref_lp[kept], torch.full_like(ref_lp[kept], -torch.log(torch.tensor(float(v))).item()))
    assert_close(lp, ref_lp, "logprob", torch.bfloat16, "logprob")
    assert_close(ent, ref_ent, "logprob", torch.bfloat16, "entropy")
    for name, got, ref in zip(
        ("hidden", "weight"), grads, linear_oracle_grads(hidden, weight, None, targets, 1.0, g_lp, g_ent)
    ):
        assert_close(got, ref, "gradient", torch.bfloat16, f"d{name}")


def test_noncontiguous_inputs_same_bits(seed, device, route):
    """Strided views give the same bits as contiguous copies: the backend copies them to the one
    layout its kernels are specialized for (a strided load changes Triton's register layout and so
    a reduction's order; a column-major weight changes cuBLAS's kernel on the chunked route)."""
    shape = linear_shapes(device)[0]
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
    shape = linear_shapes(device)[0]
    rows = 16 if device.type == "cpu" else 512
    small_chunks(tune, rows, shape["v"])
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
    full = run_linear(hidden, weight, bias, targets, 0.8, g_lp, g_ent)
    again = run_linear(hidden, weight, bias, targets, 0.8, g_lp, g_ent)
    for a, b in zip(full[:2] + tuple(full[2]), again[:2] + tuple(again[2])):
        assert torch.equal(a, b)
    # the first rows alone, with other rows after them, and a single row
    other = make_inputs(device, **shape, dtype=torch.bfloat16)
    for m in (1, rows + 3):
        m = min(m, shape["n"] - 1)
        h2 = torch.cat([hidden[:m], other[0][: shape["n"] - m]])
        t2 = torch.cat([targets[:m], other[3][: shape["n"] - m]])
        for take in (m, shape["n"]):
            part = run_linear(h2[:take], weight, bias, t2[:take], 0.8, g_lp[:take], g_ent[:take])
            assert torch.equal(part[0][:m], full[0][:m]), f"logprob rows, N={take}"
            assert torch.equal(part[1][:m], full[1][:m]), f"entropy rows, N={take}"
            assert torch.equal(part[2][0][:m], full[2][0][:m]), f"dhidden rows, N={take}"


def test_tile_variants_agree(seed, device, tune):
    """Pointer or TMA loads, one program per tile or a persistent walk: the same tiles and the same
    K order, so the same bits under the interpreter; on a GPU within the contract of each other
    (the default variant is the one the other GPU tests check against fp64)."""
    shape = linear_shapes(device)[0]
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
    outs = {}
    for name, fields in TILE_VARIANTS.items():
        tiles = dataclasses.replace(triton_tile.linear().gemm_tiles, **fields)
        grad_tiles = dataclasses.replace(triton_tile.linear().gemm_grad_tiles, **fields)
        with linear_chunks.tuned(route="gemm", gemm_tiles=tiles, gemm_grad_tiles=grad_tiles):
            lp, ent, grads = run_linear(hidden, weight, bias, targets, 0.8, g_lp, g_ent)
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
    shape = linear_shapes(device)[0]
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    h, w, b = leaves(hidden, weight, bias)
    with_grad, _ = linear_logprob_triton(h, w, targets, b, 0.7, -100, False, None)
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        lp, ent = linear_logprob_triton(h, w, targets, b, 0.7, -100, False, None)
    assert ent is None and lp.grad_fn is None and not lp.requires_grad
    assert torch.equal(lp, with_grad.detach())


def test_explain_names_the_route_that_ran(seed, device):
    """``explain`` says what ran: the Triton kernels under the interpreter (CPU), a route of the
    Triton backend's on a GPU (the Hopper passes' own check is in test_linear_sm90.py), the
    reference for ``backend="torch"``."""
    shape = linear_shapes(device)[0]
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    with torch.no_grad():
        rk.linear_logprob(hidden, weight, targets, bias=bias, backend="triton")
        decision = dispatch.explain("linear_logprob")
        assert decision.backend == "triton" and decision.route in ("triton", "triton+sm90")
        if device.type == "cpu":
            assert decision.route == "triton"
        rk.linear_logprob(hidden, weight, targets, bias=bias, backend="torch")
        assert dispatch.explain("linear_logprob").route == "torch"


def test_triton_backend_refuses_what_it_cannot_run():
    hidden = torch.randn(3, 8, dtype=torch.float64)
    weight = torch.randn(10, 8, dtype=torch.float64)
    reason = dispatch.unavailable_reason(
        "linear_logprob",
        "triton",
        torch.device("cuda"),
        hidden,
        weight,
        torch.zeros(3, dtype=torch.long),
        None,
        1.0,
        -100,
        False,
        None,
    )
    assert reason is not None and "fp64" in reason
    reason = dispatch.unavailable_reason(
        "linear_logprob",
        "triton",
        torch.device("cuda"),
        hidden.float(),
        weight.float(),
        torch.zeros(3, dtype=torch.long),
        None,
        1.0,
        -100,
        False,
        object(),
    )
    assert reason is not None and "tp_group" in reason


def test_custom_op_passes_opcheck(seed, device):
    """The schema, fake and autograd registration of the Triton linear_logprob agree with the kernels."""
    shape = linear_shapes(device)[0]
    hidden, weight, bias, targets = make_inputs(device, 12, shape["d"], 96, torch.float32)
    ops = torch.ops.rl_kernel
    key = linear_chunks.tuning_key()
    torch.library.opcheck(
        ops.triton_linear_logprob,
        (hidden.requires_grad_(), weight.requires_grad_(), bias, targets, 0.9, -100, True, None, key),
    )


def test_compiled_linear_ops_match_eager(seed, device, route):
    """``linear_logprob`` and ``fused_linear_policy_loss`` under torch.compile(fullgraph=True): the
    custom ops with their fakes and backwards, the same values and gradients as eager, bit for bit."""
    shape = linear_shapes(device)[0]
    s, t = 2, 6
    hidden, weight, bias, targets = make_inputs(device, s * t, shape["d"], shape["v"], torch.bfloat16)
    hidden, targets = hidden.view(s, t, -1), targets.view(s, t)
    old, adv = torch.randn(s, t, device=device) - 4.0, torch.randn(s, t, device=device)
    mask = torch.rand(s, t, device=device) < 0.9

    def step(h, w, b):
        lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=0.8, return_entropy=True, backend="triton")
        loss, metrics = rk.fused_linear_policy_loss(
            h, w, targets, old, adv, mask, bias=b, temperature=0.8, kl_coef=0.05, entropy_coef=0.01, backend="triton"
        )
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


# ------------------------------------------------------------------------- Triton: tuning and accumulation paths


@pytest.mark.parametrize("wgrad_fp32", [False, True])
def test_grad_sink_writes_dw_with_the_first_chunk(wgrad_fp32):
    """``dW`` starts as uninitialised memory: the first chunk's product overwrites it, later chunks
    add to it, and a sink that saw no rows hands back zeros."""
    hidden, weight = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(10, 8, dtype=torch.bfloat16)
    dl = torch.randn(6, 10, dtype=torch.bfloat16)
    with linear_chunks.tuned(wgrad_fp32=wgrad_fp32):
        empty = linear_chunks.GradSink(hidden, weight, False, True, False)
        assert empty.dw is not None
        empty.dw.fill_(float("nan"))
        no_rows = empty.grads()[1]
        assert no_rows is not None and torch.equal(no_rows, torch.zeros_like(weight))
        sink = linear_chunks.GradSink(hidden, weight, False, True, False)
        assert sink.dw is not None
        sink.dw.fill_(float("nan"))
        sink.add(dl[:4], 0, 4)
        sink.add(dl[4:], 4, 2)
    dw = sink.grads()[1]
    assert dw is not None
    assert_close(dw, dl.double().t() @ hidden.double(), "gradient", torch.bfloat16, "dW")


def test_fp32_weight_gradient_accumulation(seed, device, route, tune):
    """``wgrad_fp32``: dW accumulated over chunks in fp32, rounded once; within the contract of
    fp64, in the weight's dtype; dh and the forward are untouched by it (bitwise)."""
    shape = linear_shapes(device)[0]
    small_chunks(tune, 16 if device.type == "cpu" else 512, shape["v"])
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
    lp, ent, (dh, dw, db) = run_linear(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    tune(wgrad_fp32=True)
    lp32, ent32, (dh32, dw32, db32) = run_linear(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    assert torch.equal(lp32, lp) and torch.equal(ent32, ent) and torch.equal(dh32, dh) and torch.equal(db32, db)
    assert dw32.dtype == torch.bfloat16
    want = linear_oracle_grads(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    assert_close(dw32, want[1], "gradient", torch.bfloat16, "dweight (fp32 accumulation)")


def test_tuning_is_scoped_validated_and_read_from_the_environment(monkeypatch):
    from rl_kernel_core.linear import chunks as linear_chunks

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
    from rl_kernel_core.linear import chunks as linear_chunks

    device = torch.device("cuda")
    shape = LINEAR_GPU_SHAPES[0]
    tune(route="chunked", wgrad_fp32=True)
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
    monkeypatch.setitem(linear_chunks._DTYPE_MM_OK, "addmm", False)
    _, _, (dh, dw, db) = run_linear(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    want = linear_oracle_grads(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    assert_close(dw, want[1], "gradient", torch.bfloat16, "dweight (row-slice fp32 products)")


def test_backward_on_another_thread_keeps_the_forward_tuning(seed, device, tune):
    """Autograd may run a backward on a worker thread (it does for CUDA tensors), where a
    ``tuned`` block of the caller is not in force: the backward still takes the forward's route
    and chunking, so its gradient has the bits of a same-thread backward."""
    import threading

    shape = linear_shapes(device)[0]
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
    from rl_kernel_core.linear import chunks as linear_chunks

    device = torch.device("cuda")
    shape = LINEAR_GPU_SHAPES[0]
    hidden, weight, bias, targets = make_inputs(device, **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(shape["n"], device), upstream(shape["n"], device)
    tune(route="gemm")
    want = run_linear(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    tune(route="chunked")
    monkeypatch.setitem(linear_chunks._DTYPE_MM_OK, "mm", False)
    assert linear_chunks.tuning().route_for(hidden) == "gemm"
    got = run_linear(hidden, weight, bias, targets, 0.9, g_lp, g_ent)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))


# ------------------------------------------------------------------------- shared GPU cases: Triton and native at the heads' shapes

# N prime, D not a multiple of 64; V odd (not a multiple of the 4-wide fp32 groups: the
# element-wise path) and the Qwen2 / Llama-3 heads (vector path)
HEAD_SHAPES = [dict(n=1031, d=896, v=32003), dict(n=257, d=896, v=151936), dict(n=131, d=4096, v=128256)]
HEAD_CHUNK_ROWS = 256  # several chunks and a zero-padded last chunk at every shape
on_gpu_backends = on_backends("linear_logprob", exclude=("torch", "triton-interpret"))


@on_gpu_backends
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=lambda s: f"n{s['n']}-d{s['d']}-v{s['v']}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,with_bias", [(1.0, False), (0.7, True)])
def test_heads_values_entropy_and_gradients(seed, backend: Backend, tune, shape, dtype, temperature, with_bias):
    small_chunks(tune, HEAD_CHUNK_ROWS, shape["v"])
    hidden, weight, bias, targets = make_inputs("cuda", **shape, dtype=dtype, bias=with_bias)
    g_lp, g_ent = upstream(shape["n"], "cuda"), upstream(shape["n"], "cuda")
    lp, ent, grads = run_linear(hidden, weight, bias, targets, temperature, g_lp, g_ent, backend=backend.name)
    assert dispatch.explain("linear_logprob").backend == backend.name
    ref_lp, ref_ent = linear_oracle(hidden, weight, bias, targets, temperature)
    assert lp.dtype == ent.dtype == torch.float32
    assert_close(lp, ref_lp, "logprob", dtype, f"logprob {shape}")
    assert_close(ent, ref_ent, "logprob", dtype, f"entropy {shape}")
    ignored = targets == -100
    assert ignored.any() and torch.all(lp[ignored] == 0) and torch.all(ent[ignored] == 0)
    want = linear_oracle_grads(hidden, weight, bias, targets, temperature, g_lp, g_ent)
    assert len(grads) == len(want)
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, want):
        assert got.dtype == dtype
        assert_close(got, ref, "gradient", dtype, f"d{name} {shape}")
    assert torch.all(grads[0][ignored] == 0)


@on_gpu_backends
def test_heads_fp16_int32_targets_logprob_only_gradient(seed, backend: Backend, tune):
    shape = HEAD_SHAPES[0]
    small_chunks(tune, HEAD_CHUNK_ROWS, shape["v"])
    hidden, weight, bias, targets = make_inputs("cuda", **shape, dtype=torch.float16)
    g_lp = upstream(shape["n"], "cuda")
    h, w, b = leaves(hidden, weight, bias)
    lp = rk.linear_logprob(h, w, targets.to(torch.int32), bias=b, temperature=0.7, backend=backend.name)
    grads = torch.autograd.grad((lp * g_lp.float()).sum(), (h, w, b))
    assert_close(lp, linear_oracle(hidden, weight, bias, targets, 0.7)[0], "logprob", torch.float16, "logprob")
    want = linear_oracle_grads(hidden, weight, bias, targets, 0.7, g_lp, torch.zeros_like(g_lp))
    for name, got, ref in zip(("hidden", "weight", "bias"), grads, want):
        assert_close(got, ref, "gradient", torch.float16, f"d{name}")


@on_gpu_backends
def test_heads_large_magnitude_logits(seed, backend: Backend):
    n, d, v = 257, 896, 32003
    hidden, weight, _, targets = make_inputs("cuda", n, d, v, torch.bfloat16, bias=False, scale=33.0)
    assert (hidden.double() @ weight.double().T).abs().max() > 100
    g_lp, g_ent = upstream(n, "cuda"), upstream(n, "cuda")
    lp, ent, grads = run_linear(hidden, weight, None, targets, 1.0, g_lp, g_ent, backend=backend.name)
    ref_lp, ref_ent = linear_oracle(hidden, weight, None, targets, 1.0)
    assert_close(lp, ref_lp, "logprob", torch.bfloat16, "logprob")
    assert_close(ent, ref_ent, "logprob", torch.bfloat16, "entropy")
    want = linear_oracle_grads(hidden, weight, None, targets, 1.0, g_lp, g_ent)
    for name, got, ref in zip(("hidden", "weight"), grads, want):
        assert_close(got, ref, "gradient", torch.bfloat16, f"d{name}")


@on_gpu_backends
@pytest.mark.parametrize("shape", HEAD_SHAPES[:2], ids=lambda s: f"v{s['v']}")
def test_heads_deterministic_and_batch_invariant(seed, backend: Backend, tune, shape):
    """Bitwise: two runs agree, and a row's log-prob, entropy and dh do not depend on N or on the other rows."""
    rows = HEAD_CHUNK_ROWS
    small_chunks(tune, rows, shape["v"])
    n = shape["n"]
    hidden, weight, bias, targets = make_inputs("cuda", **shape, dtype=torch.bfloat16)
    g_lp, g_ent = upstream(n, "cuda"), upstream(n, "cuda")
    full = run_linear(hidden, weight, bias, targets, 0.8, g_lp, g_ent, backend=backend.name)
    again = run_linear(hidden, weight, bias, targets, 0.8, g_lp, g_ent, backend=backend.name)
    for a, b in zip(full[:2] + tuple(full[2]), again[:2] + tuple(again[2])):
        assert torch.equal(a, b)
    other = make_inputs("cuda", **shape, dtype=torch.bfloat16)
    for m in (1, min(rows + 3, n - 1)):  # m rows kept, the other n - m replaced
        h2 = torch.cat([hidden[:m], other[0][: n - m]])
        t2 = torch.cat([targets[:m], other[3][: n - m]])
        for take in (m, n):
            part = run_linear(h2[:take], weight, bias, t2[:take], 0.8, g_lp[:take], g_ent[:take], backend=backend.name)
            assert torch.equal(part[0][:m], full[0][:m]), f"logprob rows, N={take}"
            assert torch.equal(part[1][:m], full[1][:m]), f"entropy rows, N={take}"
            assert torch.equal(part[2][0][:m], full[2][0][:m]), f"dhidden rows, N={take}"
    with torch.no_grad():  # the forward-only path gives the same bits
        lp, ent = rk.linear_logprob(
            hidden, weight, targets, bias=bias, temperature=0.8, return_entropy=True, backend=backend.name
        )
    assert torch.equal(lp, full[0]) and torch.equal(ent, full[1])


# ------------------------------------------------------------------------- native (cuBLAS chunk + CUDA pass)


@pytest.mark.gpu
def test_native_no_grad_saves_nothing_and_refusals(seed):
    from rl_kernel_core.linear import native as native_linear

    shape = HEAD_SHAPES[0]
    hidden, weight, bias, targets = make_inputs("cuda", **shape, dtype=torch.bfloat16)
    h, w, b = leaves(hidden, weight, bias)
    with torch.no_grad():
        lp, ent = native_linear.linear_logprob(h, w, targets, b, 0.7, -100, False, None)
    assert ent is None and lp.grad_fn is None and not lp.requires_grad
    with_grad, _ = native_linear.linear_logprob(h, w, targets, b, 0.7, -100, False, None)
    assert with_grad.grad_fn is not None and torch.equal(lp, with_grad.detach())
    with pytest.raises(rk.BackendUnavailableError, match="hidden is float64"):
        rk.linear_logprob(hidden.double(), weight.double(), targets, backend="native")
    reason = native_linear._supports(hidden, weight, targets, None, 1.0, -100, False, object())
    assert reason is not None and "tp_group" in reason
    # no measurement of the native linear_logprob yet: auto runs triton
    rk.linear_logprob(hidden, weight, targets)
    assert dispatch.explain("linear_logprob").backend == "triton"


# ------------------------------------------------------------------------- the reference (torch) on CPU


def reference_inputs(lead=(3, 7), d=32, v=200, dtype=torch.float32, ignore_index=-100, bias=True):
    """Random hidden/weight/bias/targets (logit std about 3); about a fifth of rows ignored."""
    hidden = torch.randn(*lead, d).to(dtype)
    weight = (torch.randn(v, d) * (3.0 / d**0.5)).to(dtype)
    b = torch.randn(v).to(dtype) if bias else None
    targets = torch.randint(0, v, lead)
    if targets.numel() >= 2:
        flat = targets.view(-1)
        drop = torch.rand(flat.shape) < 0.2
        drop[0], drop[1] = True, False  # at least one ignored and one kept row
        flat[drop] = ignore_index
    return hidden, weight, b, targets


@pytest.mark.parametrize("dtype", INPUT_DTYPES)
@pytest.mark.parametrize("temperature,with_bias", [(1.0, False), (0.7, True)])
def test_linear_logprob_matches_fp64_formula(seed, dtype, temperature, with_bias):
    hidden, weight, bias, targets = reference_inputs(dtype=dtype, bias=with_bias)
    lp, ent = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=temperature, return_entropy=True)
    ref_lp, ref_ent = linear_oracle(hidden, weight, bias, targets, temperature, -100)
    assert lp.dtype == ent.dtype == torch.float32
    assert lp.shape == ent.shape == targets.shape
    assert_close(lp, ref_lp, "logprob", dtype, "logprob")
    assert_close(ent, ref_ent, "logprob", dtype, "entropy")
    ignored = targets == -100
    assert torch.all(lp[ignored] == 0) and torch.all(ent[ignored] == 0)
    assert torch.all(lp[~ignored] < 0)
    lp_only = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=temperature)
    assert torch.equal(lp_only, lp)


def test_linear_logprob_fp64_in_fp64_out(seed):
    hidden, weight, bias, targets = reference_inputs(dtype=torch.float64)
    lp, ent = rk.linear_logprob(hidden, weight, targets, bias=bias, temperature=1.3, return_entropy=True)
    ref_lp, ref_ent = linear_oracle(hidden, weight, bias, targets, 1.3, -100)
    assert lp.dtype == ent.dtype == torch.float64
    assert_close(lp, ref_lp, "logprob", torch.float64, "logprob")
    assert_close(ent, ref_ent, "logprob", torch.float64, "entropy")


def test_custom_ignore_index_and_int32_targets(seed):
    hidden, weight, bias, targets = reference_inputs(ignore_index=7)
    lp64 = rk.linear_logprob(hidden, weight, targets, bias=bias, ignore_index=7)
    lp32 = rk.linear_logprob(hidden, weight, targets.int(), bias=bias, ignore_index=7)
    assert torch.equal(lp64, lp32)
    assert_close(lp64, linear_oracle(hidden, weight, bias, targets, 1.0, 7)[0], "logprob", torch.float32, "logprob")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_boundaries(seed, monkeypatch, dtype):
    """N not a multiple of the chunk, and a chunk smaller than one row: same contract."""
    hidden, weight, bias, targets = reference_inputs(lead=(2, 11), v=50, dtype=dtype)
    ref_lp, ref_ent = linear_oracle(hidden, weight, bias, targets, 0.7, -100)
    g_lp, g_ent = upstream(targets.shape, "cpu"), upstream(targets.shape, "cpu")
    for chunk in (50 * 4, 50 * 7, 3):  # 4 rows (22 = 5*4+2), 7 rows, and max(1, 3 // 50) = 1 row
        monkeypatch.setattr(reference, "CHUNK_ELEMENTS", chunk)
        h, w, b = leaves(hidden, weight, bias)
        lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=0.7, return_entropy=True, backend="torch")
        assert_close(lp, ref_lp, "logprob", dtype, f"logprob chunk={chunk}")
        assert_close(ent, ref_ent, "logprob", dtype, f"entropy chunk={chunk}")
        grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w, b))
        for name, got, want in zip(
            ("hidden", "weight", "bias"), grads, linear_oracle_grads(hidden, weight, bias, targets, 0.7, g_lp, g_ent)
        ):
            assert_close(got, want, "gradient", dtype, f"d{name} chunk={chunk}")


def test_noncontiguous_inputs_give_identical_results(seed):
    hidden, weight, bias, targets = reference_inputs(lead=(4, 9), d=24, v=64)
    # hidden as a [B, T, D] view of a [T, B, 2D] buffer (strided in every dim), targets transposed.
    hid_buf = torch.randn(9, 4, 48)
    hid_buf[:, :, ::2] = hidden.transpose(0, 1)
    hidden_nc = hid_buf[:, :, ::2].transpose(0, 1)
    targets_nc = targets.T.contiguous().T
    weight_nc = weight.T.contiguous().T
    assert not (hidden_nc.is_contiguous() or targets_nc.is_contiguous() or weight_nc.is_contiguous())
    g = upstream(targets.shape, "cpu").float()
    results = []
    for h, w, t in ((hidden, weight, targets), (hidden_nc, weight_nc, targets_nc)):
        h, w = leaves(h, w)
        lp, ent = rk.linear_logprob(h, w, t, bias=bias, temperature=0.9, return_entropy=True)
        results.append((lp, ent, *torch.autograd.grad((lp * g).sum() + (ent * g).sum(), (h, w))))
    for name, a, b in zip(("logprob", "entropy", "dhidden", "dweight"), *results):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_linear_logprob_empty_input_returns_empty(lead):
    hidden, weight, bias, targets = reference_inputs(lead=lead)
    h, w, b = leaves(hidden, weight, bias)
    lp, ent = rk.linear_logprob(h, w, targets, bias=b, return_entropy=True)
    assert lp.shape == ent.shape == targets.shape and lp.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(h.grad, torch.zeros_like(hidden))


def test_deterministic_run_to_run(seed):
    hidden, weight, bias, targets = reference_inputs(lead=(5, 13), d=48, v=300)
    g = upstream(targets.shape, "cpu").float()
    runs = []
    for _ in range(2):
        h, w, b = leaves(hidden, weight, bias)
        lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=0.8, return_entropy=True)
        runs.append((lp, ent, *torch.autograd.grad((lp * g).sum() - (ent * g).sum(), (h, w, b))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_linear_logprob_gradients_match_fp64_autograd(seed, dtype, with_entropy):
    hidden, weight, bias, targets = reference_inputs(dtype=dtype)
    g_lp = upstream(targets.shape, "cpu")
    g_ent = upstream(targets.shape, "cpu") if with_entropy else torch.zeros_like(g_lp)
    h, w, b = leaves(hidden, weight, bias)
    lp, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=0.7, return_entropy=True)
    loss = (lp * g_lp.float()).sum() + ((ent * g_ent.float()).sum() if with_entropy else 0.0)
    loss.backward()
    for name, leaf, want in zip(
        ("hidden", "weight", "bias"), (h, w, b), linear_oracle_grads(hidden, weight, bias, targets, 0.7, g_lp, g_ent)
    ):
        assert leaf.grad.dtype == dtype, name
        assert_close(leaf.grad, want, "gradient", dtype, f"d{name}")


def test_ignored_rows_get_no_gradient(seed):
    hidden, weight, bias, targets = reference_inputs()
    (h,) = leaves(hidden)
    lp, ent = rk.linear_logprob(h, weight, targets, bias=bias, return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    ignored = targets == -100
    assert torch.all(h.grad[ignored] == 0)
    assert torch.all(h.grad[~ignored].abs().sum(-1) > 0)


def test_entropy_only_gradient(seed):
    hidden, weight, bias, targets = reference_inputs(dtype=torch.float32)
    g_ent = upstream(targets.shape, "cpu")
    h, w, b = leaves(hidden, weight, bias)
    _, ent = rk.linear_logprob(h, w, targets, bias=b, temperature=1.5, return_entropy=True)
    (ent * g_ent.float()).sum().backward()
    want = linear_oracle_grads(hidden, weight, bias, targets, 1.5, torch.zeros_like(g_ent), g_ent)
    for name, leaf, ref in zip(("hidden", "weight", "bias"), (h, w, b), want):
        assert_close(leaf.grad, ref, "gradient", torch.float32, f"d{name}")


@pytest.mark.parametrize("with_entropy", [False, True])
def test_linear_logprob_gradcheck(seed, with_entropy):
    hidden, weight, bias, targets = reference_inputs(lead=(2, 3), d=5, v=7, dtype=torch.float64)

    def fn(h, w, b):
        return rk.linear_logprob(h, w, targets, bias=b, temperature=0.7, return_entropy=with_entropy, backend="torch")

    assert torch.autograd.gradcheck(fn, tuple(leaves(hidden, weight, bias)))


@skip_without_proc
def test_linear_logprob_reference_peak_is_under_a_quarter_of_naive():
    n, v, d = 8192, 32000, 256
    naive = measure_peak("naive", n, v, d)
    ref = measure_peak("reference", n, v, d)
    logits_bytes = n * v * 4
    # The naive path must really hold its [N, V] logits, or the comparison says nothing.
    assert naive["extra"] > logits_bytes, naive
    assert ref["extra"] < naive["extra"] / 4, (ref, naive)


# ------------------------------------------------------------------------- reference: bad input and backend choice


def _call(**overrides):
    hidden, weight, bias, targets = reference_inputs(lead=(2, 3), d=8, v=10)
    kwargs = dict(hidden=hidden, weight=weight, targets=targets, bias=bias)
    kwargs.update(overrides)
    h, w, t = kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("targets")
    return rk.linear_logprob(h, w, t, **kwargs)


@pytest.mark.parametrize(
    "overrides,error,names",
    [
        (dict(hidden=[[1.0] * 8]), TypeError, "hidden"),
        (dict(weight=torch.randn(10, 8).numpy()), TypeError, "weight"),
        (dict(hidden=torch.randint(0, 5, (2, 3, 8))), TypeError, "hidden"),
        (dict(weight=torch.randn(10, 8, dtype=torch.float64)), TypeError, "weight"),
        (dict(bias=torch.randn(10, dtype=torch.float16)), TypeError, "bias"),
        (dict(targets=torch.rand(2, 3) * 5), TypeError, "targets"),
        (dict(weight=torch.randn(10, 9)), ValueError, "weight"),
        (dict(weight=torch.randn(10)), ValueError, "weight"),
        (dict(weight=torch.randn(0, 8)), ValueError, "weight"),
        (dict(targets=torch.randint(0, 10, (3, 2))), ValueError, "targets"),
        (dict(targets=torch.randint(0, 10, (6,))), ValueError, "targets"),
        (dict(targets=torch.full((2, 3), 10)), ValueError, "targets"),
        (dict(targets=torch.full((2, 3), -1)), ValueError, "targets"),
        (dict(bias=torch.randn(11)), ValueError, "bias"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature="1"), TypeError, "temperature"),
        (dict(temperature=1e-40), ValueError, r"temperature must be >= 1.1754944e-38 .*got 1e-40"),
        (dict(temperature=1e-45), ValueError, "temperature"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (
            dict(ignore_index=-(2**70)),
            ValueError,
            r"ignore_index must be in the int64 range .*got -1180591620717411303424",
        ),
        (dict(ignore_index=2**63), ValueError, "ignore_index"),
        (dict(return_entropy=1), TypeError, "return_entropy"),
        (dict(weight=torch.randn(10, 8, device="meta")), ValueError, "weight"),
        (dict(targets=torch.randint(0, 10, (2, 3), device="meta")), ValueError, "targets"),
        (dict(weight=torch.randn(10, 8).to_sparse()), TypeError, "weight must be a dense"),
        (dict(weight=torch.randn(10, 8).to_sparse_csr()), TypeError, "weight must be a dense .*sparse_csr"),
        (
            dict(
                hidden=torch.randn(2, 3, 8, device="meta"),
                weight=torch.randn(10, 8, device="meta"),
                targets=torch.zeros(2, 3, dtype=torch.long, device="meta"),
                bias=None,
            ),
            ValueError,
            "targets must hold data",
        ),
        (dict(tp_group="group"), TypeError, "tp_group"),
        (dict(backend="cuda"), ValueError, "backend"),
    ],
)
def test_linear_logprob_rejects_bad_input(overrides, error, names):
    with pytest.raises(error, match=names):
        _call(**overrides)


def test_out_of_range_message_names_range():
    with pytest.raises(ValueError, match=r"targets ids must be in \[0, 10\).*got 2 outside it, in \[-3, 12\]"):
        _call(targets=torch.tensor([[0, 12, 3], [-3, 2, -100]]))


def test_backend_torch_is_recorded(seed, monkeypatch):
    monkeypatch.delenv("RL_KERNEL_BACKEND", raising=False)
    hidden, weight, bias, targets = reference_inputs()
    auto = rk.linear_logprob(hidden, weight, targets, bias=bias, backend="auto")
    assert dispatch.explain("linear_logprob").backend == "torch"  # CPU inputs: only torch runs them
    explicit = rk.linear_logprob(hidden, weight, targets, bias=bias, backend="torch")
    decision = dispatch.explain("linear_logprob")
    assert decision.backend == "torch" and decision.requested == "torch"
    assert torch.equal(auto, explicit)
    rk.logprob_from_logits(torch.randn(4, 9), torch.randint(0, 9, (4,)), backend="torch")
    assert dispatch.explain("logprob_from_logits").backend == "torch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_native_backend_on_cpu_says_why():
    hidden, weight, bias, targets = reference_inputs()
    with pytest.raises(rk.BackendUnavailableError, match=r"linear_logprob: backend='native' cannot run: .+"):
        rk.linear_logprob(hidden, weight, targets, backend="native")
    with pytest.raises(rk.BackendUnavailableError, match=r"logprob_from_logits: backend='native' cannot run: .+"):
        rk.logprob_from_logits(torch.randn(3, 5), torch.ones(3, dtype=torch.long), backend="native")
