"""Triton batch-invariant ops (persistent matmul, row reductions) against fp64 formulas, bitwise
row invariance, gradients, and the mode's routing onto them.

Every case runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set per test; the
kernels choose interpreted or compiled execution at launch) with small odd shapes, and on CUDA
(``gpu`` marker) with model-sized ones. Invariance is asserted with ``torch.equal``; accuracy with
the contract plus one rounding to the output dtype.

Under the interpreter ``tl.dot`` is numpy's matmul, whose CPU BLAS micro-kernels treat a row
differently by its position inside the tile, so there the matmul is checked for the rows that keep
their position (the first n rows of a batch); on CUDA rows are also moved to other positions.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import contract, dispatch
from rl_kernel_core.invariance import bi_linear, bi_log_softmax, bi_matmul, bi_mean

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes

CPU_SHAPE = dict(n=45, k=40, m=70, sizes=(1, 7, 45))
GPU_SHAPE = dict(n=1031, k=1024, m=3072, sizes=(1, 7, 64, 300, 1031))


def _shape(device):
    return CPU_SHAPE if device.type == "cpu" else GPU_SHAPE


def _close_in_dtype(actual, expected, op_class, dtype, name):
    tol = contract.tolerance(op_class, dtype)
    a, e = actual.double().cpu(), expected.double().cpu()
    bound = tol.atol + (tol.rtol + torch.finfo(dtype).eps) * e.abs()
    err = (a - e).abs()
    assert bool(torch.isfinite(a).all()), f"{name}: non-finite values"
    assert bool((err <= bound).all()), f"{name}: worst error {float((err - bound).max()):.3g} above the {op_class}/{dtype} bound"


def _rows_invariant(fn, x, sizes, move_rows=True):
    full = fn(x)
    for n in sizes:
        assert torch.equal(fn(x[:n]), full[:n]), f"rows changed at N={n}"
    if not move_rows:
        return
    perm = torch.randperm(x.shape[0], device=x.device)
    assert torch.equal(fn(x[perm]), full[perm]), "rows changed when moved to other positions"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matmul_and_linear_match_fp64_and_are_row_invariant(seed, device, dtype):
    s = _shape(device)
    a = torch.randn(s["n"], s["k"], device=device).to(dtype)
    b = torch.randn(s["k"], s["m"], device=device).to(dtype)
    w, bias = torch.randn(s["m"], s["k"], device=device).to(dtype), torch.randn(s["m"], device=device).to(dtype)
    mm = lambda t: bi_matmul(t, b, backend="triton")
    lin = lambda t: bi_linear(t, w, bias, backend="triton")
    _close_in_dtype(mm(a), a.double() @ b.double(), "attention", dtype, "bi_matmul")
    _close_in_dtype(lin(a), a.double() @ w.double().t() + bias.double(), "attention", dtype, "bi_linear")
    assert dispatch.explain("bi_linear").backend == "triton"
    _rows_invariant(mm, a, s["sizes"], move_rows=device.type == "cuda")
    _rows_invariant(lin, a, s["sizes"], move_rows=device.type == "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_reductions_match_fp64_and_are_row_invariant(seed, device, dtype):
    s = _shape(device)
    width = 150 if device.type == "cpu" else 151936
    x = (torch.randn(s["n"], width, device=device) * 3).to(dtype)
    x[0, :7] = float("-inf")  # -inf logits are legal: probability 0
    weight = torch.randn(width, device=device)
    y, y64 = x[1:], x[1:].double()
    lsm = lambda t: bi_log_softmax(t, backend="triton")
    mean = lambda t: bi_mean(t, -1, backend="triton")
    rms = lambda t: rk.rms_norm(t, weight, 1e-5, backend="triton")
    x64 = x.double()
    _close_in_dtype(lsm(x)[:, 7:], (x64 - torch.logsumexp(x64, -1, keepdim=True))[:, 7:], "logprob", dtype, "bi_log_softmax")
    assert bool((lsm(x)[0, :7] == float("-inf")).all())
    _close_in_dtype(mean(y), y64.mean(-1), "reduction", dtype, "bi_mean")
    expected = y64 / (y64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * weight.double()
    _close_in_dtype(rms(y), expected, "reduction", dtype, "rms_norm")
    _rows_invariant(lsm, x, s["sizes"])
    for fn in (mean, rms):
        _rows_invariant(fn, y, [n - 1 for n in s["sizes"]])


def test_gradients_match_fp64(seed, device):
    s = _shape(device)
    x = torch.randn(s["n"], s["k"], device=device, requires_grad=True)
    w = torch.randn(s["m"], s["k"], device=device, requires_grad=True)
    bias = torch.randn(s["m"], device=device, requires_grad=True)
    g = torch.randn(s["n"], s["m"], device=device)
    norm_w = torch.randn(s["m"], device=device, requires_grad=True)

    def chain(xx, ww, bb, nw, backend):
        y = bi_linear(xx, ww, bb, backend=backend)
        y = rk.rms_norm(y, nw, 1e-6, backend=backend)
        return bi_log_softmax(y, backend=backend) + bi_mean(y, -1, keepdim=True, backend=backend)

    leaves = (x, w, bias, norm_w)
    got = torch.autograd.grad(chain(*leaves, "triton"), leaves, g)
    x64, w64, bias64, norm_w64 = leaves64 = [t.detach().double().cpu().requires_grad_() for t in leaves]
    expected = torch.autograd.grad(chain(x64, w64, bias64, norm_w64, "torch"), leaves64, g.double().cpu())
    for name, a, e in zip(("x", "weight", "bias", "norm weight"), got, expected):
        contract.assert_close(a, e, "gradient", torch.float32, name=f"d{name}")


def test_empty_and_fp64_inputs(device):
    b = torch.randn(8, 5, device=device)
    assert bi_matmul(torch.randn(0, 8, device=device), b, backend="triton").shape == (0, 5)
    assert torch.isnan(bi_mean(torch.randn(3, 0, device=device), -1, backend="triton")).all()
    with pytest.raises(rk.BackendUnavailableError, match="fp64"):
        bi_matmul(torch.randn(2, 8, device=device, dtype=torch.float64), b.double(), backend="triton")


def test_mode_routes_model_ops_to_the_triton_kernels(seed, device, monkeypatch):
    """With the triton backend preferred (what ``auto`` picks on CUDA), F.linear, log_softmax and the
    RMSNorm mean of a model run the Triton kernels inside the mode, with row-invariant bits."""
    monkeypatch.setenv("RL_KERNEL_BACKEND", "triton")
    s = _shape(device)
    w = torch.randn(s["m"], s["k"], device=device)
    fn = lambda t: torch.log_softmax(torch.nn.functional.linear(t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True)), w), -1)
    x = torch.randn(s["n"], s["k"], device=device)
    with rk.batch_invariant():
        _rows_invariant(fn, x, s["sizes"], move_rows=device.type == "cuda")
    for op in ("bi_matmul", "bi_mean", "bi_log_softmax"):
        assert dispatch.explain(op).backend == "triton", op


@pytest.mark.gpu
def test_auto_picks_triton_on_cuda_inside_the_mode(seed, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("RL_KERNEL_BACKEND", raising=False)
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    with rk.batch_invariant():
        torch.nn.functional.linear(x, w)
    assert dispatch.explain("bi_matmul").backend == "triton"


def test_matmul_tile_fits_the_devices_shared_memory(monkeypatch):
    """The 16-bit tile's pipeline needs 192 KiB of shared memory per block: an H100 (227 KiB) takes
    it, an A100 (163 KiB) the compact tile; fp32 keeps its one tile. Decided per dtype and device."""
    from rl_kernel_core.triton import batch_invariant as tbi
    from rl_kernel_core.triton import tuning

    device = torch.device("cuda", 0)
    try:
        for smem, expected in ((232448, tuning.MATMUL_TILES), (166912, tuning.COMPACT_MATMUL_TILES)):
            monkeypatch.setattr(tbi, "shared_memory_per_block", lambda _device, smem=smem: smem)
            tbi.matmul_tile.cache_clear()
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                assert tbi.matmul_tile(dtype, device) == expected[dtype]
    finally:
        tbi.matmul_tile.cache_clear()  # the real device's answer next time
    assert tuning.MATMUL_TILES[torch.bfloat16] != tuning.COMPACT_MATMUL_TILES[torch.bfloat16]
