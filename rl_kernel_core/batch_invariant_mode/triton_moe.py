"""Triton backend of ``bi_grouped_linear``: every expert's product over its tokens in one launch.

A mixture-of-experts layer multiplies each expert's tokens by that expert's matrix. One
batch-invariant product per expert (:func:`rl_kernel_core.batch_invariant_mode.reference.grouped_linear`)
costs a launch per expert and reads the per-expert token counts to the host, which also keeps the
layer out of CUDA graphs. Here one kernel covers all experts: the rows arrive sorted by expert,
each expert's rows are cut into ``BLOCK_M``-row tiles starting at the expert's first row, and the
tile map (which expert and rows each row block of the grid takes) is computed on the device from
the counts, for a grid sized from the row count alone (:func:`tile_bound`). Nothing is read back to
the host.

Why the bits equal the per-expert products of the batch-invariant matmul
(:func:`rl_kernel_core.batch_invariant_mode.triton.matmul_forward`): a tile here is that kernel's
pointer tile (:func:`~rl_kernel_core.batch_invariant_mode.triton.matmul_tile`, the same
``BLOCK_K`` steps into one fp32 accumulator through the same ``dot_acc``), and an expert's rows sit
at the same places in their tiles as in a product over that expert's rows alone (tiles start at
the expert's first row). A GPU test asserts the equality
(``tests/core/batch_invariant_mode/test_bi_grouped_linear.py``).

Gradients: the input gradient is the same grouped product with each expert's matrix transposed;
the weight gradient is one launch too (:func:`grouped_weight_grad`: a program per block of one
expert's gradient, summing that expert's rows), correct but not batch-invariant, as the matmul's
weight gradient is not. Nothing in the forward or the backward is read to the host.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.batch_invariant_mode.triton import _supports, matmul_tile
from rl_kernel_core.triton._autograd import records_graph
from rl_kernel_core.triton._jit import interpreting, launch_time_jit
from rl_kernel_core.triton._matmul_helpers import tile_product
from rl_kernel_core.triton.tuning import (
    GROUPED_WEIGHT_GRAD_INTERPRETED_TILE,
    GROUPED_WEIGHT_GRAD_TILE,
    MATMUL_INTERPRETED_TILES,
)


@launch_time_jit
def _grouped_matmul_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    tile_expert_ptr,
    tile_first_ptr,
    tile_end_ptr,
    N,
    K,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``c[r, :] = a[r, :] @ w[e].T`` for the rows ``[first, end)`` of row block ``program_id(0)``
    (expert ``e``; ``first == end``: a block past the last expert's tiles, nothing to do)."""
    block = tl.program_id(0)
    first = tl.load(tile_first_ptr + block)
    end = tl.load(tile_end_ptr + block)
    if first < end:
        expert = tl.load(tile_expert_ptr + block).to(tl.int64)
        rm = first + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tile_product(
            a_ptr,
            w_ptr + expert * stride_we,
            rm,
            rn,
            end,
            N,
            K,
            stride_am,
            stride_ak,
            stride_wk,
            stride_wn,
            IEEE,
            UPCAST_DOT,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
        tl.store(
            c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=(rm[:, None] < end) & (rn[None, :] < N),
        )


@launch_time_jit
def _grouped_weight_grad_kernel(
    g_ptr,
    a_ptr,
    dw_ptr,
    rows_end_ptr,
    counts_ptr,
    N,
    K,
    stride_gm,
    stride_gn,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """``dw[e] = g[rows of e].T @ a[rows of e]`` for the ``[BLOCK_N, BLOCK_K]`` block
    ``program_id(1)`` of expert ``program_id(0)`` (zeros for an expert without rows)."""
    expert = tl.program_id(0).to(tl.int64)
    blocks_k = tl.cdiv(K, BLOCK_K)
    rn = (tl.program_id(1) // blocks_k).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = (tl.program_id(1) % blocks_k).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    end = tl.load(rows_end_ptr + expert)
    first = end - tl.load(counts_ptr + expert)
    # g.T [N, rows] @ a [rows, K] over this expert's rows: the rows are the product's reduction
    acc = tile_product(
        g_ptr + first * stride_gm,
        a_ptr + first * stride_am,
        rn,
        rk,
        N,
        K,
        end - first,
        stride_gn,
        stride_gm,
        stride_am,
        stride_ak,
        IEEE,
        UPCAST_DOT,
        BLOCK_N,
        BLOCK_K,
        BLOCK_R,
    )
    tl.store(
        dw_ptr + expert * stride_we + rn[:, None] * stride_wn + rk[None, :] * stride_wk,
        acc.to(dw_ptr.dtype.element_ty),
        mask=(rn[:, None] < N) & (rk[None, :] < K),
    )


def tile_bound(rows: int, experts: int, block_m: int) -> int:
    """The most ``block_m``-row tiles ``rows`` rows split among ``experts`` experts can take (each
    expert with rows adds at most one partial tile): the grid's row blocks, known on the host."""
    return -(-rows // block_m) + min(experts, rows)


def tile_map(counts: torch.Tensor, block_m: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which expert and rows each of ``blocks`` row blocks takes, computed on the device.

    Args:
        counts: ``[E]`` int64, the rows of each expert (the rows are sorted by expert).
        block_m: rows per tile. blocks: at least :func:`tile_bound`'s count.

    Returns:
        ``(expert, first, end)``, each ``[blocks]`` int64: block ``b`` multiplies rows
        ``[first[b], end[b])`` by expert ``expert[b]``'s matrix; blocks past the last tile have
        ``first == end``.
    """
    tiles = (counts + (block_m - 1)) // block_m
    tiles_end = torch.cumsum(tiles, 0)
    rows_end = torch.cumsum(counts, 0)
    block = torch.arange(blocks, device=counts.device)
    expert = torch.searchsorted(tiles_end, block, right=True)
    used = expert < counts.shape[0]
    expert = expert.clamp(max=counts.shape[0] - 1)
    first = rows_end[expert] - counts[expert] + (block - (tiles_end[expert] - tiles[expert])) * block_m
    end = torch.where(used, torch.minimum(first + block_m, rows_end[expert]), first)
    return expert, first, end


def _options(
    dtype: torch.dtype, tile: Callable[[], tuple[int, ...]], interpreted_blocks: tuple[int, int, int]
) -> tuple[tuple[int, ...], dict]:
    """A kernel's three block sizes and its launch options: ``interpreted_blocks`` under the
    interpreter, else ``tile()``'s blocks with its warps and stages; IEEE fp32 products for fp32
    inputs and under the interpreter, whose 16-bit operands are upcast."""
    interpreted = interpreting()
    flags = {"IEEE": dtype == torch.float32 or interpreted, "UPCAST_DOT": interpreted}
    if interpreted:
        return interpreted_blocks, flags
    *blocks, warps, stages = tile()
    return tuple(blocks), {**flags, "num_warps": warps, "num_stages": stages}


def grouped_forward(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rows [R, K]`` (sorted by expert: ``counts[0]`` rows of expert 0, then expert 1's, ...)
    times each row's expert's ``weight [E, N, K]`` transposed: ``[R, N]`` in ``rows``' dtype, no
    autograd. ``weight`` may have any strides."""
    r, k = rows.shape
    experts, n = weight.shape[0], weight.shape[1]
    out = torch.empty((r, n), dtype=rows.dtype, device=rows.device)
    if r == 0 or n == 0:
        return out
    (bm, bn, bk), options = _options(rows.dtype, lambda: matmul_tile(rows.dtype, rows.device), MATMUL_INTERPRETED_TILES)
    blocks = tile_bound(r, experts, bm)
    expert, first, end = tile_map(counts, bm, blocks)
    _grouped_matmul_kernel[(blocks, -(-n // bn))](
        rows,
        weight,
        out,
        expert,
        first,
        end,
        n,
        k,
        *rows.stride(),
        *weight.stride(),
        *out.stride(),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        **options,
    )
    return out


def grouped_weight_grad(grad: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, experts: int) -> torch.Tensor:
    """Each expert's weight gradient ``grad[rows of e].T @ rows[rows of e]`` for ``grad [R, N]``
    and ``rows [R, K]`` sorted by expert (``counts [E]``): ``[E, N, K]`` in ``rows``' dtype,
    accumulated in fp32, one launch, nothing read to the host. Not batch-invariant (a sum over
    the batch's rows), as the matmul's weight gradient is not."""
    n, k = grad.shape[1], rows.shape[1]
    dw = torch.empty((experts, n, k), dtype=rows.dtype, device=rows.device)
    if n == 0 or k == 0:
        return dw
    (bn, bk, br), options = _options(rows.dtype, lambda: GROUPED_WEIGHT_GRAD_TILE, GROUPED_WEIGHT_GRAD_INTERPRETED_TILE)
    _grouped_weight_grad_kernel[(experts, -(-n // bn) * -(-k // bk))](
        grad,
        rows,
        dw,
        torch.cumsum(counts, 0),
        counts,
        n,
        k,
        *grad.stride(),
        *rows.stride(),
        *dw.stride(),
        BLOCK_N=bn,
        BLOCK_K=bk,
        BLOCK_R=br,
        **options,
    )
    return dw


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, weight, counts):
        ctx.save_for_backward(rows, weight, counts)
        return grouped_forward(rows, weight, counts)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, counts = ctx.saved_tensors
        grad = grad.contiguous()
        drows = grouped_forward(grad, weight.transpose(1, 2), counts) if ctx.needs_input_grad[0] else None
        dweight = grouped_weight_grad(grad, rows, counts, weight.shape[0]) if ctx.needs_input_grad[1] else None
        return drows, dweight, None


@dispatch.register("bi_grouped_linear", "triton", supports=_supports)
def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rows [R, K]`` sorted by expert times each expert's ``weight [E, N, K]`` transposed, one
    launch for all experts: ``[R, N]`` in ``rows``' dtype (see the module docstring)."""
    if records_graph(rows, weight):
        return _GroupedLinear.apply(rows, weight, counts)
    return grouped_forward(rows, weight, counts)
