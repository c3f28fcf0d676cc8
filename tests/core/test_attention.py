"""varlen_attention: accuracy against a dense fp64 formula written here (causal, GQA, packed),
bitwise equality of prefill vs incremental decode over a KV cache and of a sequence alone vs packed
with others, gradients, bad input."""

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import contract
from oracles import dense_attention




def _packed(lengths, hq=4, hkv=2, d=8, dtype=torch.float32):
    t = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return torch.randn(t, hq, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype), torch.randn(t, hkv, d, dtype=dtype), cu


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dense_formula(seed, causal, dtype):
    q, k, v, cu = _packed([5, 37, 1, 16], dtype=dtype)
    out, lse = rk.varlen_attention(q, k, v, cu, causal=causal, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    expected = dense_attention(q, k, v, cu.tolist(), cu.tolist(), causal)
    tol = contract.tolerance("attention", dtype)
    torch.testing.assert_close(out.double(), expected, atol=tol.atol, rtol=tol.rtol)


def test_decode_over_kv_cache_equals_prefill_bitwise(seed):
    q, k, v, cu = _packed([45])
    full = rk.varlen_attention(q, k, v, cu)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for t in range(45):
        cache = torch.tensor([0, t + 1], dtype=torch.int32)
        step = rk.varlen_attention(q[t:t + 1], k[:t + 1], v[:t + 1], one, cache)
        assert torch.equal(step[0], full[t]), f"decode step {t} differs from the prefill"


def test_chunked_prefill_equals_full_prefill_bitwise(seed):
    q, k, v, cu = _packed([40])
    full = rk.varlen_attention(q, k, v, cu)
    tail = rk.varlen_attention(q[23:], k, v, torch.tensor([0, 17], dtype=torch.int32), cu)
    assert torch.equal(tail, full[23:])


def test_sequence_alone_equals_packed_bitwise(seed):
    lengths = [7, 33, 2, 20]
    q, k, v, cu = _packed(lengths)
    packed = rk.varlen_attention(q, k, v, cu)
    c = cu.tolist()
    for b in range(len(lengths)):
        sl = slice(c[b], c[b + 1])
        alone = rk.varlen_attention(q[sl], k[sl], v[sl], torch.tensor([0, lengths[b]]))
        assert torch.equal(alone, packed[sl]), f"sequence {b} changed when packed"


def test_mode_on_keeps_decode_prefill_equality(seed):
    q, k, v, cu = _packed([20])
    with rk.batch_invariant():
        full = rk.varlen_attention(q, k, v, cu)
        step = rk.varlen_attention(q[19:], k, v, torch.tensor([0, 1]), cu)
    assert torch.equal(step[0], full[19])


def test_gradients_match_dense_formula(seed):
    q, k, v, cu = _packed([9, 18])
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    w = torch.randn(q.shape, dtype=torch.float64)
    got = torch.autograd.grad((rk.varlen_attention(q, k, v, cu) * w).sum(), (q, k, v))
    expected = torch.autograd.grad((dense_attention(q, k, v, cu.tolist(), cu.tolist(), True) * w).sum(), (q, k, v))
    tol = contract.tolerance("gradient", torch.float64)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=tol.atol, rtol=tol.rtol)


def test_bad_input_names_the_argument():
    q, k, v, cu = _packed([4, 4])
    with pytest.raises(ValueError, match="Hq=4.*Hkv=3"):
        rk.varlen_attention(q, torch.randn(8, 3, 8), torch.randn(8, 3, 8), cu)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        rk.varlen_attention(q, k, v, torch.tensor([0, 3, 7]))
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        rk.varlen_attention(q, k, v, cu.float())
    with pytest.raises(ValueError, match="Lq <= Lk"):
        rk.varlen_attention(q, k[:4], v[:4], cu, torch.tensor([0, 2, 4]))
    with pytest.raises(TypeError, match="k"):
        rk.varlen_attention(q, k.double(), v, cu)
    with pytest.raises(ValueError, match="cu_seqlens_k.*sequence 1 has Lq=4, Lk=0"):
        rk.varlen_attention(q, k[:4], v[:4], cu, torch.tensor([0, 4, 4]), causal=False)
    with pytest.raises(ValueError, match=r"q must have a head dim D >= 1, got shape \(8, 4, 0\)"):
        rk.varlen_attention(q[..., :0], k[..., :0], v[..., :0], cu)
    with pytest.raises(TypeError, match="return_lse must be a bool, got str"):
        rk.varlen_attention(q, k, v, cu, return_lse="yes")


def test_sequence_without_queries_may_have_no_keys(seed):
    q, k, v, cu = _packed([4, 4])
    cu_q = torch.tensor([0, 4, 4, 8])
    cu_k = torch.tensor([0, 4, 4, 8])
    out = rk.varlen_attention(q, k, v, cu_q, cu_k, causal=False)
    torch.testing.assert_close(out, rk.varlen_attention(q, k, v, cu, causal=False), atol=0, rtol=0)
