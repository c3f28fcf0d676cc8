"""Triton ``varlen_attention``: accuracy and gradients against the dense fp64 formula of
test_attention, bitwise equality of KV-cache decode vs prefill and of a sequence alone vs packed.

Runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` per test) with small shapes and on
CUDA (``gpu`` marker) at Qwen3-0.6B head shapes (16 query / 8 KV heads, head_dim 128). Under the
interpreter ``tl.dot`` is numpy's BLAS matmul, which treats a row by its position in the tile, so
the bitwise decode/packing properties (a query at another tile position) are asserted on CUDA and
checked against the contract on CPU.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import contract, dispatch
from oracles import dense_attention

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes




@pytest.fixture
def device(triton_device):
    """CPU (the Triton interpreter) or CUDA (compiled); see tests/conftest.py."""
    return triton_device


def _packed(device, lengths, dtype=torch.float32):
    hq, hkv, d = (4, 2, 8) if device.type == "cpu" else (16, 8, 128)
    t = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    make = lambda h: torch.randn(t, h, d, device=device).to(dtype)
    return make(hq), make(hkv), make(hkv), cu


def _lengths(device):
    return [5, 37, 1, 16] if device.type == "cpu" else [5, 700, 1, 129, 64]


def _equal_or_close(device, got, expected, dtype, what):
    if device.type == "cuda":
        assert torch.equal(got, expected), f"{what}: not bitwise equal"
    else:
        tol = contract.tolerance("attention", dtype)
        torch.testing.assert_close(got, expected, atol=tol.atol, rtol=tol.rtol, msg=what)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dense_formula(seed, device, causal, dtype):
    q, k, v, cu = _packed(device, _lengths(device), dtype)
    out, lse = rk.varlen_attention(q, k, v, cu, causal=causal, return_lse=True, backend="triton")
    assert dispatch.explain("varlen_attention").backend == "triton"
    assert out.dtype == dtype and lse.dtype == torch.float32
    c = cu.tolist()
    expected = dense_attention(q.cpu(), k.cpu(), v.cpu(), c, c, causal)
    tol = contract.tolerance("attention", dtype)
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol.atol, rtol=tol.rtol)
    _, ref_lse = rk.varlen_attention(q, k, v, cu, causal=causal, return_lse=True, backend="torch")
    torch.testing.assert_close(lse, ref_lse, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_packing_equal_prefill(seed, device, dtype):
    lengths = _lengths(device)
    q, k, v, cu = _packed(device, lengths, dtype)
    full = rk.varlen_attention(q, k, v, cu, backend="triton")
    c = cu.tolist()
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    b = 1  # the longest sequence: decode steps cross several KV blocks and tile positions
    for t in range(0, lengths[b], max(1, lengths[b] // 13)):
        i = c[b] + t
        step = rk.varlen_attention(q[i:i + 1], k[c[b]:i + 1], v[c[b]:i + 1], one,
                                   torch.tensor([0, t + 1], dtype=torch.int32, device=device), backend="triton")
        _equal_or_close(device, step[0], full[i], dtype, f"decode step {t}")
    for b in range(len(lengths)):
        sl = slice(c[b], c[b + 1])
        alone = rk.varlen_attention(q[sl], k[sl], v[sl], torch.tensor([0, lengths[b]], device=device), backend="triton")
        _equal_or_close(device, alone, full[sl], dtype, f"sequence {b} alone")


def test_gradients_match_dense_formula(seed, device):
    q, k, v, cu = _packed(device, [9, 18] if device.type == "cpu" else [9, 300])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    w = torch.randn(q.shape, device=device)
    got = torch.autograd.grad((rk.varlen_attention(q, k, v, cu, backend="triton") * w).sum(), (q, k, v))
    q64, k64, v64 = leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    c = cu.tolist()
    expected = torch.autograd.grad((dense_attention(q64, k64, v64, c, c, True) * w.double().cpu()).sum(), leaves)
    for name, g, e in zip("qkv", got, expected):
        contract.assert_close(g, e, "gradient", torch.float32, name=f"d{name}")


def test_fp64_is_left_to_the_torch_backend(device):
    q, k, v, cu = _packed(device, [4], torch.float64)
    with pytest.raises(rk.BackendUnavailableError, match="fp64"):
        rk.varlen_attention(q, k, v, cu, backend="triton")


def test_layout_tables_are_copied_once_per_layout(seed, device):
    """A layout's device tables are built once and reused by later calls (the layers of one forward,
    a CUDA graph captured after a call); another layout builds its own; results do not change."""
    from rl_kernel_core.triton import attention as triton_attention

    q, k, v, cu = _packed(device, _lengths(device))
    triton_attention._tables.cache_clear()
    first = rk.varlen_attention(q, k, v, cu, backend="triton")
    again = rk.varlen_attention(q, k, v, cu, backend="triton")
    info = triton_attention._tables.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert torch.equal(first, again)
    q2, k2, v2, cu2 = _packed(device, [3, 4])
    rk.varlen_attention(q2, k2, v2, cu2, backend="triton")
    assert triton_attention._tables.cache_info().misses == 2
