"""verl's actor loss (``verl.workers.utils.losses.ppo_loss``) on ``rl_kernel_core.loss``.

Same signature, inputs, outputs and metric names as verl 0.9.1's ``ppo_loss`` with the vanilla
policy loss (``core_algos.compute_policy_loss_vanilla``), its KL loss (``core_algos.kl_penalty``)
and its aggregation (``core_algos.agg_loss``). This module does layout only: verl's own helpers
turn the model output and the batch into padded ``[bsz, response_len]`` tensors, then one
``policy_loss`` call computes the ratio, clipped surrogate, dual clip, KL term, entropy term and
the aggregation.

verl normalises every aggregate by *global* batch quantities so that gradients do not depend on
how a mini-batch is split into micro-batches and data-parallel ranks: ``token-mean`` divides the
local masked sum by the global token count ``batch_num_tokens`` and multiplies by ``dp_size``;
the ``seq-mean-*`` modes divide by ``global_batch_size``; ``seq-mean-token-sum-norm`` divides by
``loss_scale_factor`` when it is set. ``policy_loss`` applies that normalisation itself when given
a :class:`rl_kernel_core.loss.api.GlobalBatch` (the loss and each aggregate metric).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from rl_kernel_core import adapters, policy_loss, profiling
from rl_kernel_core.loss.api import KL_TYPES, LOSS_AGG_MODES, GlobalBatch
from rl_kernel_verl import targets


def unsupported_reason(config: Any) -> Optional[str]:
    """Why this actor config needs verl's own ``ppo_loss``, or None when rl-kernel serves it."""
    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    if loss_mode != "vanilla":
        return f"policy_loss.loss_mode={loss_mode!r} (rl-kernel implements 'vanilla')"
    if config.loss_agg_mode not in LOSS_AGG_MODES:
        return f"loss_agg_mode={config.loss_agg_mode!r} (rl-kernel implements {list(LOSS_AGG_MODES)})"
    if config.use_kl_loss and config.kl_loss_type not in KL_TYPES:
        return f"kl_loss_type={config.kl_loss_type!r} (rl-kernel implements {list(KL_TYPES)})"
    if config.entropy_coeff < 0 or (config.use_kl_loss and config.kl_loss_coef < 0):
        return f"negative coefficient (entropy_coeff={config.entropy_coeff}, kl_loss_coef={config.kl_loss_coef})"
    return None


def ppo_loss(config: Any, model_output: dict, data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict]:
    """Drop-in for verl's ``ppo_loss``: ``(loss, metrics)`` from the model output and the batch.

    ``model_output["log_probs"]`` (and ``["entropy"]`` when computed) are nested per-sequence
    tensors over prompt + response; ``data`` holds ``response_mask``, ``old_log_probs``,
    ``advantages`` and, when present, ``ref_log_prob`` and ``rollout_is_weights``. ``loss`` is a
    0-d fp32 tensor to call ``backward`` on; ``metrics`` has verl's keys (``actor/pg_loss``,
    ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``, ``actor/entropy_loss``
    when entropy is computed, ``kl_loss`` and ``kl_coef`` with the KL loss) as verl ``Metric``s.
    """
    no_padding_2_padding = adapters.resolve(targets.PADDING)
    metric_cls = adapters.resolve(targets.METRIC)
    aggregation = adapters.resolve(targets.AGGREGATION)

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = model_output.get("entropy", None)
    if entropy is not None:
        entropy = no_padding_2_padding(entropy, data)

    config.global_batch_info.update(
        dp_size=data["dp_size"],
        batch_num_tokens=data["batch_num_tokens"],
        global_batch_size=data["global_batch_size"],
        loss_scale_factor=config.loss_scale_factor,
    )
    global_batch = GlobalBatch(
        dp_size=data["dp_size"],
        batch_num_tokens=data["batch_num_tokens"],
        global_batch_size=data["global_batch_size"],
        loss_scale_factor=config.loss_scale_factor,
    )
    global_norm = (
        data["dp_size"] > 1
        or data["batch_num_tokens"] is not None
        or data["global_batch_size"] is not None
        or config.loss_scale_factor is not None
    )
    metric_aggregation = aggregation.SUM if global_norm else aggregation.MEAN

    fields = ["response_mask", "old_log_probs", "advantages"]
    fields += [f for f in ("rollout_is_weights", "ref_log_prob") if f in data]
    batch = data.select(*fields).to_padded_tensor()
    mask = batch["response_mask"].to(bool)
    use_kl = bool(config.use_kl_loss)
    clip_ratio = config.clip_ratio

    with profiling.region("loss", log_prob.device):
        loss, m = policy_loss(
            log_prob,
            batch["old_log_probs"],
            batch["advantages"],
            mask,
            ref_logprob=batch["ref_log_prob"] if use_kl else None,
            clip_ratio_low=config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio,
            clip_ratio_high=config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio,
            clip_ratio_c=config.get("clip_ratio_c", 3.0),
            kl_type=config.kl_loss_type if use_kl else "k1",
            kl_coef=config.kl_loss_coef if use_kl else 0.0,
            entropy=entropy,
            entropy_coef=config.entropy_coeff if entropy is not None else 0.0,
            loss_agg_mode=config.loss_agg_mode,
            rollout_is_weights=batch.get("rollout_is_weights", None),
            global_batch=global_batch,
        )

    clipfrac, ppo_kl, clipfrac_lower = torch.stack([m["pg_clipfrac"], m["ppo_kl"], m["pg_clipfrac_lower"]]).tolist()
    metrics = metric_cls.from_dict(
        {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": clipfrac_lower},
        aggregation=aggregation.MEAN,
    )
    metrics["actor/pg_loss"] = metric_cls(value=m["pg_loss"], aggregation=metric_aggregation)
    if entropy is not None:
        metrics["actor/entropy_loss"] = metric_cls(value=m["entropy"], aggregation=metric_aggregation)
    if use_kl:
        metrics["kl_loss"] = metric_cls(value=m["kl_loss"], aggregation=metric_aggregation)
        metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics
