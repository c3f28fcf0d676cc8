"""Gradient pass of the Triton ``linear_logprob``: ``dl = dL/d logits`` per tile, from the
recomputed logits (:func:`rl_kernel_core.linear.triton_tile.logits_tile`) and the forward's
saved ``lse`` and entropy. On Hopper the pass may run as a CUDA kernel with the same bits
(:mod:`.triton_sm90`).

With ``p = exp(z - lse)`` and upstream gradients ``g`` (log-prob) and ``e`` (entropy):
``dL/dz = g (onehot(t) - p) - e p (log p + entropy)`` and ``dl = dL/dz / T``, the gradient of
the raw logits; the chunk driver (:mod:`rl_kernel_core.linear.chunks`) then forms ``dh = dl @ W``,
``dW += dl^T @ h`` and ``db = sum_rows dl``. A row at ``ignore_index`` gets ``dl = 0``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.linear import triton_sm90
from rl_kernel_core.linear.chunks import Chunk
from rl_kernel_core.linear.triton_tile import dummy, grid, logits_tile, row_block, tile_args, tiles
from rl_kernel_core.triton._jit import launch_time_jit
from rl_kernel_core.triton._matmul_helpers import grouped_tile


@launch_time_jit
def _grad_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    tgt_ptr,
    M,
    V,
    D,
    stride_xm,
    stride_xk,
    stride_wv,
    stride_wk,
    inv_temp,
    ignore_index,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    dl_ptr,
    stride_dm,
    TILES_PER_PROG,
    n_progs,
    FROM_LOGITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_GENT: tl.constexpr,
    IN_PLACE: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    TMA: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``dl`` of rows ``[0, M)``. A work unit is ``BLOCK_M`` rows and ``TILES_PER_PROG`` consecutive
    vocab tiles, visited in ascending order (``IN_PLACE`` needs whole rows per unit: ``dl``
    overwrites the fp32 logits it was computed from, as a 2-byte view whose row stride is the fp32
    row's). Program ``i`` of ``n_progs`` takes units ``i, i + n_progs, ...``."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(V, BLOCK_N)
    num_pid_g = tl.cdiv(n_tiles, TILES_PER_PROG)
    for pid in tl.range(tl.program_id(0), num_pid_m * num_pid_g, n_progs, flatten=FLATTEN):
        pid_m, pid_g = grouped_tile(pid, num_pid_m, num_pid_g, GROUP_M)
        rows, row_ok, tgt = row_block(pid_m, M, tgt_ptr, ignore_index, BLOCK_M)
        valid = row_ok & (tgt != ignore_index)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        glp = tl.where(valid, tl.load(glp_ptr + rows, mask=row_ok, other=0.0), 0.0)
        if HAS_GENT:
            ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
            gent = tl.where(valid, tl.load(gent_ptr + rows, mask=row_ok, other=0.0), 0.0)
        rows_safe = tl.where(row_ok, rows, 0).to(tl.int64)
        t_start = pid_g * TILES_PER_PROG
        t_end = tl.minimum(t_start + TILES_PER_PROG, n_tiles)
        for t in range(t_start, t_end):
            z, cols, col_ok, _ = logits_tile(
                x_ptr,
                w_ptr,
                b_ptr,
                rows_safe,
                row_ok,
                pid_m,
                t,
                V,
                D,
                stride_xm,
                stride_xk,
                stride_wv,
                stride_wk,
                inv_temp,
                FROM_LOGITS,
                HAS_BIAS,
                IN_PLACE,
                EVEN_K,
                IEEE,
                UPCAST_DOT,
                TMA,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            logp = z - lse[:, None]
            p = tl.exp(logp)
            onehot = cols[None, :] == tgt[:, None]
            dz = tl.where(onehot, glp[:, None], 0.0) - glp[:, None] * p
            if HAS_GENT:  # p = 0 (a -inf logit) contributes 0, not 0 * -inf
                dz -= tl.where(p > 0.0, gent[:, None] * p * (logp + ent[:, None]), 0.0)
            dz = tl.where(valid[:, None], dz * inv_temp, 0.0)
            out_ok = row_ok[:, None] & col_ok[None, :]
            tl.store(
                dl_ptr + rows_safe[:, None] * stride_dm + cols[None, :], dz.to(dl_ptr.dtype.element_ty), mask=out_ok
            )


def launch_grad(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    rows: int,
    inv_temp: float,
    ignore_index: int,
    lse: torch.Tensor,
    ent: Optional[torch.Tensor],
    g_lp: torch.Tensor,
    g_ent: Optional[torch.Tensor],
    dl: torch.Tensor,
    from_logits: bool,
) -> None:
    """Write ``dl[:rows]`` (``[rows, V]``, ``dl``'s dtype) from recomputed or stored logits.

    ``g_lp`` / ``g_ent`` are fp32 upstream gradients (``g_ent`` None: no entropy term; ``ent``
    is then unused). With ``from_logits`` the pass reads the fp32 chunk ``x``; ``dl`` may alias
    it: ``x`` itself (fp32 inputs), or a 2-byte view with ``x``'s byte row stride, for which each
    program then sweeps whole rows in ascending column order. A gemm-route pass into a ``dl`` of
    ``weight``'s dtype runs the Hopper CUDA kernel where
    :func:`~rl_kernel_core.linear.triton_sm90.serves` says so, with the same bits.
    """
    has_gent = g_ent is not None
    vectors = (lse, g_lp, *((ent, g_ent) if has_gent else ()))
    if (
        not from_logits
        and dl.dtype == weight.dtype
        and all(v.dtype == torch.float32 and v.is_contiguous() for v in vectors)
    ):
        ext = triton_sm90.serves("grad", x[:rows], weight, bias)
        if ext is not None:
            dispatch.ran(triton_sm90.KERNELS, "triton+sm90")
            group_m = tiles(weight.dtype, weight.device, False, grad=True).group_m
            ext.linear_grad_sm90(
                x[:rows],
                weight,
                bias,
                targets,
                rows,
                inv_temp,
                ignore_index,
                lse,
                ent if has_gent else None,
                g_lp,
                g_ent,
                dl,
                group_m,
            )
            return
    if not from_logits:
        dispatch.ran(triton_sm90.KERNELS, "triton")
    cfg = tiles(weight.dtype, weight.device, from_logits, grad=True)
    n_tiles = triton.cdiv(weight.shape[0], cfg.block_n)
    # a narrower dl written over wider logits lands on bytes other threads have yet to read
    in_place = from_logits and dl.data_ptr() == x.data_ptr() and dl.element_size() != x.element_size()
    per_prog = n_tiles if in_place else 1
    g = grid(triton.cdiv(rows, cfg.block_m) * triton.cdiv(n_tiles, per_prog), cfg, x.device, from_logits)
    unused = dummy(x.device)
    args, flags = tile_args(x, weight, bias, targets, rows, inv_temp, ignore_index, cfg, from_logits)
    _grad_kernel[g](
        *args,
        lse,
        ent if has_gent else unused,
        g_lp,
        g_ent if has_gent else unused,
        dl,
        dl.stride(0),
        per_prog,
        g[0],
        HAS_GENT=has_gent,
        IN_PLACE=in_place,
        **flags,
    )


def chunk_grad(
    chunk: Chunk, lse: torch.Tensor, ent: Optional[torch.Tensor], g_lp: torch.Tensor, g_ent: Optional[torch.Tensor]
) -> torch.Tensor:
    """The chunk driver's gradient pass: ``buf.dl`` of the chunk's ``n`` rows (rows past ``n`` zero);
    with ``buf.keeps_logits``, from the logits the statistics pass of the same rows kept."""
    buf = chunk.buf
    kept = buf.logits if buf.keeps_logits else None
    launch_grad(
        chunk.x if kept is None else kept,
        chunk.weight,
        chunk.bias,
        chunk.targets,
        chunk.n,
        chunk.inv_temp,
        chunk.ignore_index,
        lse,
        ent,
        g_lp,
        g_ent,
        buf.dl,
        buf.route == "chunked" or kept is not None,
    )
    return buf.padded_dl(chunk.n)
