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
from rl_kernel_core.loss import opdef

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
    opdef.define_ratio_kl("native_ratio_kl", _ratio_kl_forward, _ratio_kl_backward)
)


def _policy_loss_fwd(*args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss [], metrics [6], seq_weight [S], totals [2])`` fp32 over the ``[S, T]`` tensors, then the
    :class:`~rl_kernel_core.loss.opdef.LossSettings` (``forward_fn`` of :func:`~rl_kernel_core.loss.opdef.define_policy_loss_op`);
    metrics in ``METRIC_NAMES`` order."""
    *tensors, s = args
    clip = (s.clip_ratio_low, s.clip_ratio_high, s.clip_ratio_c)
    loss, metrics, seq_weight, totals = _ext.policy_loss_fwd(
        *tensors, *clip, kl_code(s.kl_type)[0], s.kl_coef, s.entropy_coef, AGG_CODES[s.loss_agg_mode]
    )
    return loss, metrics, seq_weight, totals


def _policy_loss_grads(*args) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(d loss / d logprob, d loss / d entropy)`` in logprob's / ``entropy_dtype``, None where not asked
    for (``grads_fn`` of :func:`~rl_kernel_core.loss.opdef.define_policy_loss_op`)."""
    *tensors, s, need_logprob_grad, entropy_dtype = args
    grad_lp, grad_ent = opdef.policy_loss_grad_buffers(tensors[1], need_logprob_grad, entropy_dtype)
    code, plus = kl_code(s.kl_type)
    clip = (s.clip_ratio_low, s.clip_ratio_high, s.clip_ratio_c)
    _ext.policy_loss_bwd(
        *tensors, *clip, code, plus, s.kl_coef, s.entropy_coef, AGG_CODES[s.loss_agg_mode], grad_lp, grad_ent
    )
    return grad_lp, grad_ent


_policy_loss_op = opdef.define_policy_loss_op("native_policy_loss", _policy_loss_fwd, _policy_loss_grads)
policy_loss = dispatch.register("policy_loss", "native", supports=opdef.policy_loss_supports("native"))(
    opdef.policy_loss_implementation(_policy_loss_op)
)
