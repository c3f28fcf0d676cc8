"""Triton backend of the batch-invariant ops: ``bi_matmul``, ``bi_linear``, ``bi_log_softmax``,
``bi_logsumexp``, ``bi_mean`` and ``rms_norm`` (signatures in :mod:`rl_kernel_core.batch_invariant_mode.api`).

Why these are batch-invariant:

* The matmul is a persistent kernel: ``min(#SMs, #tiles)`` programs walk the output tiles in a
  fixed grouped order. Every output element is one dot product over K accumulated in fp32 in
  ``BLOCK_K`` steps of ascending k, with no split-K and no atomics. The tile shape
  (:data:`~rl_kernel_core.triton.tuning.MATMUL_TILES`) depends on the dtype only, never on the row
  count N, so a row's bits do not depend on N, on its position or on the other rows (the
  tensor-core MMA computes each output element from its own row and column).
* Two kernels compute the same product: the pointer kernel (``_persistent_matmul_kernel``) and,
  for 16-bit inputs on Hopper or later from :data:`~rl_kernel_core.triton.tuning.TMA_MIN_ROWS`
  rows (or a weight gradient's column-major ``g.T`` from
  :data:`~rl_kernel_core.triton.tuning.TMA_MIN_WEIGHT_GRAD_K` summed rows), the TMA kernel
  (``_tma_matmul_kernel``: tensor-memory loads, the tile loop flattened into the k loop so the next
  tile's loads overlap this tile's epilogue), faster there. Both take the
  same ``BLOCK_M x BLOCK_N`` blocks through the same ``BLOCK_K`` steps into one fp32 accumulator,
  and the tensor-core MMA gives each element from its own row and column, so their bits are equal;
  a GPU test asserts it (``tests/core/batch_invariant_mode/test_bi_matmul.py``), since the row count picks the
  kernel. An operand whose layout TMA cannot describe (a stride that is not a multiple of 16
  bytes, an unaligned base) is copied into one it can. The k tail past K reads zeros in both.
  A weight gradient (column-major ``g.T``), whose rows are the layer's features and whose
  reduction is the batch, may take a narrower tile of the same ``BLOCK_K`` on the TMA kernel, by
  the layer's shape (:func:`tma_tile`): the same k steps, the same bits (asserted on the GPU).
* The row reductions run one program per row over ``BLOCK`` columns at a time, in ascending
  order, with the same ``BLOCK`` for every N: the mean and the log-sum-exp of a row are the same
  sequence of fp32 operations whatever else is in the call.

Launches: where :mod:`rl_kernel_core.batch_invariant_mode.triton_launch` serves a call (a CUDA tensor, the
kernel's own tile and choice, a specialization seen before), ``matmul_forward`` and the row pass
launch the Triton-compiled kernel from C++ (the same cubin, grid and arguments, so the same bits);
otherwise through Triton, which then hands the compiled kernel to it.

Accumulation is fp32 (fp32 inputs use IEEE fp32 products, not TF32); outputs keep the input dtype.
fp64 inputs are left to the torch backend (``supports`` says so). Gradients: the matmul's input
gradient is itself a batch-invariant product; weight gradients (a sum over rows) and the
reductions' gradients are plain PyTorch, correct but not batch-invariant.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rl_kernel_core import dispatch
from rl_kernel_core.batch_invariant_mode import triton_launch as native_launch
from rl_kernel_core.triton._autograd import records_graph
from rl_kernel_core.triton._jit import interpreting, launch_time_jit
from rl_kernel_core.triton._matmul_helpers import dot_acc, grouped_tile, tile_product
from rl_kernel_core.triton.tuning import (
    COMPACT_MATMUL_TILES,
    INTERPRETED_ROW_BLOCK,
    MATMUL_GROUP_M,
    MATMUL_INTERPRETED_TILES,
    MATMUL_TILES,
    ROW_BLOCK,
    TMA_MATMUL_TILES,
    TMA_WEIGHT_GRAD_NARROW_TILES,
    TMA_MIN_ROWS,
    TMA_MIN_ROWS_INTERPRETED,
    TMA_MIN_WEIGHT_GRAD_K,
)

MATMUL_KERNELS = "bi_matmul"
"""The name under which :func:`matmul_forward`'s launches record their route
(:func:`rl_kernel_core.dispatch.ran`): ``"triton+cpp_launch"`` where the C++ launcher served one,
else ``"triton"``; a launch under torch.compile, the interpreter or a ``tile``/``tma`` override
records none."""

ROW_KERNELS = "bi_row_stats"
"""Likewise for the row reductions' launches (the mean, log-softmax, log-sum-exp and RMS norm)."""


@launch_time_jit(do_not_specialize=["M"])  # N=1 must not compile another kernel
def _persistent_matmul_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    n_progs,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``c[M, N] = a[M, K] @ b[K, N] (+ bias[N])``; program i takes tiles i, i + n_progs, ..."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, n_progs):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        # int64 rows and columns: an [M, N] output (the LM head's logits) passes 2**31 elements
        rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tile_product(
            a_ptr,
            b_ptr,
            rm,
            rn,
            M,
            N,
            K,
            stride_am,
            stride_ak,
            stride_bk,
            stride_bn,
            IEEE,
            UPCAST_DOT,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


@launch_time_jit(do_not_specialize=["M"])
def _tma_matmul_kernel(
    a_desc,
    b_desc,
    bias_ptr,
    c_desc,
    c_ptr,
    M,
    N,
    K,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    A_TRANS: tl.constexpr,
    B_TRANS: tl.constexpr,
    C_DESC: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``c[M, N] = a[M, K] @ b[K, N] (+ bias[N])`` from tensor descriptors. ``a_desc``: ``a``
    (``[M, K]`` blocks) or, with ``A_TRANS``, ``a.T`` (``[K, M]`` blocks); ``b_desc``: ``b.T``
    (``[N, K]`` blocks) or, with ``B_TRANS``, ``b`` (``[K, N]`` blocks). ``c_desc`` (``C_DESC``)
    stores half-tiles ``[BLOCK_M, BLOCK_N // 2]``; without it ``c_ptr`` takes masked stores."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # the epilogue recomputes its tile from its own counter so the flattened loop's next-tile
    # prologue does not carry values into this tile's epilogue
    tile_c = tl.program_id(0) - NUM_PROGS
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS, flatten=True):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if A_TRANS:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_TRANS:
                b = b_desc.load([off_k, off_n])
            else:
                b = b_desc.load([off_n, off_k]).T
            acc = dot_acc(a, b, acc, UPCAST_DOT, UPCAST_DOT)  # the interpreter's upcast operands need IEEE products
        tile_c += NUM_PROGS
        pid_m, pid_n = grouped_tile(tile_c, num_pid_m, num_pid_n, GROUP_M)
        rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if C_DESC:
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left.to(c_ptr.dtype.element_ty))
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], right.to(c_ptr.dtype.element_ty))
        else:
            rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(
                c_ptr + rm[:, None] * stride_cm + rn[None, :],
                acc.to(c_ptr.dtype.element_ty),
                mask=(rm[:, None] < M) & (rn[None, :] < N),
            )


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pipeline_bytes(tile: tuple[int, int, int, int, int], dtype: torch.dtype) -> int:
    bm, bn, bk, _, stages = tile
    return stages * (bm * bk + bk * bn) * dtype.itemsize


def shared_memory_per_block(device: torch.device) -> int:
    """The most shared memory one block of ``device`` can use, in bytes (0 where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


@functools.cache
def matmul_tile(dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int, int]:
    """The tile the pointer kernel uses for ``dtype`` on ``device``:
    :data:`~rl_kernel_core.triton.tuning.MATMUL_TILES`' where its pipeline fits the device's shared
    memory, else :data:`~rl_kernel_core.triton.tuning.COMPACT_MATMUL_TILES`'. A function of the
    dtype and the device only, never of the call's shape."""
    tile = MATMUL_TILES[dtype]
    return tile if _pipeline_bytes(tile, dtype) <= shared_memory_per_block(device) else COMPACT_MATMUL_TILES[dtype]


@functools.cache
def _cuda_uses_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def uses_tma(
    dtype: torch.dtype,
    device: torch.device,
    rows: int,
    interpreted: Optional[bool] = None,
    *,
    k: int = 0,
    a_column_major: bool = False,
) -> bool:
    """Whether ``matmul_forward`` runs the TMA kernel for a ``rows``-row product over ``k`` in
    ``dtype`` on ``device``: 16-bit inputs on Hopper or later (and under the interpreter) from
    :data:`~rl_kernel_core.triton.tuning.TMA_MIN_ROWS` rows, or with a column-major left operand
    (``a_column_major``: a weight gradient) from
    :data:`~rl_kernel_core.triton.tuning.TMA_MIN_WEIGHT_GRAD_K`; else the pointer kernel, which gives
    the same bits. ``interpreted``: :func:`interpreting`'s answer, where the caller has it."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    if interpreting() if interpreted is None else interpreted:
        return rows >= TMA_MIN_ROWS_INTERPRETED or (a_column_major and k >= TMA_MIN_ROWS_INTERPRETED)
    return (
        device.type == "cuda"
        and _cuda_uses_tma(device)
        and (rows >= TMA_MIN_ROWS or (a_column_major and k >= TMA_MIN_WEIGHT_GRAD_K))
    )


_TMA_ALIGN_BYTES = 16


def _tma_operand(x: torch.Tensor, rows_block: int, k_block: int) -> tuple[TensorDescriptor, bool]:
    """A descriptor of ``x [R, K]`` and whether it describes ``x.T`` (``[k_block, rows_block]``
    blocks) rather than ``x`` (``[rows_block, k_block]``). A layout TMA cannot read (a stride that
    is not a multiple of 16 bytes, an unaligned base) is copied into a row-major buffer whose rows
    are padded to 16 bytes; the descriptor keeps the shape ``[R, K]``, so the padding is never read."""
    r, k = x.shape
    align = _TMA_ALIGN_BYTES // x.element_size()
    if x.data_ptr() % _TMA_ALIGN_BYTES == 0:
        if x.stride(1) == 1 and x.stride(0) % align == 0:
            return TensorDescriptor(x, [r, k], [x.stride(0), 1], [rows_block, k_block]), False
        if x.stride(0) == 1 and x.stride(1) % align == 0:
            return TensorDescriptor(x, [k, r], [x.stride(1), 1], [k_block, rows_block]), True
    row = -(-k // align) * align
    buf = torch.empty((r, row), dtype=x.dtype, device=x.device)
    buf[:, :k].copy_(x)
    return TensorDescriptor(buf, [r, k], [row, 1], [rows_block, k_block]), False


def _n_programs(tiles: int, device: torch.device) -> int:
    return min(tiles, _program_slots(device))


def _program_slots(device: torch.device) -> int:
    return _sm_count(device) if device.type == "cuda" else 4


def tma_tile(dtype: torch.dtype, m: int, n: int, a_column_major: bool, slots: int) -> tuple[int, int, int, int, int]:
    """The TMA kernel's tile for an ``[m, n]`` product of ``dtype`` on a device of ``slots``
    programs: :data:`~rl_kernel_core.triton.tuning.TMA_MATMUL_TILES`', or for a weight gradient
    (``a_column_major``) :data:`~rl_kernel_core.triton.tuning.TMA_WEIGHT_GRAD_NARROW_TILES`' where its
    programs fill their waves fuller (a tie keeps the wide tile). Chosen from the layer's
    ``[m, n]`` only: a weight gradient's rows are the layer's features and its reduction the batch."""
    wide = TMA_MATMUL_TILES[dtype]
    if not a_column_major:
        return wide
    narrow = TMA_WEIGHT_GRAD_NARROW_TILES[dtype]
    tiles_w = -(-m // wide[0]) * -(-n // wide[1])
    tiles_n = -(-m // narrow[0]) * -(-n // narrow[1])
    # fill = tiles / (waves * slots); narrow fills fuller iff tiles_n * waves_w > tiles_w * waves_n
    return narrow if tiles_n * -(-tiles_w // slots) > tiles_w * -(-tiles_n // slots) else wide


def _tile_for(
    a: torch.Tensor,
    n: int,
    tma: bool,
    tile: Optional[tuple[int, int, int, int, int]],
    interpreted: bool,
    a_column_major: bool,
) -> tuple[tuple[int, int, int], dict]:
    if interpreted:
        return MATMUL_INTERPRETED_TILES, {}
    if tile is None:
        tile = (
            tma_tile(a.dtype, a.shape[0], n, a_column_major, _program_slots(a.device))
            if tma
            else matmul_tile(a.dtype, a.device)
        )
    bm, bn, bk, warps, stages = tile
    return (bm, bn, bk), {"num_warps": warps, "num_stages": stages}


def matmul_forward(
    a: torch.Tensor,
    b_t: torch.Tensor,
    bias: Optional[torch.Tensor],
    tile: Optional[tuple[int, int, int, int, int]] = None,
    tma: Optional[bool] = None,
) -> torch.Tensor:
    """``a [M, K] @ b_t.T (+ bias)`` for ``b_t [N, K]`` (any strides): ``[M, N]`` in a's dtype, no
    autograd. For sweeps and kernel comparisons only: ``tma``, the kernel in place of
    :func:`uses_tma`'s choice; ``tile``, a ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` in
    place of the kernel's own (each fixed tile is batch-invariant on its own)."""
    interpreted = interpreting()
    # torch.compile traces Triton launches, not the extension's: it keeps Triton's launcher
    planned = tile is None and tma is None and not interpreted and a.is_cuda and not torch.compiler.is_compiling()
    if planned:
        out = native_launch.matmul(a, b_t, bias)
        dispatch.ran(MATMUL_KERNELS, "triton" if out is None else "triton+cpp_launch")
        if out is not None:
            return out
    m, k = a.shape
    n = b_t.shape[0]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    a_column_major = a.stride(0) == 1 and a.stride(1) != 1
    if tma is None:
        tma = uses_tma(a.dtype, a.device, m, interpreted, k=k, a_column_major=a_column_major)
    (bm, bn, bk), extra = _tile_for(a, n, tma, tile, interpreted, a_column_major)
    progs = _n_programs(
        -(-m // bm) * -(-n // bn), a.device
    )  # ceil divisions (triton.cdiv costs a dispatch on the host)
    if planned:
        _configure_native_launch(a.dtype, a.device)
    if tma:
        a_desc, a_trans = _tma_operand(a, bm, bk)
        b_desc, b_t_trans = _tma_operand(b_t, bn, bk)
        c_desc = (
            TensorDescriptor(out, [m, n], [n, 1], [bm, bn // 2])
            if n % (_TMA_ALIGN_BYTES // out.element_size()) == 0
            else None
        )
        kernel = _tma_matmul_kernel
        compiled = kernel[(progs,)](
            a_desc,
            b_desc,
            bias if bias is not None else a,
            c_desc,
            out,
            m,
            n,
            k,
            out.stride(0),
            HAS_BIAS=bias is not None,
            UPCAST_DOT=interpreted,
            A_TRANS=a_trans,
            B_TRANS=b_t_trans,
            C_DESC=c_desc is not None,
            NUM_PROGS=_program_slots(a.device),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            GROUP_M=MATMUL_GROUP_M,
            **extra,
        )
    else:
        kernel = _persistent_matmul_kernel
        compiled = kernel[(progs,)](
            a,
            b_t,
            bias if bias is not None else a,
            out,
            m,
            n,
            k,
            a.stride(0),
            a.stride(1),
            b_t.stride(1),
            b_t.stride(0),
            out.stride(0),
            out.stride(1),
            progs,
            HAS_BIAS=bias is not None,
            IEEE=a.dtype == torch.float32 or interpreted,
            UPCAST_DOT=interpreted,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            GROUP_M=MATMUL_GROUP_M,
            **extra,
        )
    if planned:
        native_launch.remember_matmul(kernel, compiled, a, b_t, bias, out, tma, progs, (bm, bn))
    return out


def _configure_native_launch(dtype: torch.dtype, device: torch.device) -> None:
    """Hand :mod:`~rl_kernel_core.batch_invariant_mode.triton_launch` this module's tiles and kernel rule for ``(device, dtype)``."""
    if native_launch.extension() is None:
        return
    pointer = matmul_tile(dtype, device)
    tma, narrow = TMA_MATMUL_TILES.get(dtype, (0, 0)), TMA_WEIGHT_GRAD_NARROW_TILES.get(dtype, (0, 0))
    native_launch.configure_matmul(
        device,
        dtype,
        pointer[:2],
        tma[:2],
        narrow[:2],
        tma_capable=uses_tma(dtype, device, TMA_MIN_ROWS, False),
        tma_min_rows=TMA_MIN_ROWS,
        tma_min_weight_grad_k=TMA_MIN_WEIGHT_GRAD_K,
        program_slots=_program_slots(device),
    )


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return matmul_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        dx = matmul_forward(grad, weight.t(), None) if ctx.needs_input_grad[0] else None
        dw = grad.t() @ x if ctx.needs_input_grad[1] else None
        db = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def _supports(x: torch.Tensor, *args, **kwargs) -> Optional[str]:
    if x.dtype == torch.float64:
        return "the triton kernels accumulate in fp32; fp64 inputs need the torch backend"
    return None


@dispatch.register("bi_linear", "triton", supports=_supports, kernels=MATMUL_KERNELS)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [N, K] @ weight [M, K].T + bias [M]`` with the persistent kernel: ``[N, M]`` in x's dtype."""
    return _Linear.apply(x, weight, bias) if records_graph(x, weight, bias) else matmul_forward(x, weight, bias)


@dispatch.register("bi_matmul", "triton", supports=_supports, kernels=MATMUL_KERNELS)
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [N, K] @ b [K, M]`` (any strides) with the persistent kernel: ``[N, M]`` in a's dtype."""
    return _Linear.apply(a, b.t(), None) if records_graph(a, b) else matmul_forward(a, b.t(), None)


@launch_time_jit
def _row_stats_kernel(x_ptr, out_ptr, L, stride_row, eps, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row. MODE 0: mean -> out[row]; 1: log-softmax -> out[row, :];
    2: rsqrt(mean(x^2) + eps) -> out[row] (fp32); 3: log-sum-exp -> out[row]. Modes 1 and 3 share
    one lse computation, so ``log_softmax(x)`` is ``x - logsumexp(x)`` bit for bit."""
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK)
    if MODE == 1 or MODE == 3:
        m_vec = tl.full((BLOCK,), float("-inf"), tl.float32)
        s_vec = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, L, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < L, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m_vec, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_vec = s_vec * tl.exp(m_vec - m_safe) + tl.exp(x - m_safe)
            m_vec = m_new
        m = tl.max(m_vec, 0)
        m_row = tl.where(m == float("-inf"), 0.0, m)
        lse = m_row + tl.log(tl.sum(s_vec * tl.exp(m_vec - m_row), 0))
        if MODE == 3:
            tl.store(out_ptr + row, lse.to(out_ptr.dtype.element_ty))
        else:
            out_base = out_ptr + row.to(tl.int64) * L
            for start in range(0, L, BLOCK):
                x = tl.load(base + start + cols, mask=start + cols < L, other=0.0).to(tl.float32)
                tl.store(out_base + start + cols, (x - lse).to(out_ptr.dtype.element_ty), mask=start + cols < L)
    else:
        acc = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, L, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < L, other=0.0).to(tl.float32)
            if MODE == 2:
                acc += x * x
            else:
                acc += x
        total = tl.sum(acc, 0) / L
        if MODE == 2:
            tl.store(out_ptr + row, 1.0 / tl.sqrt(total + eps))
        else:
            tl.store(out_ptr + row, total.to(out_ptr.dtype.element_ty))


def _row_pass(x: torch.Tensor, mode: int, eps: float = 0.0) -> torch.Tensor:
    rows, width = x.shape
    if mode == 1:
        out = torch.empty_like(x)
    else:
        out = torch.empty(rows, dtype=torch.float32 if mode == 2 else x.dtype, device=x.device)
    if rows and width:
        interpreted = interpreting()
        planned = not interpreted and x.is_cuda and not torch.compiler.is_compiling()
        if planned:
            served = native_launch.row_stats(x, out, mode, eps) is not None
            dispatch.ran(ROW_KERNELS, "triton+cpp_launch" if served else "triton")
            if served:
                return out
        compiled = _row_stats_kernel[(rows,)](
            x, out, width, x.stride(0), float(eps), MODE=mode, BLOCK=INTERPRETED_ROW_BLOCK if interpreted else ROW_BLOCK
        )
        if planned:
            native_launch.remember_row_stats(_row_stats_kernel, compiled, x, out, mode, float(eps))
    elif rows and mode == 0:
        out.fill_(float("nan"))  # an empty mean, as in torch
    return out


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = _row_pass(x, 1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        g = grad.float()
        return (g - y.float().exp() * g.sum(-1, keepdim=True)).to(y.dtype)


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        lse = _row_pass(x, 3)
        ctx.save_for_backward(x, lse)
        return lse

    @staticmethod
    def backward(ctx, grad):
        x, lse = ctx.saved_tensors
        return (grad.float()[:, None] * (x.float() - lse.float()[:, None]).exp()).to(x.dtype)


class _Mean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return _row_pass(x, 0)

    @staticmethod
    def backward(ctx, grad):
        return (grad[:, None] / ctx.shape[1]).expand(ctx.shape).to(grad.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = _row_pass(x, 2, eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd[:, None] * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xf, g, w = x.float(), grad.float(), weight.float()
        xhat = xf * rstd[:, None]
        gw = g * w
        dx = rstd[:, None] * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        dw = (g * xhat).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


@dispatch.register("bi_log_softmax", "triton", supports=_supports, kernels=ROW_KERNELS)
def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax of ``x [N, L]`` over L: fp32 online max/sum, in x's dtype."""
    return _LogSoftmax.apply(x) if records_graph(x) else _row_pass(x, 1)


@dispatch.register("bi_logsumexp", "triton", supports=_supports, kernels=ROW_KERNELS)
def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp of ``x [N, L]`` -> ``[N]`` in x's dtype: the fp32 lse that
    :func:`log_softmax` subtracts, bit for bit."""
    return _LogSumExp.apply(x) if records_graph(x) else _row_pass(x, 3)


@dispatch.register("bi_mean", "triton", supports=_supports, kernels=ROW_KERNELS)
def mean(x: torch.Tensor) -> torch.Tensor:
    """Row-wise mean of ``x [N, L]`` -> ``[N]`` in x's dtype, accumulated in fp32."""
    return _Mean.apply(x) if records_graph(x) else _row_pass(x, 0)


@dispatch.register("rms_norm", "triton", supports=_supports, kernels=ROW_KERNELS)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [N, H] * rsqrt(mean(x^2) + eps) * weight [H]`` in fp32, one rounding to x's dtype."""
    return _RMSNorm.apply(x, weight, eps)
