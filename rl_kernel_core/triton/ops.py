"""The Triton loss kernels as ``torch.library`` custom ops, and their registration as the ``triton`` backend.

Each op pairs a forward and a backward custom op (``rl_kernel::triton_*``) with a fake
implementation (shapes and dtypes only), so ``torch.compile(fullgraph=True)`` traces through them
without graph breaks, and ``register_autograd`` ties them together, so AOTAutograd sees the
backward too; in eager the same bodies run as a ``torch.autograd.Function``
(:func:`rl_kernel_core._custom_ops.define_differentiable_op`). The ops accept CUDA tensors, and CPU tensors when the Triton interpreter is on
(``TRITON_INTERPRET=1`` before Triton kernels are defined); :mod:`rl_kernel_core.dispatch`
decides which device may reach them.

Registered backend implementations (signatures in :mod:`rl_kernel_core.logprob` and
:mod:`rl_kernel_core.policy_loss`): ``logprob_from_logits``, ``ratio_kl``, ``policy_loss``. Each
``supports`` predicate names what the kernels do not serve: fp64 inputs (the kernels compute in
fp32; the torch backend keeps fp64) and gradients the kernels do not form.
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import _custom_ops as glue
from rl_kernel_core import dispatch
from rl_kernel_core.loss_codes import AGG_CODES, KL_CODES
from rl_kernel_core.triton import advantages as _adv
from rl_kernel_core.triton import logprob_from_logits as _lp
from rl_kernel_core.triton import policy_loss as _pl

Tensor = torch.Tensor


# ---------------------------------------------------------------- logprob_from_logits


def _logprob_from_logits_fwd(
    logits: Tensor, targets: Tensor, temperature: float, ignore_index: int, return_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(logprob [N], entropy [N] or [0], lse [N])``, fp32; see :func:`..logprob_from_logits.logprob_fwd`."""
    return _lp.logprob_fwd(logits, targets, temperature, ignore_index, return_entropy)


def _logprob_from_logits_bwd(
    logits: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor,
    grad_logprob: Optional[Tensor], grad_entropy: Optional[Tensor], temperature: float, ignore_index: int,
) -> Tensor:
    """``d/d logits`` ``[N, V]`` in the logits' dtype; see :func:`..logprob_from_logits.logprob_bwd`."""
    return _lp.logprob_bwd(logits, targets, lse, entropy, grad_logprob, grad_entropy, temperature, ignore_index)


_logprob_from_logits_op = glue.define_differentiable_op(
    "triton_logprob_from_logits", _logprob_from_logits_fwd, glue.logprob_fake,
    _logprob_from_logits_bwd, glue.logprob_backward_fake, glue.logprob_setup, glue.logprob_backward,
)


logprob_from_logits = dispatch.register("logprob_from_logits", "triton", supports=glue.logprob_supports("triton"))(
    glue.logprob_impl(_logprob_from_logits_op)
)


# ---------------------------------------------------------------- ratio_kl


def _ratio_kl_fwd(logprob: Tensor, old_logprob: Tensor, ref_logprob: Tensor, kl_type: str) -> tuple[Tensor, Tensor]:
    """``(ratio, kl)`` fp32 of the input shape; see :func:`..policy_loss.ratio_kl_fwd`."""
    return _pl.ratio_kl_fwd(logprob, old_logprob, ref_logprob, kl_type)


def _ratio_kl_bwd(
    logprob: Tensor, old_logprob: Tensor, ref_logprob: Tensor,
    grad_ratio: Optional[Tensor], grad_kl: Optional[Tensor], kl_type: str,
) -> Tensor:
    """``d/d logprob`` in ``logprob``'s dtype; see :func:`..policy_loss.ratio_kl_bwd`."""
    return _pl.ratio_kl_bwd(logprob, old_logprob, ref_logprob, grad_ratio, grad_kl, kl_type)


_ratio_kl_op = glue.define_differentiable_op(
    "triton_ratio_kl", _ratio_kl_fwd, glue.ratio_kl_fake, _ratio_kl_bwd, glue.ratio_kl_backward_fake,
    glue.ratio_kl_setup, glue.ratio_kl_backward,
)


ratio_kl = dispatch.register("ratio_kl", "triton", supports=glue.ratio_kl_supports("triton", kl_types=KL_CODES))(
    glue.ratio_kl_impl(_ratio_kl_op)
)


# ---------------------------------------------------------------- policy_loss


def _policy_loss_fwd(
    logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, ref_logprob: Tensor,
    entropy: Optional[Tensor], rollout_is_weights: Optional[Tensor],
    clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: Optional[float], kl_type: str,
    kl_coef: float, entropy_coef: float, loss_agg_mode: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss [], metrics [6], seq_weight [S], totals [2])``; see :func:`..policy_loss.policy_loss_fwd`."""
    return _pl.policy_loss_fwd(
        logprob, old_logprob, advantages, mask, ref_logprob, entropy, rollout_is_weights,
        clip_ratio_low, clip_ratio_high, clip_ratio_c, kl_type, kl_coef, entropy_coef, loss_agg_mode,
    )


def _policy_loss_bwd(
    grad_loss: Tensor, logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, ref_logprob: Tensor,
    rollout_is_weights: Optional[Tensor], seq_weight: Tensor, totals: Tensor,
    clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: Optional[float], kl_type: str,
    kl_coef: float, entropy_coef: float, loss_agg_mode: str,
    need_logprob_grad: bool, entropy_dtype: Optional[torch.dtype],
) -> tuple[Tensor, Tensor]:
    """``(d loss / d logprob, d loss / d entropy)``; a gradient not asked for is an empty ``[0]`` tensor."""
    grad_lp, grad_ent = _pl.policy_loss_bwd(
        grad_loss, logprob, old_logprob, advantages, mask, ref_logprob, rollout_is_weights, seq_weight, totals,
        entropy_dtype, clip_ratio_low, clip_ratio_high, clip_ratio_c, kl_type, kl_coef, entropy_coef,
        loss_agg_mode, need_logprob_grad,
    )
    empty = logprob.new_empty(0)
    return (empty if grad_lp is None else grad_lp), (empty.clone() if grad_ent is None else grad_ent)


_policy_loss_op = glue.define_differentiable_op(
    "triton_policy_loss", _policy_loss_fwd, glue.policy_loss_fake, _policy_loss_bwd, glue.policy_loss_backward_fake,
    glue.policy_loss_setup, glue.policy_loss_backward,
)


policy_loss = dispatch.register(
    "policy_loss", "triton", supports=glue.policy_loss_supports("triton", kl_types=KL_CODES, agg_modes=AGG_CODES)
)(glue.policy_loss_impl(_policy_loss_op))


# ---------------------------------------------------------------- group_advantages


@torch.library.custom_op("rl_kernel::triton_group_advantages", mutates_args=())
def group_advantages_op(
    rewards: Tensor, group_size: Optional[int], group_index: Optional[Tensor], estimator: str, norm_by_std: bool, eps: float
) -> Tensor:
    """Advantages ``[N]`` fp32; see :func:`..advantages.group_advantages_fwd`."""
    return _adv.group_advantages_fwd(rewards, group_size, group_index, estimator, norm_by_std, eps)


group_advantages_op.register_fake(glue.group_advantages_fake)


def _group_advantages_supports(rewards, group_size, group_index, **kwargs) -> Optional[str]:
    return glue.fp64_reason("triton", rewards=rewards)


group_advantages = dispatch.register("group_advantages", "triton", supports=_group_advantages_supports)(
    glue.group_advantages_impl(group_advantages_op)
)
