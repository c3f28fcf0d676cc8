"""Plain-PyTorch reference of the batch-invariant ops (backend ``torch``): the semantics oracle.

Why results drift with the batch size: a library kernel (BLAS GEMM, a reduction) picks its
blocking, split-K and thread partition from the *shape* of the call, so one row's dot products or
sums are accumulated in a different order when the number of rows changes. On this project's CPU CI
machine ``(a[:1] @ b)`` already differs in the last bits from ``(a @ b)[:1]`` in fp32, and a
``mean`` over a single long row is split across threads while the same row inside a larger batch
is not.

The fix used here: :func:`row_tiled` feeds every kernel fixed-shape tiles of :data:`ROW_TILE` rows
(the last tile zero-padded to full size), so every library call an op makes has the same shape
whatever N is. A row's result then depends only on the row, the other operands (weights) and its
position inside its tile, and a fixed-shape GEMM or row-wise reduction computes every row of one
call with the same reduction order. The tests check this bit for bit (rows at other positions and
batch sizes N = 1, 7, 64, 300); it is the property, not any particular kernel, that a GPU kernel
for this mode must reproduce. The cost is up to ``ROW_TILE - 1`` padded rows of work per call.

A fixed shape alone does not make a CPU GEMM treat its rows alike: MKL rounds some rows of one
call by their place in the tile for a ``[K, M]``-layout right operand with a narrow or odd M (fp32:
M = 5-7, 9-11; fp64: most odd M) and for an odd K in either layout. The products therefore all take
the ``x @ W.T`` layout (``W [M, K]`` contiguous) with K zero-padded to a multiple of
:data:`PRODUCT_K_MULTIPLE`, where every row of a call is computed alike
(``tests/core/batch_invariant_mode/test_bi_matmul.py`` draws the shapes).

Accumulation: fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 inputs (GEMMs accumulate as the
library does for the input dtype, which is fp32 for bf16/fp16 in PyTorch). Outputs keep the input
dtype, as the torch ops they replace do. All ops are differentiable through plain autograd; the
backward passes are correct but are not themselves batch-invariant.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch
import torch.nn.functional as F

from rl_kernel_core import dispatch

ROW_TILE: int = 32
"""Rows per library call in every batch-invariant reference op."""

PRODUCT_K_MULTIPLE: int = 16
"""Every reference product's reduction length K is zero-padded to a multiple of this."""

Outputs = TypeVar("Outputs", torch.Tensor, tuple[torch.Tensor, ...])
"""What a row-wise function of :func:`row_tiled` returns: a tensor or a tuple of tensors."""


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for a floating input dtype: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


def row_tiled(fn: Callable[..., Outputs], *tensors: torch.Tensor, tile: int = ROW_TILE) -> Outputs:
    """Apply a row-wise ``fn`` to fixed-shape row tiles and concatenate the first N rows.

    Every tensor in ``tensors`` has the same leading dim N (its rows); ``fn`` receives the matching
    ``tile``-row slices, the last ones zero-padded to ``tile`` rows, and returns a tensor or a tuple
    of tensors whose leading dim is ``tile``. ``fn`` must treat rows independently (zero rows must
    not make it fail). N = 0 runs one padded tile so the outputs have the right dtype and trailing
    shape. Differentiable: padding and concatenation go through autograd.
    """
    n = tensors[0].shape[0]
    outs: list[Outputs] = []
    for start in range(0, max(n, 1), tile):
        outs.append(fn(*(_pad_rows(t[start : start + tile], tile) for t in tensors)))
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)[:n]
    return tuple(torch.cat(parts)[:n] for parts in zip(*outs))


def _product(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The row-wise ``t [T, K] -> t @ weight[M, K].T + bias [M]`` that every product tile runs:
    ``weight`` contiguous and K zero-padded to a multiple of :data:`PRODUCT_K_MULTIPLE` (see the
    module docstring; the padded terms add exact zeros)."""
    pad = -weight.shape[1] % PRODUCT_K_MULTIPLE
    weight = F.pad(weight, (0, pad)) if pad else weight.contiguous()
    if not pad:
        return lambda t: F.linear(t, weight, bias)
    return lambda t: F.linear(F.pad(t, (0, pad)), weight, bias)


@dispatch.register("bi_matmul", "torch")
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [N, K] @ b [K, M] -> [N, M]`` in fixed-shape row tiles (a's dtype); a and b any strides."""
    return row_tiled(_product(b.t(), None), a.contiguous())


@dispatch.register("bi_linear", "torch")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [N, K] @ weight[M, K].T + bias [M] -> [N, M]`` in fixed-shape row tiles."""
    return row_tiled(_product(weight, bias), x.contiguous())


@dispatch.register("bi_grouped_linear", "torch")
def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rows [R, K]`` sorted by expert (``counts [E]``: expert 0's rows first) times each row's
    expert's ``weight [E, N, K]`` transposed -> ``[R, N]``: :func:`linear` over each expert's rows
    (reads the counts to the host)."""
    parts, start = [], 0
    for e, count in enumerate(counts.tolist()):
        if count:
            parts.append(linear(rows[start : start + count], weight[e], None))
        start += count
    return torch.cat(parts) if parts else rows.new_empty((rows.shape[0], weight.shape[1]))


@dispatch.register("bi_log_softmax", "torch")
def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-softmax of ``x [N, L]`` (over L): ``x - lse`` with :func:`logsumexp`'s lse,
    accumulated in :func:`acc_dtype`, in x's dtype."""
    acc = acc_dtype(x.dtype)

    def tile(t: torch.Tensor) -> torch.Tensor:
        ta = t.to(acc)
        return (ta - torch.logsumexp(ta, dim=-1, keepdim=True)).to(x.dtype)

    return row_tiled(tile, x)


@dispatch.register("bi_logsumexp", "torch")
def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-sum-exp of ``x [N, L]`` (over L) -> ``[N]``, accumulated in :func:`acc_dtype`,
    in x's dtype: the lse :func:`log_softmax` subtracts."""
    acc = acc_dtype(x.dtype)
    return row_tiled(lambda t: torch.logsumexp(t.to(acc), dim=-1).to(x.dtype), x)


@dispatch.register("bi_mean", "torch")
def mean(x: torch.Tensor) -> torch.Tensor:
    """Row-wise mean of ``x [N, L]`` (over L) -> ``[N]``, accumulated in :func:`acc_dtype`, in x's dtype."""
    acc = acc_dtype(x.dtype)
    return row_tiled(lambda t: t.to(acc).mean(dim=-1).to(x.dtype), x)


@dispatch.register("rms_norm", "torch")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [N, H] * rsqrt(mean(x^2) + eps) * weight [H]``: computed in :func:`acc_dtype`, one
    rounding to x's dtype at the end (the weight multiplies the fp32 normalised value)."""
    acc = acc_dtype(x.dtype)
    w = weight.to(acc)

    def tile(t: torch.Tensor) -> torch.Tensor:
        tf = t.to(acc)
        inv = torch.rsqrt(tf.pow(2).mean(dim=-1, keepdim=True) + eps)
        return (tf * inv * w).to(x.dtype)

    return row_tiled(tile, x)
