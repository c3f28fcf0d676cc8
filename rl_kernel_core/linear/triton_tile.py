"""The logits tile of the Triton ``linear_logprob`` passes: how a ``[BLOCK_M, BLOCK_N]`` tile of
``z = (h @ W.T + b) / T`` is formed, which tile shape a pass takes, and the launch plumbing the
statistics pass (:mod:`.triton_stats`) and the gradient pass (:mod:`.triton_grad`) share.

Where the logits come from is a compile-time switch of both passes: ``FROM_LOGITS=False`` forms
the tile with ``tl.dot`` from ``hidden`` and ``weight`` (the logits never leave registers: the
*gemm* route); ``FROM_LOGITS=True`` reads the fp32 logits chunk cuBLAS wrote (the *chunked*
route, :mod:`rl_kernel_core.linear.chunks`). Each output element is one length-D dot product
accumulated in a fixed ``BLOCK_K`` order, and the tile shape depends only on the device kind,
the dtype and the pass (:func:`tiles`), never on N: a row's logits do not depend on N or on the
other rows.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton.language as tl

from rl_kernel_core.linear.chunks import LinearTuning, tuning
from rl_kernel_core.tiles import TileConfig
from rl_kernel_core.triton._jit import helper_jit, interpreting
from rl_kernel_core.triton._matmul_helpers import dot_acc
from rl_kernel_core.triton.tuning import (
    LINEAR_FP32_TILES,
    LINEAR_GEMM_GRAD_TILES,
    LINEAR_GEMM_TILES,
    LINEAR_INTERPRETER_PROGRAMS,
    LINEAR_INTERPRETER_TILES,
    LINEAR_LOSS_KEEPS_LOGITS_FROM_DIM,
    LINEAR_MEMORY_PASS_TILES,
    LINEAR_SM90,
    LINEAR_STATS_BYTES,
)


@dataclasses.dataclass(frozen=True)
class LinearChoices:
    """The Triton passes' choices under a :class:`~rl_kernel_core.linear.chunks.LinearTuning`: its
    field where set, else the ``LINEAR_*`` table of :mod:`rl_kernel_core.triton.tuning` (fields as
    ``LinearTuning``'s)."""

    stats_bytes: int
    gemm_tiles: TileConfig
    gemm_grad_tiles: TileConfig
    loss_keeps_logits_from_dim: int
    sm90: str


_resolved: Optional[tuple[LinearTuning, LinearChoices]] = None


def linear() -> LinearChoices:
    """The :class:`LinearChoices` of the :func:`~rl_kernel_core.linear.chunks.tuning` in force."""
    global _resolved
    t = tuning()
    kept = _resolved
    if kept is not None and kept[0] is t:
        return kept[1]
    choices = LinearChoices(
        LINEAR_STATS_BYTES if t.stats_bytes is None else t.stats_bytes,
        LINEAR_GEMM_TILES if t.gemm_tiles is None else t.gemm_tiles,
        LINEAR_GEMM_GRAD_TILES if t.gemm_grad_tiles is None else t.gemm_grad_tiles,
        LINEAR_LOSS_KEEPS_LOGITS_FROM_DIM if t.loss_keeps_logits_from_dim is None else t.loss_keeps_logits_from_dim,
        LINEAR_SM90 if t.sm90 is None else t.sm90,
    )
    _resolved = (t, choices)
    return choices


@helper_jit
def row_block(pid_m, M, tgt_ptr, ignore_index, BLOCK_M: tl.constexpr):
    """``(rows, row_ok, tgt)`` of row block ``pid_m``: its ``BLOCK_M`` row indices, which of them
    are below ``M``, and their int64 target ids (``ignore_index`` for the rows past ``M``)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    return rows, row_ok, tgt


@helper_jit
def logits_tile(
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
    FROM_LOGITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IN_PLACE: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``(z, cols, col_ok, raw)``: the fp32 tile ``z`` of rows ``rows_safe`` and vocab tile ``t``
    (columns ``cols``; ``col_ok`` those below V), scaled by ``inv_temp``; ``raw`` is the tile
    before the bias and the scale (what a chunk of stored logits holds: the ``FROM_LOGITS`` path
    turns it into ``z`` with the same two operations). ``x_ptr`` is ``hidden``
    (or, with ``TMA``, tensor descriptors of ``hidden`` and ``weight``) or, with ``FROM_LOGITS``,
    the fp32 logits chunk; with ``IN_PLACE`` every thread's loads of the tile land before any
    thread writes over its bytes."""
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < V
    if FROM_LOGITS:
        zr = tl.load(
            x_ptr + rows_safe[:, None] * stride_xm + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if IN_PLACE:
            tl.debug_barrier()
    else:
        if not TMA:
            cols_safe = tl.where(col_ok, cols, 0).to(tl.int64)
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = x_ptr + rows_safe[:, None] * stride_xm + offs_k[None, :] * stride_xk
            b_ptrs = w_ptr + cols_safe[None, :] * stride_wv + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(D, BLOCK_K)):
            if TMA:  # tensor descriptors: out-of-bounds rows, columns and k read as 0
                a = x_ptr.load([pid_m * BLOCK_M, k * BLOCK_K])
                b = w_ptr.load([t * BLOCK_N, k * BLOCK_K]).T
            elif EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < D - k * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = dot_acc(a, b, acc, IEEE, UPCAST_DOT)
            if not TMA:
                a_ptrs += BLOCK_K * stride_xk
                b_ptrs += BLOCK_K * stride_wk
        zr = acc
    raw = zr
    if HAS_BIAS:
        zr = zr + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return zr * inv_temp, cols, col_ok, raw


def tiles(dtype: torch.dtype, device: torch.device, from_logits: bool, grad: bool = False) -> TileConfig:
    """The tile shape of a statistics (or, with ``grad``, gradient) pass over ``dtype`` inputs on
    ``device`` under the :func:`~rl_kernel_core.linear.chunks.tuning` in force."""
    choices = linear()
    gemm = choices.gemm_grad_tiles if grad else choices.gemm_tiles
    if device.type != "cuda" or interpreting():
        return dataclasses.replace(LINEAR_INTERPRETER_TILES, tma=gemm.tma, persistent=gemm.persistent)
    if from_logits:
        return LINEAR_MEMORY_PASS_TILES
    return LINEAR_FP32_TILES if dtype == torch.float32 else gemm


def tma_supported(dtype: torch.dtype, dim: int, device: torch.device) -> bool:
    """Whether the gemm route can take TMA loads for ``[*, dim]`` operands of ``dtype`` on
    ``device``: 16-bit, rows a multiple of 16 bytes, compute capability 9.0+ (or the interpreter).
    A function of the dtype, D and device only, so every row of a given head takes the same path."""
    if dtype not in (torch.bfloat16, torch.float16) or (dim * 2) % 16:
        return False
    if interpreting():
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def dummy(device: torch.device) -> torch.Tensor:
    """A 1-element fp32 tensor for pointer arguments a specialization never reads."""
    return torch.empty(1, dtype=torch.float32, device=device)


def operands(x: torch.Tensor, weight: torch.Tensor, cfg: TileConfig, from_logits: bool) -> tuple[object, object, bool]:
    """``(x, weight, tma)``: tensor descriptors of the tile blocks when ``cfg.tma`` applies, else the tensors."""
    if from_logits or not cfg.tma or not tma_supported(weight.dtype, weight.shape[1], weight.device):
        return x, weight, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (
        TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
        TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
        True,
    )


def grid(work: int, cfg: TileConfig, device: torch.device, from_logits: bool) -> tuple[int]:
    """One program per work unit, or one per SM for a persistent gemm-route launch."""
    if not cfg.persistent or from_logits:
        return (work,)
    if device.type != "cuda" or interpreting():
        return (min(work, LINEAR_INTERPRETER_PROGRAMS),)
    return (min(work, torch.cuda.get_device_properties(device).multi_processor_count),)


def tile_flags(weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: TileConfig, tma: bool) -> dict:
    """The compile-time arguments of :func:`logits_tile` and the launch options both passes take."""
    return dict(
        HAS_BIAS=bias is not None,
        EVEN_K=weight.shape[1] % cfg.block_k == 0,
        IEEE=weight.dtype == torch.float32,
        UPCAST_DOT=interpreting(),
        TMA=tma,
        FLATTEN=cfg.persistent,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def tile_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    rows: int,
    inv_temp: float,
    ignore_index: int,
    cfg: TileConfig,
    from_logits: bool,
) -> tuple[tuple, dict]:
    """``(args, flags)``: the leading arguments both passes' kernels take over rows ``[0, rows)`` of
    ``x`` (operands, bias, targets, sizes, strides, scale, ignored id) and their compile-time
    arguments and launch options (``FROM_LOGITS`` and :func:`tile_flags`)."""
    vocab, dim = weight.shape
    xs, ws, tma = operands(x[:rows], weight, cfg, from_logits)
    b = bias if bias is not None else dummy(x.device)
    strides = (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1))
    args = (xs, ws, b, targets, rows, vocab, dim, *strides, inv_temp, ignore_index)
    return args, dict(FROM_LOGITS=from_logits, **tile_flags(weight, bias, cfg, tma))
