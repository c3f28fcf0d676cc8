"""Plain-PyTorch reference for ratio/KL and the PPO policy loss (the fused-from-hidden variant
composes it with ``linear_logprob`` in :mod:`rl_kernel_core.linear.reference_fused_loss`).

The semantics oracle and the CPU path. Inputs arrive validated and normalised by
:mod:`rl_kernel_core.loss.api` (shapes, ``ref_logprob`` resolved, the settings as one
:class:`~rl_kernel_core.loss.opdef.LossSettings`); the call signatures registered here are the
ones every backend implements (see that module's docstring). All arithmetic runs in fp32 (fp64 when an input is fp64); autograd is PyTorch's own.

The formulas follow verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` (``kl_penalty``,
``kl_penalty_forward``, ``agg_loss``, ``compute_policy_loss_vanilla``) and
``verl/workers/utils/losses.py`` (``ppo_loss``: how the KL and entropy terms join the loss);
``docs/loss.md`` states them and every clamp.
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.loss.opdef import LossSettings

LOG_RATIO_CLAMP = 20.0
"""``|log ratio|`` bound before ``exp``, in the PPO ratio and in the k3 estimator (verl)."""
LOW_VAR_KL_CLAMP = 10.0
"""Bound on the k3 / low_var_kl estimate (verl)."""
_SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """fp64 when any input is fp64 (exact checks, gradcheck), else fp32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate of ``logprob`` against ``ref_logprob`` (same shape and dtype).

    ``kl_type`` is canonical: ``k1``, ``abs``, ``k2``, ``k3``, or ``k1+``/``abs+``/``k3+``, whose
    value is the base estimator's and whose gradient is k2's (verl's straight-through variant).
    """
    base = kl_type[:-1] if kl_type.endswith("+") else kl_type
    log_ratio = logprob - ref_logprob
    if base == "k1":
        kl = log_ratio
    elif base == "abs":
        kl = log_ratio.abs()
    elif base == "k2":
        kl = 0.5 * log_ratio.square()
    elif base == "k3":
        ref_minus = (ref_logprob - logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = (ref_minus.exp() - ref_minus - 1).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    else:
        raise ValueError(f"kl_type must be canonical (k1, abs, k2, k3, optionally with '+'), got {kl_type!r}")
    if kl_type.endswith("+") and base != "k2":
        k2 = 0.5 * log_ratio.square()
        kl = k2 - k2.detach() + kl.detach()
    return kl


def clamped_log_ratio(logprob: torch.Tensor, old_logprob: torch.Tensor) -> torch.Tensor:
    """``clamp(logprob - old_logprob, -20, 20)``: the log of the PPO ratio."""
    return (logprob - old_logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@dispatch.register("ratio_kl", "torch")
def ratio_kl(
    logprob: torch.Tensor, old_logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exp(clamp(logprob - old_logprob, ±20)), kl_estimate(logprob, ref_logprob, kl_type))``."""
    dt = compute_dtype(logprob, old_logprob, ref_logprob)
    lp = logprob.to(dt)
    ratio = clamped_log_ratio(lp, old_logprob.to(dt)).exp()
    return ratio, kl_estimate(lp, ref_logprob.to(dt), kl_type)


def _nonzero_or_one(den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, den, torch.ones_like(den))


def masked_mean(values: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``sum(where(keep, values, 0) * weight) / sum(weight)``; 0 when nothing is kept."""
    return (torch.where(keep, values, 0.0) * weight).sum() / _nonzero_or_one(weight.sum())


def aggregate(values: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """verl's ``agg_loss`` (dp_size=1, no global batch info) over ``[S, T]`` values.

    ``weight`` is the mask as a number (0/1 for bool masks), ``keep`` where it is non-zero.
    Values outside the mask never reach the sum (not even NaN). An empty mask gives 0 where
    verl would divide 0 by 0.
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(values, weight, keep)
    if loss_agg_mode == "token-sum":
        return (torch.where(keep, values, 0.0) * weight).sum()
    if loss_agg_mode not in _SEQ_MODES:
        raise ValueError(
            f"loss_agg_mode must be one of {('token-mean', 'token-sum') + _SEQ_MODES}, got {loss_agg_mode!r}"
        )
    seq_sum = (torch.where(keep, values, 0.0) * weight).sum(dim=-1)
    seq_tokens = weight.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sum = seq_sum / _nonzero_or_one(seq_tokens)
    seq_used = seq_tokens > 0
    loss = torch.where(seq_used, seq_sum, 0.0).sum() / _nonzero_or_one(seq_used.sum().to(values.dtype))
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / max(values.shape[-1], 1)
    return loss


def aggregation_weights(mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """``d aggregate(v) / d v``: each token's weight in :func:`aggregate` of ``[S, T]`` values under
    ``mask``, fp32 ``[S, T]`` >= 0, in closed form (no autograd: custom-op bodies run without it).

    The aggregate is linear in ``v``, so ``aggregate(v) = sum(w * v)`` over the kept tokens.
    """
    weight = mask.to(torch.float32)
    keep = mask if mask.dtype == torch.bool else mask != 0
    weight = torch.where(keep, weight, 0.0)
    if loss_agg_mode == "token-mean":
        return weight / _nonzero_or_one(weight.sum())
    if loss_agg_mode == "token-sum":
        return weight
    if loss_agg_mode not in _SEQ_MODES:
        raise ValueError(
            f"loss_agg_mode must be one of {('token-mean', 'token-sum') + _SEQ_MODES}, got {loss_agg_mode!r}"
        )
    seq_tokens = weight.sum(dim=-1, keepdim=True)
    if loss_agg_mode == "seq-mean-token-mean":
        weight = weight / _nonzero_or_one(seq_tokens)
    seq_used = seq_tokens > 0
    weight = torch.where(seq_used, weight, 0.0) / _nonzero_or_one(seq_used.sum().to(torch.float32))
    if loss_agg_mode == "seq-mean-token-sum-norm":
        weight = weight / max(mask.shape[-1], 1)
    return weight


@dispatch.register("policy_loss", "torch")
def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprob: torch.Tensor,
    entropy: Optional[torch.Tensor],
    rollout_is_weights: Optional[torch.Tensor],
    settings: LossSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (dual clip), KL and entropy terms, aggregated as verl does. ``[S, T]`` inputs."""
    clip_ratio_c, kl_coef, entropy_coef = settings.clip_ratio_c, settings.kl_coef, settings.entropy_coef
    loss_agg_mode = settings.loss_agg_mode
    dt = compute_dtype(logprob, old_logprob, advantages, ref_logprob, entropy, rollout_is_weights)
    lp = logprob.to(dt)
    adv = advantages.to(dt)
    weight = mask.to(dt)
    keep = mask if mask.dtype == torch.bool else mask != 0

    log_ratio = clamped_log_ratio(lp, old_logprob.to(dt))
    ratio = log_ratio.exp()
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - settings.clip_ratio_low, 1.0 + settings.clip_ratio_high)
    pg = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if clip_ratio_c is None:
        dual_clipped = torch.zeros_like(clipped)
    else:
        loss_dual = -adv * clip_ratio_c
        dual_clipped = (pg > loss_dual) & (adv < 0)
        pg = torch.where(adv < 0, torch.minimum(loss_dual, pg), pg)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights.to(dt)

    pg_loss = aggregate(pg, weight, keep, loss_agg_mode)
    kl_loss = aggregate(kl_estimate(lp, ref_logprob.to(dt), settings.kl_type), weight, keep, loss_agg_mode)
    loss = pg_loss
    if kl_coef != 0.0:
        loss = loss + kl_coef * kl_loss
    if entropy is not None:
        entropy_loss = aggregate(entropy.to(dt), weight, keep, loss_agg_mode)
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * entropy_loss
    else:
        entropy_loss = torch.zeros((), dtype=dt, device=lp.device)

    metrics = {
        "pg_loss": pg_loss,
        "pg_clipfrac": masked_mean(clipped.to(dt), weight, keep),
        "pg_clipfrac_lower": masked_mean(dual_clipped.to(dt), weight, keep),
        "ppo_kl": masked_mean(-log_ratio, weight, keep),
        "kl_loss": kl_loss,
        "entropy": entropy_loss,
    }
    return loss, {name: value.detach() for name, value in metrics.items()}


def scored_mask(mask: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``mask`` (bool or float ``[S, T]``, kept in its dtype) with the tokens whose ``targets`` equal ``ignore_index`` removed."""
    scored = targets != ignore_index
    return mask & scored if mask.dtype == torch.bool else mask * scored
