"""Triton kernels for ``logprob_from_logits``: log p(target) and entropy from logits a framework holds.

Math (``z = logits / temperature`` in fp32, one row at a time):

* forward, one read of the row: an online log-sum-exp over V in blocks of ``BLOCK_V``. With ``m``
  the running max, ``s = sum exp(z - m)`` and ``u = sum exp(z - m) * (z - m)``, a new block with
  max ``m'`` updates ``s' = s * exp(m - m') + sum_block exp(z - m')`` and
  ``u' = exp(m - m') * (u + s * (m - m')) + sum_block exp(z - m') * (z - m')``. At the end
  ``lse = m + log s``, ``logprob = z[target] - lse`` and ``entropy = log s - u / s`` (the entropy
  is formed from quantities relative to the row max, so large logits do not cancel).
* backward, one more read: ``p = exp(z - lse)`` is recomputed from the logits and the saved
  ``lse``; ``dz = g_lp * (onehot(target) - p) - g_ent * p * (z - lse + entropy)`` and
  ``dlogits = dz / temperature``, written in the logits' dtype.

Logits are read in their own dtype (bf16/fp16/fp32), never copied to fp32. Rows whose target is
``ignore_index`` skip the read entirely: log-prob 0, entropy 0, gradient 0. Every reduction runs in
a fixed order inside one program, so results are bitwise reproducible and a row's values do not
depend on N or on other rows.

The launchers take already-validated tensors (argument checks live in
:mod:`rl_kernel_core.logprob.api`); :func:`logprob_from_logits` is the backend implementation
dispatch registers, over the custom ops ``rl_kernel::triton_logprob_from_logits`` and its
backward (:mod:`rl_kernel_core.logprob.opdef`).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.logprob import opdef
from rl_kernel_core.triton._jit import helper_jit, launch_time_jit
from rl_kernel_core.triton.tuning import FWD_TILE, LOGPROB_MAX_BLOCK_V


def _block_v(vocab: int, largest: int = LOGPROB_MAX_BLOCK_V) -> int:
    return min(largest, triton.next_power_of_2(max(vocab, 16)))


@helper_jit
def online_softmax_stats(base, stride_lv, V, inv_temp, WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """``(m, s, u)`` of one row ``z = logits * inv_temp`` read at ``base``: the max, ``sum exp(z - m)``
    and ``sum exp(z - m) * (z - m)`` (0 unless ``WITH_ENTROPY``), by the online recurrence above.

    Every kernel that needs a row's log-sum-exp calls this one function with the same
    ``BLOCK_V``/``num_warps``, so the statistics (and the log-probs formed from them) have the same
    bits in each. ``-inf`` logits have probability 0; a row of only ``-inf`` gives ``m = -inf``, ``s = 0``.
    """
    offs = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    u = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        valid = cols < V
        z = tl.load(base + cols * stride_lv, mask=valid, other=-float("inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # a reference point that is finite while every value so far is -inf (exp(-inf - -inf) is NaN)
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
        e = tl.exp(z - m_ref)
        alpha = tl.exp(m - m_ref)
        if WITH_ENTROPY:
            # s == 0 only while every value so far is -inf, where m - m_new is -inf or NaN
            shift = s * tl.where(s > 0.0, m - m_new, 0.0)
            u = alpha * (u + shift) + tl.sum(tl.where(e > 0.0, e * (z - m_new), 0.0), axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    return m, s, u


@launch_time_jit
def _logprob_fwd_kernel(
    logits_ptr,
    stride_ln,
    stride_lv,
    targets_ptr,
    stride_t,
    logprob_ptr,
    entropy_ptr,
    lse_ptr,
    V,
    inv_temp,
    ignore_index,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row * stride_t).to(tl.int64)
    if target == ignore_index:
        tl.store(logprob_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)
    else:
        base = logits_ptr + row * stride_ln
        m, s, u = online_softmax_stats(base, stride_lv, V, inv_temp, WITH_ENTROPY, BLOCK_V)
        log_s = tl.log(s)
        lse = m + log_s
        z_t = tl.load(base + target * stride_lv).to(tl.float32) * inv_temp
        tl.store(logprob_ptr + row, z_t - lse)
        tl.store(lse_ptr + row, lse)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, log_s - u / s)


@launch_time_jit
def _logprob_bwd_kernel(
    logits_ptr,
    stride_ln,
    stride_lv,
    targets_ptr,
    stride_t,
    lse_ptr,
    entropy_ptr,
    grad_lp_ptr,
    stride_glp,
    grad_ent_ptr,
    stride_gent,
    grad_logits_ptr,
    stride_gn,
    V,
    inv_temp,
    ignore_index,
    WITH_LOGPROB_GRAD: tl.constexpr,
    WITH_ENTROPY_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < V
    out = grad_logits_ptr + row * stride_gn + cols
    target = tl.load(targets_ptr + row * stride_t).to(tl.int64)
    if target == ignore_index:
        tl.store(out, tl.zeros([BLOCK_V], dtype=tl.float32).to(grad_logits_ptr.dtype.element_ty), mask=valid)
    else:
        z = tl.load(logits_ptr + row * stride_ln + cols * stride_lv, mask=valid, other=0.0).to(tl.float32) * inv_temp
        log_p = tl.where(valid, z - tl.load(lse_ptr + row), 0.0)
        p = tl.where(valid, tl.exp(log_p), 0.0)
        dz = tl.zeros([BLOCK_V], dtype=tl.float32)
        if WITH_LOGPROB_GRAD:
            g_lp = tl.load(grad_lp_ptr + row * stride_glp)
            dz = tl.where(cols == target, g_lp, 0.0) - g_lp * p
        if WITH_ENTROPY_GRAD:
            g_ent = tl.load(grad_ent_ptr + row * stride_gent)
            # p = 0 (a -inf logit) contributes 0, not 0 * -inf
            dz -= tl.where(p > 0.0, g_ent * p * (log_p + tl.load(entropy_ptr + row)), 0.0)
        tl.store(out, (dz * inv_temp).to(grad_logits_ptr.dtype.element_ty), mask=valid)


def logprob_fwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    tile: tuple[int, int] = FWD_TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward pass.

    Args:
        logits: ``[N, V]`` fp32/bf16/fp16, any strides.
        targets: ``[N]`` integer ids in ``[0, V)`` or ``ignore_index``.
        temperature: the logits are divided by it.
        ignore_index: rows with this target give 0 and are not read.
        with_entropy: also compute the entropy of each row's tempered distribution.
        tile: ``(largest BLOCK_V, num_warps)``; :data:`~rl_kernel_core.triton.tuning.FWD_TILE`
            unless a tuning sweep asks.

    Returns:
        ``(logprob [N] fp32, entropy [N] fp32 or [0] when not requested, lse [N] fp32)``; ``lse``
        is the tempered log-sum-exp the backward needs (0 on ignored rows).
    """
    n, vocab = logits.shape
    dev = logits.device
    logprob = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=dev)
    if n == 0:
        return logprob, entropy, lse
    _logprob_fwd_kernel[(n,)](
        logits,
        logits.stride(0),
        logits.stride(1),
        targets,
        targets.stride(0),
        logprob,
        entropy if with_entropy else logprob,
        lse,
        vocab,
        1.0 / temperature,
        ignore_index,
        WITH_ENTROPY=with_entropy,
        BLOCK_V=_block_v(vocab, tile[0]),
        num_warps=tile[1],
    )
    return logprob, entropy, lse


def logprob_bwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprob: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    temperature: float,
    ignore_index: int,
) -> torch.Tensor:
    """Backward pass: the gradient w.r.t. ``logits``, ``[N, V]`` contiguous in the logits' dtype.

    ``grad_logprob``/``grad_entropy`` are ``[N]`` (any strides, e.g. expanded) or None when that
    output gets no gradient; ``lse``/``entropy`` are what :func:`logprob_fwd` returned.
    """
    n, vocab = logits.shape
    grad_logits = torch.empty((n, vocab), dtype=logits.dtype, device=logits.device)
    if n == 0:
        return grad_logits
    block = _block_v(vocab)
    with_lp = grad_logprob is not None
    with_ent = grad_entropy is not None
    grad_lp = lse if grad_logprob is None else grad_logprob.to(torch.float32)
    grad_ent = lse if grad_entropy is None else grad_entropy.to(torch.float32)
    _logprob_bwd_kernel[(n, triton.cdiv(vocab, block))](
        logits,
        logits.stride(0),
        logits.stride(1),
        targets,
        targets.stride(0),
        lse,
        entropy if with_ent else lse,
        grad_lp,
        grad_lp.stride(0),
        grad_ent,
        grad_ent.stride(0),
        grad_logits,
        grad_logits.stride(0),
        vocab,
        1.0 / temperature,
        ignore_index,
        WITH_LOGPROB_GRAD=with_lp,
        WITH_ENTROPY_GRAD=with_ent,
        BLOCK_V=block,
        num_warps=8,
    )
    return grad_logits


def _forward(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, ignore_index: int, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward custom op's body: :func:`logprob_fwd` with the registered tile."""
    return logprob_fwd(logits, targets, temperature, ignore_index, return_entropy)


logprob_from_logits = dispatch.register("logprob_from_logits", "triton", supports=opdef.supports("triton"))(
    opdef.define_logprob_from_logits("triton_logprob_from_logits", _forward, logprob_bwd)
)
