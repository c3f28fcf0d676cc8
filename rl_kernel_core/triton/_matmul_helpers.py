"""Device functions shared by the Triton matrix-product kernels (the linear log-prob passes, the batch-invariant matmul and attention)."""

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
