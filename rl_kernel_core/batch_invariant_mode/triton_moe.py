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
the weight gradient is one plain product per expert (it reads the counts to the host), correct but
not batch-invariant, as the matmul's is.
"""

from __future__ import annotations

import torch
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.batch_invariant_mode.triton import _supports, matmul_tile
from rl_kernel_core.triton._autograd import records_graph
from rl_kernel_core.triton._jit import interpreting, launch_time_jit
from rl_kernel_core.triton._matmul_helpers import tile_product
from rl_kernel_core.triton.tuning import MATMUL_INTERPRETED_TILES


@launch_time_jit(do_not_specialize=["R"])
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


def grouped_forward(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rows [R, K]`` (sorted by expert: ``counts[0]`` rows of expert 0, then expert 1's, ...)
    times each row's expert's ``weight [E, N, K]`` transposed: ``[R, N]`` in ``rows``' dtype, no
    autograd. ``weight`` may have any strides."""
    r, k = rows.shape
    experts, n = weight.shape[0], weight.shape[1]
    out = torch.empty((r, n), dtype=rows.dtype, device=rows.device)
    if r == 0 or n == 0:
        return out
    interpreted = interpreting()
    if interpreted:
        (bm, bn, bk), extra = MATMUL_INTERPRETED_TILES, {}
    else:
        bm, bn, bk, warps, stages = matmul_tile(rows.dtype, rows.device)
        extra = {"num_warps": warps, "num_stages": stages}
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
        rows.stride(0),
        rows.stride(1),
        weight.stride(0),
        weight.stride(1),
        weight.stride(2),
        out.stride(0),
        out.stride(1),
        IEEE=rows.dtype == torch.float32 or interpreted,
        UPCAST_DOT=interpreted,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        **extra,
    )
    return out


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
        dweight = None
        if ctx.needs_input_grad[1]:
            dweight = torch.zeros_like(weight)
            start = 0
            for e, count in enumerate(counts.tolist()):
                if count:
                    dweight[e] = grad[start : start + count].t() @ rows[start : start + count]
                start += count
        return drows, dweight, None


@dispatch.register("bi_grouped_linear", "triton", supports=_supports)
def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rows [R, K]`` sorted by expert times each expert's ``weight [E, N, K]`` transposed, one
    launch for all experts: ``[R, N]`` in ``rows``' dtype (see the module docstring)."""
    if records_graph(rows, weight):
        return _GroupedLinear.apply(rows, weight, counts)
    return grouped_forward(rows, weight, counts)
