"""Triton ``fused_linear_policy_loss``: the PPO/GRPO loss from hidden states in three matrix products.

The loss is linear in per-token terms: with ``w_i = d agg / d v_i`` the aggregation weight of
token ``i`` (a function of the mask and ``loss_agg_mode`` only, known before any logit exists),

    loss = sum_i w_i (pg_i + kl_coef kl_i - entropy_coef entropy_i)

so ``d loss / d logprob_i`` and ``d loss / d entropy_i`` depend on token ``i``'s own log-prob and
entropy and on ``w_i``, nothing global. The forward therefore runs, per fixed-size chunk of rows:

1. the chunk's logits on ``linear_logprob``'s route (``TUNING.route``: ``"chunked"`` = one
   cuBLAS product into an fp32 ``[chunk, V]`` buffer; ``"gemm"`` = the Triton ``tl.dot`` pass),
   so the log-probs have ``linear_logprob``'s bits;
2. the tile-statistics pass and merge: the chunk's log-probs, entropies and ``lse``;
3. the per-token loss gradients: one launch of the Triton policy-loss backward kernel
   (:func:`rl_kernel_core.triton.policy_loss.policy_loss_bwd`) in ``token-sum`` mode with the
   chunk's ``w`` as a float mask, which is exactly ``d loss / d logprob`` and ``d loss /
   d entropy`` (the reference's formulas, clamps and tie rules);
4. the gradient pass: ``dl = d loss / d logits`` written over the fp32 chunk in place (chunked)
   or recomputed from ``hidden`` and ``weight`` (gemm: one more matrix product);
5. ``dh = dl @ W`` (fixed shape) and ``dW += dl^T @ h``.

Then the loss value and metrics come from the reference loss on the ``[N]`` log-probs and
entropies. The backward only scales the stored ``dh``, ``dW``, ``db`` by the upstream gradient:
on the chunked route the whole step costs three products (logits, dh, dW); on the gemm route
four (the gradient pass forms the logits again).

Memory: the chunk buffer (``TUNING.chunk_bytes``), ``dh`` and ``dW`` in the inputs' dtypes
(the gradients, kept from the forward until the backward; with ``TUNING.wgrad_fp32`` ``dW`` is
accumulated in fp32, ``4 V D`` bytes, during the forward).
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core._autograd import single_backward
from rl_kernel_core.reference import policy_loss as reference
from rl_kernel_core.triton import _linear_kernels as K
from rl_kernel_core.triton.policy_loss import policy_loss_bwd


def aggregation_weights(mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """``d agg(v) / d v`` for verl's aggregation of ``[S, T]`` values under ``mask`` (fp32 ``[S, T]``, >= 0)."""
    weight = mask.to(torch.float32)
    keep = mask if mask.dtype == torch.bool else mask != 0
    with torch.enable_grad():
        v = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
        (w,) = torch.autograd.grad(reference.aggregate(v, weight, keep, loss_agg_mode), v)
    return w


def _token_grads(
    lp: torch.Tensor, ent: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, w: torch.Tensor,
    ref: torch.Tensor, rw: Optional[torch.Tensor], knobs: dict, one: torch.Tensor,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """fp32 ``(d loss / d logprob, d loss / d entropy or None)`` for one chunk of ``[n]`` tokens.

    ``loss = sum_i w_i term_i`` is the ``token-sum`` aggregation with float mask ``w``; ``one``
    is the 0-d upstream gradient 1.
    """
    want_ent = knobs["entropy_coef"] != 0.0
    g_lp, g_ent = policy_loss_bwd(
        one, lp[None], old[None], adv[None], w[None], ref[None], None if rw is None else rw[None], one, one,
        torch.float32 if want_ent else None, knobs["clip_ratio_low"], knobs["clip_ratio_high"], knobs["clip_ratio_c"],
        knobs["kl_type"], knobs["kl_coef"], knobs["entropy_coef"], "token-sum", True,
    )
    return g_lp[0], None if g_ent is None else g_ent[0]


class _FusedLinearPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, old, adv, mask_eff, ref, rw, temperature, ignore_index, knobs, out):
        inv_temp = 1.0 / temperature
        n_rows = hidden.shape[0]
        shape = mask_eff.shape
        w = aggregation_weights(mask_eff, knobs["loss_agg_mode"]).reshape(-1)
        old1, adv1, ref1 = old.reshape(-1), adv.reshape(-1), ref.reshape(-1)
        rw1 = None if rw is None else rw.reshape(-1)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        sink = K.GradSink(hidden, weight, need_h, need_w, need_b and bias is not None)
        buf = K.ChunkBuffers(hidden, weight, K.TUNING.route_for(hidden), need_dl=True)
        one = torch.ones((), dtype=torch.float32, device=hidden.device)
        lp = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        ent = torch.empty_like(lp)
        lse = torch.empty_like(lp)
        for r0 in range(0, n_rows, buf.rows):
            n = min(buf.rows, n_rows - r0)
            sl = slice(r0, r0 + n)
            x = buf.source(hidden, weight, r0, n)
            buf.stats(x, weight, bias, targets[sl], n, inv_temp, ignore_index, lp[sl], ent[sl], lse[sl])
            g_lp, g_ent = _token_grads(lp[sl], ent[sl], old1[sl], adv1[sl], w[sl], ref1[sl], None if rw1 is None else rw1[sl], knobs, one)
            dl = buf.grad(x, weight, bias, targets[sl], n, inv_temp, ignore_index, lse[sl], ent[sl], g_lp, g_ent)
            sink.add(dl, r0, n)
        del buf
        loss, metrics = reference.policy_loss(lp.view(shape), old, adv, mask_eff, ref, ent.view(shape), rw, **knobs)
        out["metrics"] = metrics
        ctx.grads = sink.grads()
        return loss

    @staticmethod
    @single_backward("fused_linear_policy_loss (triton backend)")
    def backward(ctx, g_loss):
        if ctx.grads is None:
            raise RuntimeError(
                "fused_linear_policy_loss (triton) forms its gradient in the forward and hands it to one "
                "backward; for a second backward through the same graph, call the loss again"
            )
        # scaled in place: the stored gradients are this node's own buffers, used once
        dh, dw, db = (None if g is None else g.mul_(g_loss.to(g.dtype)) for g in ctx.grads)
        ctx.grads = None
        return (dh, dw, db) + (None,) * 10


def _supports(hidden, weight, *args, **kwargs) -> Optional[str]:
    if hidden.dtype == torch.float64:
        return "the triton kernels accumulate in fp32; fp64 inputs need the torch backend"
    return None


@dispatch.register("fused_linear_policy_loss", "triton", supports=_supports)
def fused_linear_policy_loss_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    bias: Optional[torch.Tensor],
    ref_logprob: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor],
    *,
    temperature: float,
    ignore_index: int,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: Optional[float],
    kl_type: str,
    kl_coef: float,
    entropy_coef: float,
    loss_agg_mode: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO/GRPO loss of :func:`rl_kernel_core.policy_loss` from ``hidden [S, T, D]`` and ``weight [V, D]``.

    Validated inputs (see :mod:`rl_kernel_core.policy_loss`): 16-bit or fp32 ``hidden``/
    ``weight``/``bias``, ``targets [S, T]`` in ``[0, V)`` or ``ignore_index`` (such tokens leave
    the mask), per-token ``[S, T]`` float tensors, ``mask`` bool or float. Returns ``(loss,
    metrics)``: ``loss`` 0-d fp32, differentiable in ``hidden``, ``weight`` and ``bias`` (its
    gradient is formed during the forward); ``metrics`` detached 0-d tensors.
    """
    num_seqs, seq_len, dim = hidden.shape
    h2d = K.canonical_layout(hidden.reshape(num_seqs * seq_len, dim))
    weight = K.canonical_layout(weight)
    t1d = targets.reshape(-1)
    mask_eff = reference.scored_mask(mask, targets, ignore_index)
    knobs = dict(
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
        kl_type=kl_type, kl_coef=kl_coef, entropy_coef=entropy_coef, loss_agg_mode=loss_agg_mode,
    )
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not needs_grad:
        lp, ent, _ = K.forward_stats(h2d, weight, bias, t1d, 1.0 / temperature, ignore_index, K.TUNING.route_for(h2d), True)
        shape = targets.shape
        return reference.policy_loss(lp.view(shape), old_logprob, advantages, mask_eff, ref_logprob, ent.view(shape), rollout_is_weights, **knobs)
    out: dict = {}
    loss = _FusedLinearPolicyLoss.apply(
        h2d, weight, bias, t1d, old_logprob, advantages, mask_eff, ref_logprob, rollout_is_weights,
        temperature, ignore_index, knobs, out,
    )
    return loss, out["metrics"]
