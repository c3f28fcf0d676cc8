"""Device functions shared by the Triton matrix-product kernels (the linear log-prob passes, the batch-invariant
matmul, its grouped MoE products and attention)."""

from __future__ import annotations

import triton.language as tl

from rl_kernel_core.triton._jit import helper_jit


@helper_jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of work unit ``pid`` in grouped order: ``GROUP_M`` row blocks sweep the
    columns together, so their column operand's tiles share L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@helper_jit
def dot_acc(a, b, acc, IEEE: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation: IEEE fp32 products for fp32 operands (``IEEE``, not
    TF32); ``UPCAST_DOT`` under the CPU interpreter, which multiplies 16-bit floats as integers
    (the upcast is exact)."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@helper_jit
def tile_product(
    a_ptr,
    b_ptr,
    rm,
    rn,
    rows_end,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The fp32 ``[BLOCK_M, BLOCK_N]`` tile ``a[rm, :] @ b[:, rn]``, accumulated over K in
    ascending ``BLOCK_K`` steps (:func:`dot_acc`); rows from ``rows_end``, columns from ``N`` and
    k from ``K`` read as zeros."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
            mask=(rm[:, None] < rows_end) & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=(kk[:, None] < K) & (rn[None, :] < N),
            other=0.0,
        )
        acc = dot_acc(a, b, acc, IEEE, UPCAST_DOT)
    return acc
