"""Contract stand-in for ``vime.backends.megatron_utils.loss`` (not vime; see the package docstring).

Follows slime's ``slime/backends/megatron_utils/loss.py`` for one tensor- and one
context-parallel rank. Parallel sizes are read from Megatron's argument names
(``args.tensor_model_parallel_size``, ``args.context_parallel_size``) because the stand-in has no
process groups; sizes above 1 raise ``NotImplementedError``, as do policy-loss features outside
the PPO/GRPO path. ``calculate_log_probs_and_entropy``, ``compute_approx_kl`` and
``compute_policy_loss`` are imported by name, as slime does. Log-probs go through one of vime's
two provider boundaries: :mod:`vime.backends.megatron_utils.selected_logprob_provider` when
``args.selected_logprob_provider`` is set (the call site of RL-Align/vime commit
e0d231806e06a3000b9ba4f5be4bd7ba235dfcdc, hidden states included when a
``linear_logp_context`` is passed), :mod:`vime.backends.megatron_utils.linear_logp_provider`
otherwise (vime's loss module since pull requests 423/424). No vime commit has both; the
stand-in keeps both call sites so that one process can exercise either boundary.
"""

from argparse import Namespace
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any, Optional

import torch

from vime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
from vime.backends.megatron_utils.linear_logp_provider import LinearLogpRequest, TokenLayout, compute_linear_logp
from vime.backends.megatron_utils.selected_logprob_provider import (
    ContextParallelLayout,
    SelectedLogprobRequest,
    compute_selected_logprobs,
)
from vime.utils.misc import load_function
from vime.utils.ppo_utils import calculate_log_probs_and_entropy, compute_approx_kl, compute_policy_loss

_UNREPRODUCED_FLAGS = (
    "use_opsm",
    "use_tis",
    "get_mismatch_metrics",
    "use_score_centering",
    "use_unbiased_kl",
    "allgather_cp",
)


def _single_rank(args: Namespace) -> None:
    for name in ("tensor_model_parallel_size", "context_parallel_size"):
        if getattr(args, name, 1) > 1:
            raise NotImplementedError(
                f"contract stand-in: {name} > 1 is not reproduced (needs Megatron process groups)"
            )


def _shifted_targets(
    num_rows: int, unconcat_tokens: list[torch.Tensor], total_lengths: list[int], device: torch.device
) -> torch.Tensor:
    """``[T]`` int64: row ``p`` of each sample holds the token at ``p + 1`` (0 at sample ends and padding)."""
    full_tokens = torch.zeros(num_rows, dtype=torch.long, device=device)
    offset = 0
    for tokens, total_length in zip(unconcat_tokens, total_lengths):
        full_tokens[offset : offset + total_length - 1] = tokens[1:total_length]
        offset += total_length
    return full_tokens


def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args: Namespace,
    unconcat_tokens: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    with_entropy: bool = False,
    non_loss_data: bool = True,
    linear_logp_context: Optional[Mapping[str, Any]] = None,
) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """Per-sample response log-probs (and entropies) from packed ``logits [1, T, V/TP]`` fp32.

    As vime's provider-era function: every row of the micro-batch is scored at once through a
    provider boundary (``calculate_log_probs_and_entropy`` as the native path), then each
    sample's response rows are cut out. With ``args.selected_logprob_provider`` set, the request
    is vime's ``SelectedLogprobRequest`` built as at RL-Align/vime e0d23180: the tempered logits,
    ``temperature=args.rollout_temperature``, ``global_vocab_size=args.padded_vocab_size``,
    ``real_vocab_size=args.vocab_size``, and the hidden states and LM head when
    ``linear_logp_context`` (``hidden``, ``lm_head_weight``, ``lm_head_bias``,
    ``vocab_start_index``, optionally ``global_vocab_size``/``real_vocab_size``) is given.
    Otherwise it is a ``LinearLogpRequest`` without hidden-state context (the call site of the
    commit that boundary mirrors is not in the public sources; this follows its predecessor,
    which built the request from the tempered logits alone).

    Returns ``(torch.empty(0), {"log_probs": [R_i] tensors, "entropy": [R_i] tensors})``; the
    ``entropy`` key only with ``with_entropy``.
    """
    assert non_loss_data
    assert logits.dtype == torch.float32, f"{logits.dtype}"
    assert len(logits.shape) == 3 and logits.size(0) == 1, f"{logits.shape}"
    _single_rank(args)
    logits = logits.squeeze(0)
    if args.rollout_temperature != 1.0:
        logits = logits / args.rollout_temperature
    logits = logits.contiguous()
    targets = _shifted_targets(logits.size(0), unconcat_tokens, total_lengths, logits.device)
    # the fields both request classes have, as vime fills them on one tensor-parallel rank
    common: dict[str, Any] = {
        "logits": logits,
        "target_ids": targets,
        "tensor_parallel_group": None,
        "with_entropy": with_entropy,
        "with_entropy_grad": with_entropy,
        "chunk_size": args.log_probs_chunk_size,
    }
    if getattr(args, "selected_logprob_provider", None) is not None:
        context = linear_logp_context or {}
        selected = SelectedLogprobRequest(
            **common,
            context_parallel=ContextParallelLayout(world_size=1, rank=0, layout="single"),
            hidden=context.get("hidden"),
            lm_head_weight=context.get("lm_head_weight"),
            lm_head_bias=context.get("lm_head_bias"),
            vocab_start_index=int(context.get("vocab_start_index", 0)),
            global_vocab_size=context.get("global_vocab_size", getattr(args, "padded_vocab_size", None)),
            real_vocab_size=context.get("real_vocab_size", getattr(args, "vocab_size", None)),
            temperature=args.rollout_temperature,
            metadata={
                "logits_are_temperature_scaled": True,
                "real_vocab_size": getattr(args, "vocab_size", None),
                "padded_vocab_size": getattr(args, "padded_vocab_size", None),
                "tp_rank": 0,
                "tp_world_size": 1,
            },
        )
        log_prob_full, entropy_full = compute_selected_logprobs(
            args=args, request=selected, native=calculate_log_probs_and_entropy
        )
    else:
        if linear_logp_context is not None:
            raise NotImplementedError(
                "contract stand-in: linear_logp_context goes through the selected-logprob boundary only"
            )
        request = LinearLogpRequest(
            **common,
            token_layout=TokenLayout(world_size=1, rank=0, layout="single"),
            temperature=args.rollout_temperature,
            metadata={"logits_are_temperature_scaled": True},
        )
        log_prob_full, entropy_full = compute_linear_logp(
            args=args, request=request, native=calculate_log_probs_and_entropy
        )
    log_prob_full = log_prob_full.squeeze(-1)
    log_probs_list = []
    entropy_list = []
    end = 0
    for total_length, response_length in zip(total_lengths, response_lengths):
        end += total_length
        rows = slice(end - response_length - 1, end - 1)
        log_probs_list.append(log_prob_full[rows])
        if entropy_full is not None:
            entropy_list.append(entropy_full[rows])
    res = {"log_probs": log_probs_list}
    if with_entropy:
        res["entropy"] = entropy_list
    return torch.empty((0,), device=logits.device), res


def policy_loss_function(
    args: Namespace,
    batch: dict[str, Any],
    logits: torch.Tensor,
    sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO policy loss over packed responses and its metrics (slime's PPO path).

    ``batch``: ``advantages``, ``log_probs`` (old policy), ``unconcat_tokens``,
    ``response_lengths``, ``total_lengths``, ``loss_masks``, optionally ``ref_log_probs`` and
    ``rollout_log_probs`` (per-sample lists). Returns ``(loss, metrics)``: metrics are detached
    0-d tensors ``loss``, ``pg_loss``, ``entropy_loss``, ``pg_clipfrac``, ``ppo_kl``, then
    ``train_rollout_logprob_abs_diff`` when rollout log-probs are present and ``kl_loss`` with
    ``use_kl_loss``.
    """
    for flag in _UNREPRODUCED_FLAGS:
        if getattr(args, flag, False):
            raise NotImplementedError(f"contract stand-in: {flag} is not reproduced")
    if args.advantage_estimator in ("gspo", "cispo") or getattr(args, "rollout_top_p", 1.0) != 1.0:
        raise NotImplementedError("contract stand-in: only the PPO/GRPO policy loss is reproduced")

    advantages = torch.cat(batch["advantages"], dim=0)
    old_log_probs_list = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch["log_probs"]

    _, log_probs_and_entropy = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
        with_entropy=True,
    )
    log_probs_list = log_probs_and_entropy["log_probs"]
    if not old_log_probs_list:
        old_log_probs_list = [log_prob.detach() for log_prob in log_probs_list]
    old_log_probs = torch.cat(old_log_probs_list, dim=0)
    log_probs = torch.cat(log_probs_list, dim=0)
    ppo_kl = old_log_probs - log_probs

    pg_loss, pg_clipfrac = compute_policy_loss(
        ppo_kl, advantages, args.eps_clip, args.eps_clip_high, eps_clip_c=args.eps_clip_c
    )

    pg_loss = sum_of_sample_mean(pg_loss)
    pg_clipfrac = sum_of_sample_mean(pg_clipfrac)
    ppo_kl = sum_of_sample_mean(ppo_kl)

    entropy = torch.cat(log_probs_and_entropy["entropy"], dim=0)
    entropy_loss = sum_of_sample_mean(entropy)
    loss = pg_loss - args.entropy_coef * entropy_loss

    if args.use_kl_loss:
        ref_log_probs = torch.cat(batch["ref_log_probs"], dim=0)
        kl = compute_approx_kl(log_probs, ref_log_probs, kl_loss_type=args.kl_loss_type)
        kl_loss = sum_of_sample_mean(kl)
        loss = loss + args.kl_loss_coef * kl_loss

    if log_probs.numel() == 0:
        loss += 0 * logits.sum()

    train_rollout_logprob_abs_diff = None
    if "rollout_log_probs" in batch and batch["rollout_log_probs"]:
        rollout_log_probs = torch.cat(batch["rollout_log_probs"], dim=0)
        log_probs_to_compare = log_probs if args.use_rollout_logprobs else old_log_probs
        train_rollout_logprob_abs_diff = sum_of_sample_mean((log_probs_to_compare - rollout_log_probs).abs())

    reported_loss = {
        "loss": loss.clone().detach(),
        "pg_loss": pg_loss.clone().detach(),
        "entropy_loss": entropy_loss.clone().detach(),
        "pg_clipfrac": pg_clipfrac.clone().detach(),
        "ppo_kl": ppo_kl.clone().detach(),
    }
    if train_rollout_logprob_abs_diff is not None:
        reported_loss["train_rollout_logprob_abs_diff"] = train_rollout_logprob_abs_diff.clone().detach()
    if args.use_kl_loss:
        reported_loss["kl_loss"] = kl_loss.clone().detach()
    return loss, reported_loss


def loss_function(
    args: Namespace,
    batch: dict[str, Any],
    num_microbatches: int,
    step_global_batch_size: int,
    logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | int, dict[str, Any]]:
    """Dispatch on ``args.loss_type`` (``policy_loss`` or ``custom_loss`` through
    ``args.custom_loss_function_path``) and rescale for gradient accumulation (one DP rank).

    Returns ``(loss, normalizer, {"keys": [...], "values": tensor([denominator, *metrics])})``.
    """
    num_tokens = sum(torch.clamp_min(loss_mask.sum(), 1) for loss_mask in batch["loss_masks"])
    sum_of_sample_mean = get_sum_of_sample_mean(
        batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], args.calculate_per_token_loss
    )
    if args.loss_type == "policy_loss":
        func = policy_loss_function
    elif args.loss_type == "custom_loss":
        func = load_function(args.custom_loss_function_path)
    else:
        raise ValueError(f"Unknown loss type: {args.loss_type}")
    loss, log = func(args, batch, logits, sum_of_sample_mean)
    if not args.calculate_per_token_loss:
        loss = loss * num_microbatches / step_global_batch_size
    return (
        loss,
        num_tokens if args.calculate_per_token_loss else torch.tensor(1, device=logits.device),
        {
            "keys": list(log.keys()),
            "values": torch.stack(
                [
                    torch.as_tensor(
                        num_tokens if args.calculate_per_token_loss else 0, dtype=torch.float32, device=logits.device
                    )
                ]
                + [v.float() for v in log.values()]
            ),
        },
    )
