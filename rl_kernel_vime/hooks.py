"""The replacements for vime's functions, also usable through vime's hook flags.

``VIME_RL_KERNEL=1`` puts these functions in place of vime's (see :mod:`rl_kernel_vime.targets`);
users who prefer flags name them directly::

    --loss-type custom_loss --custom-loss-function-path rl_kernel_vime.hooks.policy_loss_function
    --custom-megatron-init-path rl_kernel_vime.hooks.megatron_init   # all hooks, as the switch does

vime's provider boundary for log-probs takes rl-kernel without any hook
(``--linear-logp-provider rl_kernel_vime.provider.provider``, :mod:`rl_kernel_vime.provider`);
the switch makes that provider the default (:func:`linear_logp_provider_path`).

Each function keeps its vime counterpart's signature and return convention, rearranges vime's
layout (packed sequences, per-sample lists) and calls rl_kernel_core's public ops; it holds no
formula of its own. Inputs it cannot serve (context or tensor parallelism, loss features
outside PPO/GRPO, estimators whose clamps differ) go to vime's own function with a one-time log,
or raise :class:`rl_kernel_vime.fallback.FallbackError` under ``VIME_RL_KERNEL_STRICT=1``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from argparse import Namespace
from typing import Any, Callable, Optional

import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from rl_kernel_vime import fallback, layout, registry, timing
from rl_kernel_vime.targets import LOSS, MODEL, PPO_UTILS, PROVIDER_BOUNDARY, PROVIDER_PATH

IGNORE_INDEX = -100
KL_TYPES: tuple[str, ...] = ("k1", "k2", "low_var_kl")
"""vime's ``kl_loss_type`` values served by ``rl_kernel_core.ratio_kl`` with vime's semantics.
vime's ``k3`` is the unclamped estimator, rl_kernel_core's ``k3`` is clamped like
``low_var_kl``: ``k3`` falls back."""

_UNSUPPORTED_LOSS_FLAGS = ("use_opsm", "use_tis", "get_mismatch_metrics", "use_score_centering", "use_unbiased_kl")
_ENTROPY_GRAD_FLAGS = ("with_entropy_grad", "entropy_no_grad")
_NEUTRAL_WHEN_UNSET = (
    "log_prob_keep_mask",
    "true_on_policy",
    "with_dppo_directional_moment",
    "top_p_token_ids",
    "top_p_token_offsets",
    "linear_logp_context",  # vime (RL-Align/vime e0d23180) passes the LM-head capture; set, it goes to vime's provider boundary
)
_ALWAYS_NEUTRAL = ("vocab_size", "non_loss_data")


def _extra_reason(kwargs: dict[str, Any]) -> Optional[str]:
    """Why keyword arguments beyond the documented interface (newer vime versions) need vime's code."""
    for name, value in kwargs.items():
        if name in _ENTROPY_GRAD_FLAGS or name in _ALWAYS_NEUTRAL:
            continue
        if name in _NEUTRAL_WHEN_UNSET and (value is None or value is False):
            continue
        return f"argument {name} is set and not supported"  # never the value: one log line per kind
    return None


def _entropy_detached(kwargs: dict[str, Any]) -> bool:
    """Whether newer vime asked for entropy without gradient (a metric only)."""
    return kwargs.get("with_entropy_grad", True) is False or kwargs.get("entropy_no_grad", False) is True


def _vime_after_restore(key: str) -> Callable[[Callable], Callable]:
    """The hook for target ``key``, calling vime's function instead once :func:`rl_kernel_vime.restore`
    put it back, until an activation patches the target in again (a later activation that leaves
    it off, its op not selected, keeps passing through): restore rebinds vime's own modules, not a
    module elsewhere that imported the hook by name, which would otherwise keep running rl-kernel
    while ``status()`` says the target is not live. The flag is read on every call."""

    def wrap(hook: Callable) -> Callable:
        @functools.wraps(hook)
        def run(*args: Any, **kwargs: Any) -> Any:
            if registry.restored(key):
                return registry.original(key)(*args, **kwargs)
            return hook(*args, **kwargs)

        return run

    return wrap


def _live(module: str, attr: str) -> Callable:
    """What vime's ``module.attr`` is now: our hook when its op is on, vime's function otherwise."""
    return getattr(importlib.import_module(module), attr)


@_vime_after_restore(f"{PPO_UTILS}:calculate_log_probs_and_entropy")
def calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group: Any,
    with_entropy: bool = False,
    chunk_size: int = -1,
    **kwargs: Any,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """vime's ``calculate_log_probs_and_entropy`` on ``rl_kernel_core.logprob_from_logits``.

    Args:
        logits: ``[T, V]`` float logits, already divided by the temperature.
        tokens: ``[T]`` int64/int32 ids in ``[0, V)``.
        tp_group: tensor-parallel group; more than one rank falls back (vocab-parallel logits).
        with_entropy: also return entropies.
        chunk_size: accepted for compatibility; the op bounds its own memory.

    Returns:
        ``(log_prob [T, 1], entropy [T] or None)``, fp32; ``T = 0`` gives a 1-D empty log-prob,
        as vime does. Differentiable in ``logits`` through both.
    """
    reason = _extra_reason(kwargs)
    world = layout.tp_world_size(tp_group)
    if reason is None and world > 1:
        reason = f"vocab-parallel logits (TP={world}): rl_kernel_core.logprob_from_logits takes no tp_group yet"
    if reason is not None:
        fallback.fall_back("logprob", reason)
        original = registry.original(f"{PPO_UTILS}:calculate_log_probs_and_entropy")
        return original(logits, tokens, tp_group, with_entropy=with_entropy, chunk_size=chunk_size, **kwargs)
    with timing.region(timing.logprob_region(), logits.device):
        out = rk.logprob_from_logits(logits, tokens, ignore_index=IGNORE_INDEX, return_entropy=with_entropy)
    log_prob, entropy = out if with_entropy else (out, None)
    if entropy is not None and _entropy_detached(kwargs):
        entropy = entropy.detach()
    return (log_prob if logits.size(0) == 0 else log_prob.unsqueeze(-1)), entropy


@_vime_after_restore(f"{LOSS}:get_log_probs_and_entropy")
def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args: Namespace,
    unconcat_tokens: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    with_entropy: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """vime's ``get_log_probs_and_entropy``: per-sample response log-probs from packed logits.

    Args:
        logits: ``[1, T, V]`` float (vime: fp32) logits of the packed micro-batch.
        args: vime's arguments; ``rollout_temperature`` (default 1) divides the logits,
            ``context_parallel_size``/``tensor_model_parallel_size`` above 1 fall back.
        unconcat_tokens: per sample, its ``total_lengths[i]`` token ids.
        total_lengths, response_lengths: per-sample lengths (prompt + response, response).
        with_entropy: also return entropies.

    Returns:
        ``(torch.empty(0), {"log_probs": [R_i] fp32 per sample, "entropy": [R_i] per sample})``
        (``entropy`` only with ``with_entropy``), differentiable in ``logits``. One op call
        scores every response row of the micro-batch; other rows are ignored.
    """
    reason = layout.parallel_reason(args) or _extra_reason(kwargs)
    if reason is not None:
        fallback.fall_back("logprob", reason)
        original = registry.original(f"{LOSS}:get_log_probs_and_entropy")
        return original(
            logits,
            args=args,
            unconcat_tokens=unconcat_tokens,
            total_lengths=total_lengths,
            response_lengths=response_lengths,
            with_entropy=with_entropy,
            **kwargs,
        )
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.size(0) != 1:
        raise ValueError(
            f"logits must be a [1, T, V] tensor (packed micro-batch), got {getattr(logits, 'shape', type(logits).__name__)}"
        )
    num_rows = logits.size(1)
    rows = layout.response_rows(total_lengths, response_lengths, num_rows)
    targets = layout.response_targets(
        rows, unconcat_tokens, response_lengths, total_lengths, num_rows, IGNORE_INDEX, logits.device
    )
    with timing.region(timing.logprob_region(), logits.device):
        out = rk.logprob_from_logits(
            logits[0],
            targets,
            temperature=getattr(args, "rollout_temperature", 1.0),
            ignore_index=IGNORE_INDEX,
            return_entropy=with_entropy,
        )
    log_prob, entropy = out if with_entropy else (out, None)
    res = {"log_probs": layout.split_rows(log_prob, rows)}
    if entropy is not None:
        res["entropy"] = layout.split_rows(entropy, rows)
    return torch.empty((0,), device=logits.device), res


@_vime_after_restore(f"{PPO_UTILS}:compute_approx_kl")
def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """vime's ``compute_approx_kl`` on ``rl_kernel_core.ratio_kl``.

    Args:
        log_probs, log_probs_base: per-token log-probs, one shape, float.
        kl_loss_type: ``k1`` (log-ratio), ``k2`` (half squared log-ratio) or ``low_var_kl``
            (k3 clamped to ±10; rl_kernel_core also clamps the log-ratio to ±20 before ``exp``,
            which cannot change a value the ±10 clamp keeps). Others fall back.
        importance_ratio: not supported (vime clamps after multiplying by it): falls back.

    Returns:
        Per-token KL, fp32, the input shape; differentiable in both log-prob inputs.
    """
    reason = None
    if kl_loss_type == "k3":
        reason = "kl_loss_type='k3' is unclamped in vime and clamped in rl_kernel_core"
    elif kl_loss_type not in KL_TYPES:
        reason = f"kl_loss_type={kl_loss_type!r} is not one of {list(KL_TYPES)}"
    elif importance_ratio is not None:
        reason = "importance_ratio is applied before vime's low_var_kl clamp; rl_kernel_core.ratio_kl has no such input"
    if reason is not None:
        fallback.fall_back("ratio_kl", reason)
        original = registry.original(f"{PPO_UTILS}:compute_approx_kl")
        return original(log_probs, log_probs_base, kl_loss_type, importance_ratio=importance_ratio)
    with timing.region("ratio_kl", log_probs.device):
        _, kl = rk.ratio_kl(log_probs, log_probs_base, kl_type=kl_loss_type)
    return kl


def _policy_loss_reason(args: Namespace) -> Optional[str]:
    """Why ``args`` asks for loss features outside the PPO/GRPO path served here, or None."""
    for flag in _UNSUPPORTED_LOSS_FLAGS:
        if getattr(args, flag, False):
            return f"args.{flag} is set"
    estimator = getattr(args, "advantage_estimator", None)
    if estimator in ("gspo", "cispo"):
        return f"advantage_estimator={estimator!r} uses another policy loss"
    if getattr(args, "custom_pg_loss_reducer_function_path", None):
        return "a custom pg-loss reducer is set"
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        return "rollout top-p replay masks the log-probs"
    if getattr(args, "allgather_cp", False) and (getattr(args, "context_parallel_size", 1) or 1) > 1:
        return "allgather context parallel"
    c = getattr(args, "eps_clip_c", None)
    if c is not None and not c > 1.0:
        return f"eps_clip_c={c} (dual clip needs > 1)"
    if args.entropy_coef < 0:
        return f"entropy_coef={args.entropy_coef} < 0"
    if getattr(args, "use_kl_loss", False):
        if args.kl_loss_type not in KL_TYPES:
            return f"kl_loss_type={args.kl_loss_type!r} (served: {list(KL_TYPES)}; vime's k3 is unclamped)"
        if args.kl_loss_coef < 0:
            return f"kl_loss_coef={args.kl_loss_coef} < 0"
    return layout.parallel_reason(args)


@_vime_after_restore(f"{LOSS}:policy_loss_function")
def policy_loss_function(
    args: Namespace,
    batch: dict[str, Any],
    logits: torch.Tensor,
    sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vime's PPO/GRPO ``policy_loss_function`` on ``rl_kernel_core.loss``.

    Log-probs and entropies come from vime's ``get_log_probs_and_entropy`` as bound now (this
    module's when the ``logprob`` op is on). The clipped surrogate (``eps_clip``,
    ``eps_clip_high``, dual clip ``eps_clip_c``), the entropy term (``entropy_coef``) and, with
    ``use_kl_loss``, the KL term (``kl_loss_type``, ``kl_loss_coef``) run in one
    ``policy_loss`` call. vime reduces per-token values with ``sum_of_sample_mean``, a weighted
    token sum; ``policy_loss`` takes those weights as its float mask and returns the weighted
    mean (``token-mean``), which the total weight turns back into vime's sum.

    Args:
        args: vime's arguments (see :func:`_policy_loss_reason` for what falls back).
        batch: ``advantages``, ``log_probs`` (old policy), ``unconcat_tokens``,
            ``total_lengths``, ``response_lengths``, and as vime has them ``ref_log_probs``,
            ``rollout_log_probs`` (per-sample lists of ``[R_i]`` tensors).
        logits: ``[1, T, V]`` packed logits.
        sum_of_sample_mean: vime's reducer over ``[sum R_i]`` per-token values.

    Returns:
        ``(loss, metrics)`` as vime: 0-d loss differentiable in ``logits``; detached 0-d
        metrics ``loss``, ``pg_loss``, ``entropy_loss``, ``pg_clipfrac``, ``ppo_kl``, then
        ``train_rollout_logprob_abs_diff`` (when rollout log-probs are present) and ``kl_loss``
        (with ``use_kl_loss``).

    Raises:
        ValueError: a setting rl_kernel_core refuses (negative, NaN, infinite, or an int beyond
            the float range), named as the op's argument it feeds: ``eps_clip`` ->
            ``clip_ratio_low``, ``eps_clip_high`` -> ``clip_ratio_high``, ``eps_clip_c`` ->
            ``clip_ratio_c``, ``kl_loss_coef`` -> ``kl_coef``, ``entropy_coef``,
            and, through the ``logprob`` hook, ``rollout_temperature`` -> ``temperature``.
    """
    reason = _policy_loss_reason(args)
    if reason is not None:
        fallback.fall_back("grpo_loss", reason)
        return registry.original(f"{LOSS}:policy_loss_function")(args, batch, logits, sum_of_sample_mean)

    use_rollout = getattr(args, "use_rollout_logprobs", False)
    use_kl = getattr(args, "use_kl_loss", False)
    _, res = _live(LOSS, "get_log_probs_and_entropy")(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
        with_entropy=True,
    )
    log_probs = torch.cat(res["log_probs"], dim=0)
    entropy = torch.cat(res["entropy"], dim=0)
    old = batch["rollout_log_probs"] if use_rollout else batch.get("log_probs")
    old_log_probs = torch.cat(old, dim=0) if old else log_probs.detach()
    advantages = torch.cat(batch["advantages"], dim=0)
    ref_log_probs = torch.cat(batch["ref_log_probs"], dim=0) if use_kl else None

    with timing.region("loss", logits.device):
        # vime's reducer is a weighted token sum: the weights as a float mask, aggregated by token-sum
        weights = layout.reducer_weights(sum_of_sample_mean, log_probs.numel(), log_probs.device)
        loss, m = rk.policy_loss(
            log_probs,
            old_log_probs,
            advantages,
            weights,
            ref_logprob=ref_log_probs,
            clip_ratio_low=args.eps_clip,
            clip_ratio_high=args.eps_clip_high,
            clip_ratio_c=getattr(args, "eps_clip_c", None),
            kl_type=args.kl_loss_type if use_kl else "k1",
            kl_coef=args.kl_loss_coef if use_kl else 0.0,
            entropy=entropy,
            entropy_coef=args.entropy_coef,
            loss_agg_mode="token-sum",
        )
        total_weight = weights.sum()  # the token-mean clip fraction as a weighted sum too
        metrics = {
            "loss": loss.detach(),
            "pg_loss": m["pg_loss"],
            "entropy_loss": m["entropy"],
            "pg_clipfrac": m["pg_clipfrac"] * total_weight,
            # vime's ppo_kl is unclamped; rl_kernel_core's metric takes verl's ±20 log-ratio clamp
            "ppo_kl": sum_of_sample_mean(old_log_probs - log_probs.detach()).detach(),
        }
        rollout = batch.get("rollout_log_probs")
        if rollout:
            compared = log_probs if use_rollout else old_log_probs
            _, abs_diff = rk.ratio_kl(compared.detach(), torch.cat(rollout, dim=0), kl_type="abs")
            metrics["train_rollout_logprob_abs_diff"] = sum_of_sample_mean(abs_diff).detach()
        if use_kl:
            metrics["kl_loss"] = m["kl_loss"]
    return loss, metrics


def _step_fields(original: Callable, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {}
    fields = {name: bound[name] for name in ("rollout_id", "step_id") if isinstance(bound.get(name), int)}
    decisions = dispatch.explain()
    fields["backends"] = {
        op: decisions[op].backend for op in ("logprob_from_logits", "ratio_kl", "policy_loss") if op in decisions
    }
    fields["fallbacks"] = fallback.counts()
    return fields


@_vime_after_restore(f"{MODEL}:train_one_step")
def train_one_step(*args: Any, **kwargs: Any) -> Any:
    """vime's ``train_one_step``, timed: closes the step's profiling record.

    Runs vime's function in the ``step`` region, writes the step's JSONL record (regions,
    ``rollout_id``/``step_id``, the backend each op used, fallback counts) and adds
    ``perf/rl_kernel/<region>_ms`` to the metrics dict vime returns (on the rank whose dict is
    not empty: the one that reports). Regions timed between steps (the old/ref log-prob passes)
    count towards the next step.
    """
    original = registry.original(f"{MODEL}:train_one_step")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    with timing.region("step", device):
        result = original(*args, **kwargs)
    step_metrics = timing.close_step(**_step_fields(original, args, kwargs))
    if step_metrics and isinstance(result, tuple) and result and isinstance(result[0], dict) and result[0]:
        result[0].update(step_metrics)
    return result


@_vime_after_restore(f"{PROVIDER_BOUNDARY}:linear_logp_provider_path")
def linear_logp_provider_path(args: Any) -> Optional[str]:
    """vime's ``linear_logp_provider_path`` with rl-kernel's provider as the default.

    vime asks this on every log-prob call which provider to load. The answer is the user's
    ``--linear-logp-provider`` when given (read by vime's own function), else
    ``"rl_kernel_vime.provider.provider"`` (:func:`rl_kernel_vime.provider.provider`), run in
    the ``--linear-logp-provider-mode`` vime reads (default ``auto``).
    """
    user_path = registry.original(f"{PROVIDER_BOUNDARY}:linear_logp_provider_path")(args)
    return user_path or PROVIDER_PATH


def megatron_init(args: Namespace) -> None:
    """For ``--custom-megatron-init-path``: turn every selected hook on in this process, as
    ``VIME_RL_KERNEL=1`` does (``VIME_RL_KERNEL_OPS``/``_STRICT``/``_PROFILE`` still apply)."""
    from rl_kernel_vime import activate

    activate()
