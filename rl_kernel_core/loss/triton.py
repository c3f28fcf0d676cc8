"""Triton kernels for ``ratio_kl`` and ``policy_loss``: one fused pass forward, one backward.

Semantics are :mod:`rl_kernel_core.loss.reference`'s (verl 0.9.1), computed in fp32:

* ``ratio = exp(clamp(logprob - old_logprob, ±20))``; KL estimators k1, abs, k2, k3 (``x =
  clamp(ref - logprob, ±20)``, ``clamp(eˣ - x - 1, ±10)``) and the ``+`` variants (the base
  estimator's value, k2's gradient ``logprob - ref``).
* ``pg = max(-A·r, -A·clip(r, 1-lo, 1+hi))``, dual clip ``min(pg, -A·c)`` where ``A < 0``, times
  the rollout IS weights; tokens outside the mask never enter a sum (not even as NaN).

Gradients follow PyTorch's autograd of that reference exactly, ties included: ``clamp`` passes
the gradient on its closed interval, ``maximum``/``minimum`` split it in halves on ties (which
for the surrogate means the unclipped branch carries it whenever ``-A·r >= -A·clip(r)``).

``ratio_kl`` is one elementwise kernel (``_ratio_kl_kernel``; ``BACKWARD`` selects the pass).
``policy_loss`` runs two forward launches and one backward launch, none with atomics:

1. ``_policy_loss_tokens_kernel`` (forward), grid ``(S, ceil(T / BLOCK_T))``: the per-token
   terms of one block of one sequence, reduced to 7 partial sums (pg, kl, entropy, mask weight,
   clipped, dual-clipped, -log-ratio) stored at ``partials[q, s, block]``.
2. ``_policy_loss_finish_kernel``, one program: sums the partials in a fixed order (per
   sequence, then over sequences), applies the aggregation mode and writes the loss, the six
   metrics, every sequence's mask weight and the two totals the backward needs (mask weight,
   non-empty sequences). Nothing leaves the device: metrics are 0-d tensors, no host sync.
3. ``_policy_loss_tokens_kernel`` (backward), grid as in 1: ``d loss / d logprob`` and
   ``d loss / d entropy`` per token from the recomputed terms, the sequence's aggregation scale
   and the upstream gradient, read from device memory.

The KL estimators' values and gradients are device functions (``_kl_value``, ``_kl_grad``)
shared by both ops' kernels. The reduction order depends only on ``(S, T)`` and the block sizes, so results are bitwise equal
run to run.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.loss_codes import AGG_CODES, KL_CODES, kl_code
from rl_kernel_core.loss import opdef
from rl_kernel_core.loss.opdef import LossSettings
from rl_kernel_core.loss.reference import LOG_RATIO_CLAMP, LOW_VAR_KL_CLAMP
from rl_kernel_core.triton._jit import helper_jit, launch_time_jit
from rl_kernel_core.triton.tuning import LOSS_ELEMENTWISE_BLOCK

# the reference's clamps, as compile-time constants of the kernels
_LRC: tl.constexpr = tl.constexpr(LOG_RATIO_CLAMP)
_KLC: tl.constexpr = tl.constexpr(LOW_VAR_KL_CLAMP)

_NUM_PARTIALS = 7  # the quantities q of partials[q, s, block] (a layout, not a tuning choice)


@helper_jit
def _kl_value(d_ref, k3, KL: tl.constexpr):
    """The estimator's value from ``d_ref = logprob - ref`` and ``k3 = eˣ - x - 1`` (x clamped)."""
    if KL == 0:
        kl = d_ref
    elif KL == 1:
        kl = tl.abs(d_ref)
    elif KL == 2:
        kl = 0.5 * d_ref * d_ref
    else:
        kl = tl.minimum(tl.maximum(k3, -_KLC), _KLC)
    return kl


@helper_jit
def _kl_grad(d_ref, ex, k3, KL: tl.constexpr, KL_PLUS: tl.constexpr):
    """``d kl / d logprob`` (``ex = eˣ``); the ``+`` variants take k2's gradient ``d_ref``."""
    if KL_PLUS or KL == 2:
        dkl = d_ref
    elif KL == 0:
        dkl = tl.full(d_ref.shape, 1.0, tl.float32)
    elif KL == 1:
        dkl = tl.where(d_ref > 0, 1.0, tl.where(d_ref < 0, -1.0, 0.0))
    else:
        passes = (k3 >= -_KLC) & (k3 <= _KLC) & (d_ref >= -_LRC) & (d_ref <= _LRC)
        dkl = tl.where(passes, 1.0 - ex, 0.0)
    return dkl


@launch_time_jit
def _ratio_kl_kernel(
    lp_ptr,
    old_ptr,
    ref_ptr,
    ratio_ptr,
    kl_ptr,
    g_ratio_ptr,
    g_kl_ptr,
    grad_ptr,
    n,
    KL: tl.constexpr,
    KL_PLUS: tl.constexpr,
    BACKWARD: tl.constexpr,
    HAS_G_RATIO: tl.constexpr,
    HAS_G_KL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Forward: ``ratio``, ``kl``. Backward: ``d/d logprob`` of ``sum(g_ratio·ratio + g_kl·kl)``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    lp = tl.load(lp_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    d_old = lp - tl.load(old_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    d_ref = lp - tl.load(ref_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    ratio = tl.exp(tl.minimum(tl.maximum(d_old, -_LRC), _LRC))
    # k3: x = clamp(ref - logprob, ±20), clamp(e^x - x - 1, ±10)
    x = tl.minimum(tl.maximum(-d_ref, -_LRC), _LRC)
    ex = tl.exp(x)
    k3 = ex - x - 1.0
    if not BACKWARD:
        kl = _kl_value(d_ref, k3, KL)
        tl.store(ratio_ptr + offs, ratio, mask=valid)
        tl.store(kl_ptr + offs, kl, mask=valid)
    else:
        grad = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_G_RATIO:
            g_ratio = tl.load(g_ratio_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            grad += tl.where((d_old >= -_LRC) & (d_old <= _LRC), g_ratio * ratio, 0.0)
        if HAS_G_KL:
            grad += tl.load(g_kl_ptr + offs, mask=valid, other=0.0).to(tl.float32) * _kl_grad(
                d_ref, ex, k3, KL, KL_PLUS
            )
        tl.store(grad_ptr + offs, grad, mask=valid)


@launch_time_jit
def _policy_loss_tokens_kernel(
    lp_ptr,
    old_ptr,
    adv_ptr,
    mask_ptr,
    ref_ptr,
    ent_ptr,
    w_ptr,
    partials_ptr,
    seq_weight_ptr,
    totals_ptr,
    grad_out_ptr,
    grad_lp_ptr,
    grad_ent_ptr,
    S,
    T,
    NB,
    clip_lo,
    clip_hi,
    clip_c,
    kl_coef,
    entropy_coef,
    BACKWARD: tl.constexpr,
    AGG: tl.constexpr,
    DUAL: tl.constexpr,
    KL: tl.constexpr,
    KL_PLUS: tl.constexpr,
    ADD_KL: tl.constexpr,
    NEED_REF: tl.constexpr,
    HAS_ENT: tl.constexpr,
    HAS_W: tl.constexpr,
    GRAD_LP: tl.constexpr,
    GRAD_ENT: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One block of one sequence. Forward: 7 partial sums. Backward: per-token gradients."""
    seq = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = cols < T
    offs = seq * T + cols
    m = tl.load(mask_ptr + offs, mask=valid, other=0).to(tl.float32)
    keep = m != 0.0
    lp = tl.load(lp_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    # the clipped surrogate
    d_old = lp - old
    log_ratio = tl.minimum(tl.maximum(d_old, -_LRC), _LRC)
    ratio = tl.exp(log_ratio)
    unclipped = -adv * ratio
    clipped_loss = -adv * tl.minimum(tl.maximum(ratio, clip_lo), clip_hi)
    pg = tl.maximum(unclipped, clipped_loss)
    # maximum splits ties in halves, and on a tie both branches carry -A·r (clamp passes it):
    # the gradient is the unclipped branch's whenever it is >= the clipped one, else 0
    dpg = tl.where((unclipped >= clipped_loss) & (d_old >= -_LRC) & (d_old <= _LRC), -adv * ratio, 0.0)
    clipped = clipped_loss > unclipped
    dual = tl.zeros([BLOCK_T], dtype=tl.int1)
    if DUAL:
        dual_loss = -adv * clip_c
        neg = adv < 0
        dual = (pg > dual_loss) & neg
        dpg = tl.where(neg, dpg * tl.where(pg < dual_loss, 1.0, tl.where(pg == dual_loss, 0.5, 0.0)), dpg)
        pg = tl.where(neg, tl.minimum(dual_loss, pg), pg)
    if HAS_W:
        w = tl.load(w_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        pg = pg * w
        dpg = dpg * w
    if NEED_REF:
        d_ref = lp - tl.load(ref_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        x = tl.minimum(tl.maximum(-d_ref, -_LRC), _LRC)
        ex = tl.exp(x)
        k3 = ex - x - 1.0
    if not BACKWARD:
        kl = _kl_value(d_ref, k3, KL)
        out = partials_ptr + seq * NB + blk
        stride_q = S * NB
        tl.store(out, tl.sum(tl.where(keep, pg, 0.0) * m, axis=0))
        tl.store(out + stride_q, tl.sum(tl.where(keep, kl, 0.0) * m, axis=0))
        if HAS_ENT:
            ent = tl.load(ent_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            tl.store(out + 2 * stride_q, tl.sum(tl.where(keep, ent, 0.0) * m, axis=0))
        else:
            tl.store(out + 2 * stride_q, 0.0)
        tl.store(out + 3 * stride_q, tl.sum(m, axis=0))
        tl.store(out + 4 * stride_q, tl.sum(tl.where(keep & clipped, m, 0.0), axis=0))
        tl.store(out + 5 * stride_q, tl.sum(tl.where(keep & dual, m, 0.0), axis=0))
        tl.store(out + 6 * stride_q, tl.sum(tl.where(keep, -log_ratio, 0.0) * m, axis=0))
    else:
        # d loss / d (token term) = upstream · (aggregation scale of this sequence) · mask weight
        g = tl.load(grad_out_ptr).to(tl.float32)
        if AGG == 0:
            w_total = tl.load(totals_ptr + 0)
            scale = g / tl.where(w_total > 0, w_total, 1.0)
        elif AGG == 4:
            scale = g
        else:
            r_w = tl.load(seq_weight_ptr + seq)
            n_used = tl.load(totals_ptr + 1)
            scale = tl.where(r_w > 0, g / tl.where(n_used > 0, n_used, 1.0), 0.0)
            if AGG == 2:
                scale = scale / tl.where(r_w > 0, r_w, 1.0)
            if AGG == 3:
                scale = scale / tl.maximum(T, 1).to(tl.float32)
        tok_scale = tl.where(keep, m * scale, 0.0)
        if GRAD_LP:
            if ADD_KL:
                dpg = dpg + kl_coef * _kl_grad(d_ref, ex, k3, KL, KL_PLUS)
            tl.store(grad_lp_ptr + offs, tl.where(keep, tok_scale * dpg, 0.0), mask=valid)
        if GRAD_ENT:
            tl.store(grad_ent_ptr + offs, -entropy_coef * tok_scale, mask=valid)


@helper_jit
def _sequence_sum(q_ptr, rows, row_ok, NB, BLOCK_S: tl.constexpr, BLOCK_NB: tl.constexpr):
    """``[BLOCK_S]`` fp32: each of ``rows``' sum of its ``NB`` block partials of one quantity
    (``q_ptr``: that quantity's ``[S, NB]`` slice of the partials), blocks in ascending order; 0 where
    not ``row_ok``."""
    nbs_in = tl.arange(0, BLOCK_NB)
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_NB):
        nbs = b0 + nbs_in
        ok = row_ok[:, None] & (nbs[None, :] < NB)
        total += tl.sum(tl.load(q_ptr + rows[:, None].to(tl.int64) * NB + nbs[None, :], mask=ok, other=0.0), axis=1)
    return total


@launch_time_jit
def _policy_loss_finish_kernel(
    partials_ptr,
    out_ptr,
    metrics_ptr,
    seq_weight_ptr,
    totals_ptr,
    S,
    T,
    NB,
    kl_coef,
    entropy_coef,
    AGG: tl.constexpr,
    ADD_KL: tl.constexpr,
    ADD_ENT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_NB: tl.constexpr,
):
    """Fixed-order reduction of the partials into the loss, metrics and backward totals."""
    rows_in = tl.arange(0, BLOCK_S)
    stride_q = S * NB
    # token-level totals of the 7 partials, and sequence-level sums of pg, kl, entropy and count
    tok_pg = tl.zeros([BLOCK_S], dtype=tl.float32)
    tok_kl = tl.zeros([BLOCK_S], dtype=tl.float32)
    tok_ent = tl.zeros([BLOCK_S], dtype=tl.float32)
    tok_w = tl.zeros([BLOCK_S], dtype=tl.float32)
    tok_clip = tl.zeros([BLOCK_S], dtype=tl.float32)
    tok_dual = tl.zeros([BLOCK_S], dtype=tl.float32)
    tok_nkl = tl.zeros([BLOCK_S], dtype=tl.float32)
    seq_pg = tl.zeros([BLOCK_S], dtype=tl.float32)
    seq_kl = tl.zeros([BLOCK_S], dtype=tl.float32)
    seq_ent = tl.zeros([BLOCK_S], dtype=tl.float32)
    seq_n = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        rows = s0 + rows_in
        row_ok = rows < S
        r_pg = _sequence_sum(partials_ptr, rows, row_ok, NB, BLOCK_S, BLOCK_NB)
        r_kl = _sequence_sum(partials_ptr + stride_q, rows, row_ok, NB, BLOCK_S, BLOCK_NB)
        r_ent = _sequence_sum(partials_ptr + 2 * stride_q, rows, row_ok, NB, BLOCK_S, BLOCK_NB)
        r_w = _sequence_sum(partials_ptr + 3 * stride_q, rows, row_ok, NB, BLOCK_S, BLOCK_NB)
        r_clip = _sequence_sum(partials_ptr + 4 * stride_q, rows, row_ok, NB, BLOCK_S, BLOCK_NB)
        r_dual = _sequence_sum(partials_ptr + 5 * stride_q, rows, row_ok, NB, BLOCK_S, BLOCK_NB)
        r_nkl = _sequence_sum(partials_ptr + 6 * stride_q, rows, row_ok, NB, BLOCK_S, BLOCK_NB)
        tl.store(seq_weight_ptr + rows, r_w, mask=row_ok)
        tok_pg += r_pg
        tok_kl += r_kl
        tok_ent += r_ent
        tok_w += r_w
        tok_clip += r_clip
        tok_dual += r_dual
        tok_nkl += r_nkl
        used = r_w > 0
        if AGG == 2:
            den = tl.where(used, r_w, 1.0)
            r_pg = r_pg / den
            r_kl = r_kl / den
            r_ent = r_ent / den
        seq_pg += tl.where(used, r_pg, 0.0)
        seq_kl += tl.where(used, r_kl, 0.0)
        seq_ent += tl.where(used, r_ent, 0.0)
        seq_n += tl.where(used, 1.0, 0.0)
    w_total = tl.sum(tok_w, axis=0)
    n_used = tl.sum(seq_n, axis=0)
    w_den = tl.where(w_total > 0, w_total, 1.0)
    if AGG == 0:
        pg_loss = tl.sum(tok_pg, axis=0) / w_den
        kl_loss = tl.sum(tok_kl, axis=0) / w_den
        ent_loss = tl.sum(tok_ent, axis=0) / w_den
    elif AGG == 4:
        pg_loss = tl.sum(tok_pg, axis=0)
        kl_loss = tl.sum(tok_kl, axis=0)
        ent_loss = tl.sum(tok_ent, axis=0)
    else:
        n_den = tl.where(n_used > 0, n_used, 1.0)
        pg_loss = tl.sum(seq_pg, axis=0) / n_den
        kl_loss = tl.sum(seq_kl, axis=0) / n_den
        ent_loss = tl.sum(seq_ent, axis=0) / n_den
        if AGG == 3:
            t_den = tl.maximum(T, 1).to(tl.float32)
            pg_loss = pg_loss / t_den
            kl_loss = kl_loss / t_den
            ent_loss = ent_loss / t_den
    loss = pg_loss
    if ADD_KL:
        loss = loss + kl_coef * kl_loss
    if ADD_ENT:
        loss = loss - entropy_coef * ent_loss
    tl.store(out_ptr, loss)
    tl.store(metrics_ptr + 0, pg_loss)
    tl.store(metrics_ptr + 1, tl.sum(tok_clip, axis=0) / w_den)
    tl.store(metrics_ptr + 2, tl.sum(tok_dual, axis=0) / w_den)
    tl.store(metrics_ptr + 3, tl.sum(tok_nkl, axis=0) / w_den)
    tl.store(metrics_ptr + 4, kl_loss)
    tl.store(metrics_ptr + 5, ent_loss)
    tl.store(totals_ptr + 0, w_total)
    tl.store(totals_ptr + 1, n_used)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1)


def _mask_view(mask: torch.Tensor) -> torch.Tensor:
    # bool memory is read as uint8 (0/1): the same bytes, no copy
    mask = mask.contiguous()
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _launch_ratio_kl(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    kl_type: str,
    *,
    ratio: torch.Tensor,
    kl: torch.Tensor,
    grad_ratio: Optional[torch.Tensor],
    grad_kl: Optional[torch.Tensor],
    grad: torch.Tensor,
    backward: bool,
) -> None:
    n = logprob.numel()
    if n == 0:
        return
    code, plus = kl_code(kl_type)
    lp = _flat(logprob)
    _ratio_kl_kernel[(triton.cdiv(n, LOSS_ELEMENTWISE_BLOCK),)](
        lp,
        _flat(old_logprob),
        _flat(ref_logprob),
        ratio,
        kl,
        lp if grad_ratio is None else _flat(grad_ratio),
        lp if grad_kl is None else _flat(grad_kl),
        grad,
        n,
        KL=code,
        KL_PLUS=plus,
        BACKWARD=backward,
        HAS_G_RATIO=grad_ratio is not None,
        HAS_G_KL=grad_kl is not None,
        BLOCK=LOSS_ELEMENTWISE_BLOCK,
        num_warps=4,
    )


def ratio_kl_fwd(
    logprob: torch.Tensor, old_logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ratio, kl)`` fp32 of the inputs' shape; inputs of one shape, fp32/bf16/fp16."""
    ratio = torch.empty(logprob.shape, dtype=torch.float32, device=logprob.device)
    kl = torch.empty(logprob.shape, dtype=torch.float32, device=logprob.device)
    _launch_ratio_kl(
        logprob,
        old_logprob,
        ref_logprob,
        kl_type,
        ratio=ratio,
        kl=kl,
        grad_ratio=None,
        grad_kl=None,
        grad=ratio,
        backward=False,
    )
    return ratio, kl


def ratio_kl_bwd(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    grad_ratio: Optional[torch.Tensor],
    grad_kl: Optional[torch.Tensor],
    kl_type: str,
) -> torch.Tensor:
    """``d/d logprob`` of ``sum(grad_ratio * ratio + grad_kl * kl)``, in ``logprob``'s dtype and shape.

    A None upstream gradient counts as zero.
    """
    grad = torch.empty(logprob.shape, dtype=logprob.dtype, device=logprob.device)
    _launch_ratio_kl(
        logprob,
        old_logprob,
        ref_logprob,
        kl_type,
        ratio=grad,
        kl=grad,
        grad_ratio=grad_ratio,
        grad_kl=grad_kl,
        grad=grad,
        backward=True,
    )
    return grad


def _block_t(seq_len: int) -> int:
    return min(1024, triton.next_power_of_2(max(seq_len, 16)))


def _launch_tokens(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprob: torch.Tensor,
    entropy: Optional[torch.Tensor],
    rollout_is_weights: Optional[torch.Tensor],
    settings: LossSettings,
    *,
    backward: bool,
    partials: Optional[torch.Tensor] = None,
    seq_weight: Optional[torch.Tensor] = None,
    totals: Optional[torch.Tensor] = None,
    grad_loss: Optional[torch.Tensor] = None,
    grad_lp: Optional[torch.Tensor] = None,
    grad_ent: Optional[torch.Tensor] = None,
) -> None:
    num_seqs, seq_len = logprob.shape
    block_t = _block_t(seq_len)
    nb = triton.cdiv(seq_len, block_t)
    if num_seqs * nb == 0:
        return
    lp = logprob.contiguous()
    code, plus = kl_code(settings.kl_type)
    dual = settings.clip_ratio_c is not None
    add_kl = settings.kl_coef != 0.0

    def ptr(t: Optional[torch.Tensor]) -> torch.Tensor:
        return lp if t is None else t.contiguous()

    _policy_loss_tokens_kernel[(num_seqs, nb)](
        lp,
        old_logprob.contiguous(),
        advantages.contiguous(),
        _mask_view(mask),
        ref_logprob.contiguous(),
        ptr(entropy),
        ptr(rollout_is_weights),
        ptr(partials),
        ptr(seq_weight),
        ptr(totals),
        ptr(grad_loss),
        ptr(grad_lp),
        ptr(grad_ent),
        num_seqs,
        seq_len,
        nb,
        1.0 - settings.clip_ratio_low,
        1.0 + settings.clip_ratio_high,
        settings.clip_ratio_c if dual else 0.0,
        settings.kl_coef,
        settings.entropy_coef,
        BACKWARD=backward,
        AGG=AGG_CODES[settings.loss_agg_mode],
        DUAL=dual,
        KL=code,
        KL_PLUS=plus,
        ADD_KL=add_kl,
        NEED_REF=(not backward) or add_kl,
        HAS_ENT=entropy is not None,
        HAS_W=rollout_is_weights is not None,
        GRAD_LP=grad_lp is not None,
        GRAD_ENT=grad_ent is not None,
        BLOCK_T=block_t,
        num_warps=4,
    )


def policy_loss_fwd(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprob: torch.Tensor,
    entropy: Optional[torch.Tensor],
    rollout_is_weights: Optional[torch.Tensor],
    settings: LossSettings,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward pass over ``[S, T]`` per-token tensors (fp32/bf16/fp16; mask bool or float).

    Returns:
        ``loss`` 0-d fp32; ``metrics`` ``[6]`` fp32 in the order pg_loss, pg_clipfrac,
        pg_clipfrac_lower, ppo_kl, kl_loss, entropy; ``seq_weight`` ``[S]`` fp32 (each sequence's
        mask sum); ``totals`` ``[2]`` fp32 (mask sum, number of non-empty sequences). The last two
        are what :func:`policy_loss_bwd` needs.
    """
    num_seqs, seq_len = logprob.shape
    dev = logprob.device
    nb = triton.cdiv(seq_len, _block_t(seq_len))
    partials = torch.empty((_NUM_PARTIALS, num_seqs, nb), dtype=torch.float32, device=dev)
    loss = torch.empty((), dtype=torch.float32, device=dev)
    metrics = torch.empty(6, dtype=torch.float32, device=dev)
    seq_weight = torch.empty(num_seqs, dtype=torch.float32, device=dev)
    totals = torch.empty(2, dtype=torch.float32, device=dev)
    _launch_tokens(
        logprob,
        old_logprob,
        advantages,
        mask,
        ref_logprob,
        entropy,
        rollout_is_weights,
        settings,
        backward=False,
        partials=partials,
    )
    block_nb = min(triton.next_power_of_2(max(nb, 1)), 128)
    block_s = max(min(triton.next_power_of_2(max(num_seqs, 1)), 1024 // block_nb), 1)
    _policy_loss_finish_kernel[(1,)](
        partials,
        loss,
        metrics,
        seq_weight,
        totals,
        num_seqs,
        seq_len,
        nb,
        settings.kl_coef,
        settings.entropy_coef,
        AGG=AGG_CODES[settings.loss_agg_mode],
        ADD_KL=settings.kl_coef != 0.0,
        ADD_ENT=entropy is not None and settings.entropy_coef != 0.0,
        BLOCK_S=block_s,
        BLOCK_NB=block_nb,
        num_warps=4,
    )
    return loss, metrics, seq_weight, totals


def policy_loss_bwd(
    grad_loss: torch.Tensor,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprob: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor],
    seq_weight: torch.Tensor,
    totals: torch.Tensor,
    settings: LossSettings,
    need_logprob_grad: bool,
    entropy_dtype: Optional[torch.dtype],
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(d loss / d logprob, d loss / d entropy)`` as ``[S, T]`` tensors in the inputs' dtypes.

    ``grad_loss`` is the 0-d upstream gradient (read on the device); ``entropy_dtype`` is None
    when no entropy gradient is wanted; either result is None when not wanted.
    """
    grad_lp, grad_ent = opdef.policy_loss_grad_buffers(logprob, need_logprob_grad, entropy_dtype)
    if grad_lp is not None or grad_ent is not None:
        _launch_tokens(
            logprob,
            old_logprob,
            advantages,
            mask,
            ref_logprob,
            None,
            rollout_is_weights,
            settings,
            backward=True,
            seq_weight=seq_weight,
            totals=totals,
            grad_loss=grad_loss.to(torch.float32),
            grad_lp=grad_lp,
            grad_ent=grad_ent,
        )
    return grad_lp, grad_ent


# ---------------------------------------------------------------- backend registration

ratio_kl = dispatch.register("ratio_kl", "triton", supports=opdef.ratio_kl_supports("triton", kl_types=KL_CODES))(
    opdef.define_ratio_kl("triton_ratio_kl", ratio_kl_fwd, ratio_kl_bwd)
)
_policy_loss_op = opdef.define_policy_loss_op("triton_policy_loss", policy_loss_fwd, policy_loss_bwd)
policy_loss = dispatch.register(
    "policy_loss", "triton", supports=opdef.policy_loss_supports("triton", kl_types=KL_CODES, agg_modes=AGG_CODES)
)(opdef.policy_loss_implementation(_policy_loss_op))
