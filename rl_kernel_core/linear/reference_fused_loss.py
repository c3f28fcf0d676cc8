"""Plain-PyTorch reference of ``fused_linear_policy_loss`` (backend ``torch``): the reference
``linear_logprob`` (with entropy) composed with the reference policy loss, the semantics that
:mod:`rl_kernel_core.linear.triton_fused_loss` computes without the ``[N, V]`` logits."""

from __future__ import annotations

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.linear.reference import linear_logprob_torch
from rl_kernel_core.loss.opdef import FusedLossInputs, LossSettings
from rl_kernel_core.loss import reference as loss_reference


@dispatch.register("fused_linear_policy_loss", "torch")
def fused_linear_policy_loss(
    inputs: FusedLossInputs,
    *,
    temperature: float,
    ignore_index: int,
    settings: LossSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``linear_logprob`` (reference, with entropy) composed with :func:`policy_loss`.

    ``hidden [S, T, D]``; tokens whose target is ``ignore_index`` leave the mask, whatever it says.
    """
    hidden, weight, targets, old_logprob, advantages, mask, bias, ref_logprob, rollout_is_weights = inputs
    num_seqs, seq_len, dim = hidden.shape
    logprob, entropy = linear_logprob_torch(
        hidden.reshape(num_seqs * seq_len, dim).contiguous(),
        weight.contiguous(),
        targets.reshape(-1).contiguous(),
        None if bias is None else bias.contiguous(),
        temperature,
        ignore_index,
        True,
    )
    return loss_reference.policy_loss(
        logprob.view(num_seqs, seq_len),
        old_logprob,
        advantages,
        loss_reference.scored_mask(mask, targets, ignore_index),
        ref_logprob,
        entropy.view(num_seqs, seq_len),
        rollout_is_weights,
        settings,
    )
