"""Contract stand-in for ``vime.utils.ppo_utils`` (not vime; see the package docstring).

Formulas as in slime's ``slime/utils/ppo_utils.py``. slime wraps ``compute_approx_kl`` and
``compute_policy_loss`` in ``torch.compile(dynamic=True)``; compilation does not change their
semantics and is left out here. ``compute_log_probs`` and ``compute_entropy_from_logits`` use
Megatron's vocab-parallel kernels in slime; with one tensor-parallel rank those reduce to the
plain log-softmax and entropy written below. More ranks raise ``NotImplementedError``.
"""

from typing import Optional

import torch
import torch.distributed as dist


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token KL estimate (Schulman's k1/k2/k3); only ``low_var_kl`` is clamped to ±10."""
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_loss_type in ["k3", "low_var_kl"]:
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    else:
        raise ValueError(f"Unknown kl_loss_type: {kl_loss_type}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)
    return kl


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate (dual clip with ``eps_clip_c``) and clip indicator."""
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).float()
    if eps_clip_c is not None:
        assert eps_clip_c > 1.0, f"eps_clip_c must be > 1.0 for dual-clip PPO, got {eps_clip_c}"
        pg_losses3 = -eps_clip_c * advantages
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    else:
        pg_losses = clip_pg_losses1
    return pg_losses, clipfrac


def _single_rank(tp_group) -> None:
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        raise NotImplementedError("contract stand-in: vocab-parallel log-probs need Megatron (TP > 1 not reproduced)")


def compute_log_probs(logits: torch.Tensor, tokens: torch.Tensor, process_group) -> torch.Tensor:
    """``log softmax(logits)[token]`` as ``[T, 1]`` (slime: ``-fused_vocab_parallel_cross_entropy``)."""
    _single_rank(process_group)
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1))


def compute_entropy_from_logits(logits: torch.Tensor, process_group) -> torch.Tensor:
    """Entropy ``[T]`` of ``softmax(logits)``: ``max + log sum exp(z - max) - sum softmax * z``."""
    _single_rank(process_group)
    logits_max = logits.max(dim=-1, keepdim=True).values
    exp_logits = (logits - logits_max).exp()
    sum_exp = exp_logits.sum(dim=-1, keepdim=True)
    softmax = exp_logits / sum_exp
    entropy = logits_max + sum_exp.log() - (softmax * logits).sum(dim=-1, keepdim=True)
    return entropy.squeeze(-1)


def calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    with_entropy_grad: bool = True,
    log_prob_keep_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs ``[T, 1]`` of ``tokens`` and, with ``with_entropy``, entropies ``[T]``.

    ``logits [T, V/TP]``; ``chunk_size > 0`` processes rows in chunks. ``T = 0`` gives 1-D empties.
    ``with_entropy_grad=False`` returns the entropy detached (a metric only). The rollout top-p
    replay mask ``log_prob_keep_mask [T, V/TP]`` (bool) sets dropped tokens to ``-inf`` for the
    log-probs only; the entropy stays that of the unmasked logits. (vime's native function as
    its provider boundary calls it.)
    """
    logits = logits.contiguous()
    scored = logits if log_prob_keep_mask is None else logits.masked_fill(~log_prob_keep_mask, float("-inf"))
    entropy = None
    if logits.size(0) != 0:
        num_chunks = (logits.size(0) - 1) // chunk_size + 1 if chunk_size > 0 else 1
        tokens_chunks = tokens.chunk(num_chunks, dim=0)
        scored_chunks = scored.chunk(num_chunks, dim=0)
        log_prob = torch.cat(
            [compute_log_probs(sc.clone(), tc, tp_group) for tc, sc in zip(tokens_chunks, scored_chunks)], dim=0
        )
        if with_entropy:
            with torch.set_grad_enabled(with_entropy_grad and torch.is_grad_enabled()):
                entropy = torch.cat(
                    [compute_entropy_from_logits(lc.clone(), tp_group) for lc in logits.chunk(num_chunks, dim=0)], dim=0
                )
    else:
        log_prob = logits.new_zeros((0,))
        if with_entropy:
            entropy = logits.new_zeros((0,))
    return log_prob, entropy
