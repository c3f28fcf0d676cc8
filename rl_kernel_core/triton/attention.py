"""Triton backend of ``varlen_attention`` (signature in :mod:`rl_kernel_core.attention`).

Forward: one program per (query tile, query head). A tile is ``BLOCK_M`` consecutive queries of one
sequence; the program walks that sequence's keys in blocks of ``BLOCK_N`` in ascending order 0, 1,
2, ... with an online softmax (running max, sum and weighted values in fp32), exactly the order of
the torch reference (:mod:`rl_kernel_core.reference.attention`), so a query visits the same blocks
in the same order whether it is computed in a full prefill or alone in a decode step over a KV
cache. A block that is entirely masked for a query (past its causal end, visited for the tile's
later rows) leaves its state bit for bit unchanged (rescale ``exp(0) = 1``, probabilities exactly
0). The tile table (which sequence and first query each tile holds) and the sequence offsets are
read from device memory (copied once per layout, see :func:`_tables`), and no per-call size is a
kernel argument, so every call runs the same compiled kernel. Tile sizes are fixed per dtype (:data:`TILES`).

Backward: plain PyTorch per sequence from the forward's log-sum-exp (``P = exp(S - lse)``,
``dV = P^T dO``, ``dS = P (dP - rowsum(dO O))``), correct to the contract. Each sequence's
gradients come from products over that sequence alone, so they do not depend on the other
sequences of the call (the chain tests assert it through the activation gradients); they do not
follow the forward's KV-block order, so a sequence's gradients in a padded or decode layout are
not promised to equal those of the packed one.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.triton._jit import interpreting, launch_time_jit

TILES: dict[torch.dtype, tuple[int, int, int, int]] = {
    torch.float32: (32, 32, 4, 2),
    torch.bfloat16: (64, 64, 4, 2),
    torch.float16: (64, 64, 4, 2),
}
"""``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` per dtype; never a function of the sequence lengths."""
_INTERPRETED_TILES = (16, 16)


@launch_time_jit(do_not_specialize=["scale"])
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, tile_seq_ptr, tile_start_ptr, scale,
    HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    q0 = tl.load(cu_q_ptr + seq)
    lq = tl.load(cu_q_ptr + seq + 1) - q0
    k0 = tl.load(cu_k_ptr + seq)
    lk = tl.load(cu_k_ptr + seq + 1) - k0
    offset = lk - lq
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < lq
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    q = tl.load(q_ptr + ((q0 + rows)[:, None].to(tl.int64) * HQ + head) * D + dims[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST_DOT:  # the CPU interpreter multiplies 16-bit floats as integers; the upcast is exact
        q = q.to(tl.float32)
    qpos = offset + rows
    n_blocks = tl.cdiv(lk, BLOCK_N)
    if CAUSAL:
        last = offset + tl.minimum(start + BLOCK_M, lq) - 1
        n_blocks = tl.minimum(n_blocks, last // BLOCK_N + 1)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for j in range(0, n_blocks):
        kpos = j * BLOCK_N + cols
        k_ok = kpos < lk
        kv_off = ((k0 + kpos)[:, None].to(tl.int64) * (HQ // GROUP) + kv_head) * D + dims[None, :]
        kb = tl.load(k_ptr + kv_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        vb = tl.load(v_ptr + kv_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            kb = kb.to(tl.float32)
            vb = vb.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(kb), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kb))
        valid = tl.broadcast_to(k_ok[None, :], (BLOCK_M, BLOCK_N))
        if CAUSAL:
            valid = valid & (kpos[None, :] <= qpos[:, None])
        s = tl.where(valid, s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m = m_new
    out = acc / l[:, None]
    tl.store(o_ptr + ((q0 + rows)[:, None].to(tl.int64) * HQ + head) * D + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + (q0 + rows).to(tl.int64) * HQ + head, m + tl.log(l), mask=row_ok)


TABLE_CACHE_SIZE = 64
"""Layouts (offsets and tile size) whose device tables :func:`_tables` keeps."""


@functools.lru_cache(maxsize=TABLE_CACHE_SIZE)
def _tables(device: torch.device, bm: int, cu_q: tuple[int, ...], cu_k: tuple[int, ...]) -> Optional[tuple[torch.Tensor, ...]]:
    """Device int32 copies of the offsets and of the tile table (each ``BLOCK_M`` query tile's
    sequence and first query), or None when there are no queries. Kept per layout: the layers of one
    forward share them (one host-to-device copy per forward, not per layer), and a CUDA graph
    captured after a call with the same layout reads tensors that stay alive while the layout is
    among the last :data:`TABLE_CACHE_SIZE` used (capture itself cannot copy from host memory)."""
    tile_seq, tile_start = [], []
    for b in range(len(cu_q) - 1):
        for start in range(0, cu_q[b + 1] - cu_q[b], bm):
            tile_seq.append(b)
            tile_start.append(start)
    if not tile_seq:
        return None
    return tuple(torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True) for values in (cu_q, cu_k, tile_seq, tile_start))


def _forward(q, k, v, cu_q: list[int], cu_k: list[int], causal: bool, scale: float):
    tq, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((tq, hq), dtype=torch.float32, device=q.device)
    interpreted = interpreting()
    bm, bn = _INTERPRETED_TILES if interpreted else TILES[q.dtype][:2]
    tables = _tables(q.device, bm, tuple(cu_q), tuple(cu_k))
    if tables is None:
        return out, lse
    extra = {} if interpreted else {"num_warps": TILES[q.dtype][2], "num_stages": TILES[q.dtype][3]}
    _attention_fwd_kernel[(tables[2].shape[0], hq)](
        q, k, v, out, lse, *tables, float(scale),
        HQ=hq, GROUP=hq // k.shape[1], D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        CAUSAL=causal, IEEE=q.dtype == torch.float32 or interpreted, UPCAST_DOT=interpreted,
        BLOCK_M=bm, BLOCK_N=bn, **extra,
    )
    return out, lse


def _backward(q, k, v, out, lse, grad_out, cu_q, cu_k, causal, scale):
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        qb = q[qs:qe].float().transpose(0, 1)                                    # [Hq, Lq, D]
        kb = k[ks:ke].float().repeat_interleave(group, dim=1).transpose(0, 1)    # [Hq, Lk, D]
        vb = v[ks:ke].float().repeat_interleave(group, dim=1).transpose(0, 1)
        go = grad_out[qs:qe].float().transpose(0, 1)
        ob = out[qs:qe].float().transpose(0, 1)
        s = torch.matmul(qb, kb.transpose(1, 2)) * scale
        if causal:
            lq, lk = qe - qs, ke - ks
            future = torch.arange(lk, device=q.device)[None, :] > (lk - lq + torch.arange(lq, device=q.device))[:, None]
            s = s.masked_fill(future, -math.inf)
        p = torch.exp(s - lse[qs:qe].transpose(0, 1)[..., None])
        dp = torch.matmul(go, vb.transpose(1, 2))
        ds = p * (dp - (go * ob).sum(-1, keepdim=True)) * scale
        dq[qs:qe] = torch.matmul(ds, kb).transpose(0, 1)
        dk_h = torch.matmul(ds.transpose(1, 2), qb)                                # [Hq, Lk, D]
        dv_h = torch.matmul(p.transpose(1, 2), go)
        hkv = k.shape[1]
        dk[ks:ke] = dk_h.view(hkv, group, ke - ks, -1).sum(1).transpose(0, 1)
        dv[ks:ke] = dv_h.view(hkv, group, ke - ks, -1).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale):
        out, lse = _forward(q, k, v, cu_q, cu_k, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (cu_q, cu_k, causal, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, grad_out, *ctx.args)
        return dq, dk, dv, None, None, None, None


def _supports(q: torch.Tensor, *args, **kwargs) -> Optional[str]:
    if q.dtype == torch.float64:
        return "the triton kernel accumulates in fp32; fp64 inputs need the torch backend"
    if q.shape[2] > 256:
        return f"head_dim D={q.shape[2]} exceeds the kernel's limit of 256"
    return None


@dispatch.register("varlen_attention", "triton", supports=_supports)
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int],
                     causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` contiguous, offsets as Python lists -> (out ``[Tq, Hq, D]``
    in q's dtype, lse ``[Tq, Hq]`` fp32)."""
    return _VarlenAttention.apply(q, k, v, cu_q, cu_k, causal, scale)
