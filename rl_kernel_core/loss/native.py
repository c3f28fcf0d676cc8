"""Native ``ratio_kl`` and ``policy_loss``: the CUDA kernels of ``native/csrc/loss.cu`` as the custom
ops ``rl_kernel::native_ratio_kl``, ``rl_kernel::native_policy_loss`` and their backwards
(schemas and autograd glue in :mod:`rl_kernel_core.loss.opdef`), registered as the ``native``
backend. Importing this module builds the ``loss`` extension (:func:`rl_kernel_core.native.extension`)."""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.loss_codes import AGG_CODES, kl_code
from rl_kernel_core.native import extension
from rl_kernel_core.opdef import define_differentiable_op
from rl_kernel_core.loss import opdef
from rl_kernel_core.loss.opdef import LossSettings

Tensor = torch.Tensor
_ext = extension("loss")


def _ratio_kl_forward(logprob: Tensor, old_logprob: Tensor, ref_logprob: Tensor, kl_type: str) -> tuple[Tensor, Tensor]:
    """``(ratio, kl)`` fp32 of the input shape."""
    ratio, kl = _ext.ratio_kl_fwd(logprob, old_logprob, ref_logprob, kl_code(kl_type)[0])
    return ratio, kl


def _ratio_kl_backward(
    logprob: Tensor,
    old_logprob: Tensor,
    ref_logprob: Tensor,
    grad_ratio: Optional[Tensor],
    grad_kl: Optional[Tensor],
    kl_type: str,
) -> Tensor:
    """``d/d logprob`` of ``sum(grad_ratio·ratio + grad_kl·kl)`` in ``logprob``'s dtype (None counts as 0)."""
    code, plus = kl_code(kl_type)
    return _ext.ratio_kl_bwd(logprob, old_logprob, ref_logprob, grad_ratio, grad_kl, code, plus)


ratio_kl = dispatch.register("ratio_kl", "native", supports=opdef.ratio_kl_supports("native"))(
    opdef.ratio_kl_implementation(
        define_differentiable_op(
            "native_ratio_kl",
            _ratio_kl_forward,
            opdef.ratio_kl_fake,
            _ratio_kl_backward,
            opdef.ratio_kl_backward_fake,
            opdef.ratio_kl_setup,
            opdef.ratio_kl_backward,
        )
    )
)


def _policy_loss_forward(logprob, old_logprob, advantages, mask, ref_logprob, entropy, rollout_is_weights, *settings):
    """``(loss [], metrics [6], seq_weight [S], totals [2])`` fp32 over ``[S, T]`` tensors (schema
    :data:`rl_kernel_core.loss.opdef.POLICY_LOSS_SCHEMA`); metrics in ``METRIC_NAMES`` order."""
    s = LossSettings.from_args(settings)
    loss, metrics, seq_weight, totals = _ext.policy_loss_fwd(
        logprob,
        old_logprob,
        advantages,
        mask,
        ref_logprob,
        entropy,
        rollout_is_weights,
        s.clip_ratio_low,
        s.clip_ratio_high,
        s.clip_ratio_c,
        kl_code(s.kl_type)[0],
        s.kl_coef,
        s.entropy_coef,
        AGG_CODES[s.loss_agg_mode],
    )
    return loss, metrics, seq_weight, totals


def _policy_loss_backward(
    grad_loss, logprob, old_logprob, advantages, mask, ref_logprob, rollout_is_weights, seq_weight, totals, *rest
):
    """``(d loss / d logprob, d loss / d entropy)`` in logprob's / ``entropy_dtype``; one not asked for is an empty ``[0]`` tensor."""
    *settings, need_logprob_grad, entropy_dtype = rest
    s = LossSettings.from_args(tuple(settings))
    grad_lp = torch.empty(logprob.shape, dtype=logprob.dtype, device=logprob.device) if need_logprob_grad else None
    grad_ent = (
        torch.empty(logprob.shape, dtype=entropy_dtype, device=logprob.device) if entropy_dtype is not None else None
    )
    code, plus = kl_code(s.kl_type)
    _ext.policy_loss_bwd(
        grad_loss,
        logprob,
        old_logprob,
        advantages,
        mask,
        ref_logprob,
        rollout_is_weights,
        seq_weight,
        totals,
        s.clip_ratio_low,
        s.clip_ratio_high,
        s.clip_ratio_c,
        code,
        plus,
        s.kl_coef,
        s.entropy_coef,
        AGG_CODES[s.loss_agg_mode],
        grad_lp,
        grad_ent,
    )
    return (logprob.new_empty(0) if grad_lp is None else grad_lp), (
        logprob.new_empty(0) if grad_ent is None else grad_ent
    )


_policy_loss_op = define_differentiable_op(
    "native_policy_loss",
    _policy_loss_forward,
    opdef.policy_loss_fake,
    _policy_loss_backward,
    opdef.policy_loss_backward_fake,
    opdef.policy_loss_setup,
    opdef.policy_loss_backward,
    schema=opdef.POLICY_LOSS_SCHEMA,
    backward_schema=opdef.POLICY_LOSS_BACKWARD_SCHEMA,
)
policy_loss = dispatch.register("policy_loss", "native", supports=opdef.policy_loss_supports("native"))(
    opdef.policy_loss_implementation(_policy_loss_op)
)
