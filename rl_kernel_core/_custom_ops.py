"""Backend-independent halves of the loss custom ops, shared by the ``triton`` and ``native`` backends.

Each fast backend defines its own ``torch.library`` custom ops (``rl_kernel::<backend>_*``) with
the same schemas: ``logprob_from_logits`` → ``(logprob [N], entropy [N] or [0], lse [N])`` and its
backward → ``d logits``; ``ratio_kl`` → ``(ratio, kl)`` and its backward → ``d logprob``;
``policy_loss`` → ``(loss [], metrics [6], seq_weight [S], totals [2])`` and its backward →
``(d logprob or [0], d entropy or [0])``; ``group_advantages`` → ``[N]``. What does not depend on
the kernels lives here: :func:`define_differentiable_op` (the op pair, and the eager path that
skips the dispatcher), the fake (meta) implementations, the autograd glue (``setup_context`` and
the backward, given the backend's backward), the ``supports`` predicates (the reasons a backend
gives for inputs its fp32 kernels do not serve) and the backend implementations that
:func:`rl_kernel_core.dispatch.register` registers, given the backend's forward.
"""

from __future__ import annotations

from typing import Callable, Collection, Optional

import torch

from rl_kernel_core._autograd import single_backward
from rl_kernel_core.policy_loss import METRIC_NAMES

Tensor = torch.Tensor
FAST_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
POLICY_LOSS_KNOBS: tuple[str, ...] = (
    "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "kl_type", "kl_coef", "entropy_coef", "loss_agg_mode",
)


# ---------------------------------------------------------------- op definition


def define_differentiable_op(
    name: str, forward_fn: Callable, forward_fake: Callable, backward_fn: Callable, backward_fake: Callable,
    setup: Callable, make_backward: Callable[[Callable], Callable],
) -> Callable:
    """Define the custom ops ``rl_kernel::<name>`` over ``forward_fn`` and ``rl_kernel::<name>_backward``
    over ``backward_fn`` (with these fakes, and autograd from ``setup`` and
    ``make_backward(backward op)``), and return what a backend implementation calls.

    The returned callable takes ``forward_fn``'s arguments. While ``torch.compile`` traces, it
    calls the custom op, so graphs see the op, its fake and its backward. In eager it applies a
    ``torch.autograd.Function`` over the same Python bodies, ``setup`` and backward: the same
    kernels, without the dispatcher's custom-op layers, which at RL sizes cost more host time per
    call than the kernels take on the GPU (``benchmarks/profile_host.py``). Either way the
    backward is not itself differentiable.
    """
    forward_op = torch.library.custom_op(f"rl_kernel::{name}", forward_fn, mutates_args=())
    backward_op = torch.library.custom_op(f"rl_kernel::{name}_backward", backward_fn, mutates_args=())
    forward_op.register_fake(forward_fake)
    backward_op.register_fake(backward_fake)
    forward_op.register_autograd(make_backward(backward_op), setup_context=setup)
    eager_backward = single_backward(f"rl_kernel::{name}")(make_backward(backward_fn))

    class Eager(torch.autograd.Function):
        # ctx in forward rather than a setup_context staticmethod: with the latter, apply() binds
        # the arguments through inspect.signature on every call
        @staticmethod
        def forward(ctx, *args):
            out = forward_fn(*args)
            setup(ctx, args, out)
            return out

        backward = staticmethod(eager_backward)

    def call(*args):
        return forward_op(*args) if torch.compiler.is_compiling() else Eager.apply(*args)

    return call


# ---------------------------------------------------------------- supports reasons


def fp64_reason(backend: str, **tensors: Optional[Tensor]) -> Optional[str]:
    """Why ``backend``'s fp32 kernels refuse these tensors (the first one not fp32/bf16/fp16), or None."""
    for name, t in tensors.items():
        if t is not None and t.dtype not in FAST_DTYPES:
            return f"{name} is {str(t.dtype).replace('torch.', '')}; the {backend} kernels compute in fp32 for fp32/bf16/fp16 inputs (use backend='torch')"
    return None


def grad_reason(backend: str, **tensors: Optional[Tensor]) -> Optional[str]:
    """Why ``backend`` refuses these tensors (the first one that requires grad: its kernels do not form that gradient), or None."""
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            return f"{name} requires grad; the {backend} kernels differentiate only the documented inputs (use backend='torch')"
    return None


# ---------------------------------------------------------------- logprob_from_logits


def logprob_supports(backend: str) -> Callable[..., Optional[str]]:
    """``backend``'s ``supports`` predicate for ``logprob_from_logits``: fp32/bf16/fp16 logits with unit stride along V."""

    def supports(logits, targets, temperature, ignore_index, return_entropy) -> Optional[str]:
        reason = fp64_reason(backend, logits=logits)
        if reason is None and logits.dim() == 2 and logits.shape[1] > 1 and logits.stride(1) != 1:
            reason = f"logits must have unit stride along V, got strides {tuple(logits.stride())}"
        return reason

    return supports


def logprob_impl(forward_op: Callable) -> Callable[..., tuple[Tensor, Optional[Tensor]]]:
    """The backend implementation of ``logprob_from_logits`` over ``forward_op`` (see :func:`define_differentiable_op`)."""

    def logprob_from_logits(
        logits: Tensor, targets: Tensor, temperature: float, ignore_index: int, return_entropy: bool
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Backend implementation: ``(logprob [N] fp32, entropy [N] fp32 or None)``, differentiable in ``logits``."""
        logprob, entropy, _lse = forward_op(logits, targets, float(temperature), int(ignore_index), bool(return_entropy))
        return logprob, (entropy if return_entropy else None)

    return logprob_from_logits



def logprob_fake(logits, targets, temperature, ignore_index, return_entropy):
    """Fake forward: ``(logprob [N], entropy [N] or [0], lse [N])`` fp32."""
    n = logits.shape[0]
    f32 = dict(dtype=torch.float32, device=logits.device)
    return logits.new_empty(n, **f32), logits.new_empty(n if return_entropy else 0, **f32), logits.new_empty(n, **f32)


def logprob_backward_fake(logits, targets, lse, entropy, grad_logprob, grad_entropy, temperature, ignore_index):
    """Fake backward: ``d logits`` of the logits' shape and dtype."""
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def logprob_setup(ctx, inputs, output) -> None:
    """``setup_context`` of the forward op: save the logits, targets, lse and entropy."""
    logits, targets, temperature, ignore_index, _return_entropy = inputs
    _logprob, entropy, lse = output
    ctx.save_for_backward(logits, targets, lse, entropy)
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def logprob_backward(backward_op: Callable) -> Callable:
    """The autograd backward of a forward op whose backward is ``backward_op`` (the custom op, or its Python body in eager)."""

    def backward(ctx, grad_logprob, grad_entropy, _grad_lse):
        logits, targets, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logprob is None and grad_entropy is None):
            return None, None, None, None, None
        if entropy.numel() == 0:
            grad_entropy = None
        grad = backward_op(logits, targets, lse, entropy, grad_logprob, grad_entropy, ctx.temperature, ctx.ignore_index)
        return grad, None, None, None, None

    return backward


# ---------------------------------------------------------------- ratio_kl


def _kl_type_reason(backend: str, kl_type: str, kl_types: Optional[Collection[str]]) -> Optional[str]:
    """Why ``backend`` refuses ``kl_type`` (its base estimator is not in ``kl_types``; None: all served), or None."""
    if kl_types is not None and kl_type.rstrip("+") not in kl_types:
        return f"kl_type={kl_type!r} has no {backend} kernel"
    return None


def ratio_kl_supports(backend: str, kl_types: Optional[Collection[str]] = None) -> Callable[..., Optional[str]]:
    """``backend``'s ``supports`` predicate for ``ratio_kl``.

    Refuses a ``kl_type`` whose base estimator (without ``+``) is not in ``kl_types`` (None: no
    such check), fp64 log-probs, and ``old_logprob``/``ref_logprob`` that require grad.
    """

    def supports(logprob, old_logprob, ref_logprob, kl_type) -> Optional[str]:
        return (
            _kl_type_reason(backend, kl_type, kl_types)
            or fp64_reason(backend, logprob=logprob, old_logprob=old_logprob, ref_logprob=ref_logprob)
            or grad_reason(backend, old_logprob=old_logprob, ref_logprob=ref_logprob)
        )

    return supports


def ratio_kl_impl(forward_op: Callable) -> Callable[..., tuple[Tensor, Tensor]]:
    """The backend implementation of ``ratio_kl`` over ``forward_op`` (see :func:`define_differentiable_op`)."""

    def ratio_kl(logprob: Tensor, old_logprob: Tensor, ref_logprob: Tensor, kl_type: str) -> tuple[Tensor, Tensor]:
        """Backend implementation: ``(ratio, kl)`` fp32, differentiable in ``logprob``."""
        return forward_op(logprob, old_logprob, ref_logprob, kl_type)

    return ratio_kl



def ratio_kl_fake(logprob, old_logprob, ref_logprob, kl_type):
    """Fake forward: ``(ratio, kl)`` fp32 of the input shape."""
    return logprob.new_empty(logprob.shape, dtype=torch.float32), logprob.new_empty(logprob.shape, dtype=torch.float32)


def ratio_kl_backward_fake(logprob, old_logprob, ref_logprob, grad_ratio, grad_kl, kl_type):
    """Fake backward: ``d logprob`` of logprob's shape and dtype."""
    return torch.empty(logprob.shape, dtype=logprob.dtype, device=logprob.device)


def ratio_kl_setup(ctx, inputs, output) -> None:
    """``setup_context`` of the forward op: save the three log-prob tensors."""
    logprob, old_logprob, ref_logprob, kl_type = inputs
    ctx.save_for_backward(logprob, old_logprob, ref_logprob)
    ctx.kl_type = kl_type
    ctx.set_materialize_grads(False)


def ratio_kl_backward(backward_op: Callable) -> Callable:
    """The autograd backward of a forward op whose backward is ``backward_op`` (the custom op, or its Python body in eager)."""

    def backward(ctx, grad_ratio, grad_kl):
        logprob, old_logprob, ref_logprob = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_ratio is None and grad_kl is None):
            return None, None, None, None
        return backward_op(logprob, old_logprob, ref_logprob, grad_ratio, grad_kl, ctx.kl_type), None, None, None

    return backward


# ---------------------------------------------------------------- policy_loss


def policy_loss_supports(
    backend: str, kl_types: Optional[Collection[str]] = None, agg_modes: Optional[Collection[str]] = None
) -> Callable[..., Optional[str]]:
    """``backend``'s ``supports`` predicate for ``policy_loss``.

    Refuses a ``loss_agg_mode`` not in ``agg_modes`` and a ``kl_type`` whose base estimator is not
    in ``kl_types`` (None: no such check), fp64 float inputs (a bool ``mask`` is fine), and any
    input but ``logprob`` and ``entropy`` that requires grad.
    """

    def supports(logprob, old_logprob, advantages, mask, ref_logprob, entropy, rollout_is_weights, **knobs) -> Optional[str]:
        floats = dict(logprob=logprob, old_logprob=old_logprob, advantages=advantages, ref_logprob=ref_logprob,
                      entropy=entropy, rollout_is_weights=rollout_is_weights)
        if mask.dtype != torch.bool:
            floats["mask"] = mask
        if agg_modes is not None and knobs["loss_agg_mode"] not in agg_modes:
            return f"loss_agg_mode={knobs['loss_agg_mode']!r} has no {backend} kernel"
        return _kl_type_reason(backend, knobs["kl_type"], kl_types) or fp64_reason(backend, **floats) or grad_reason(
            backend, old_logprob=old_logprob, advantages=advantages, mask=mask, ref_logprob=ref_logprob,
            rollout_is_weights=rollout_is_weights,
        )

    return supports


def policy_loss_impl(forward_op: Callable) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The backend implementation of ``policy_loss`` over ``forward_op`` (see :func:`define_differentiable_op`)."""

    def policy_loss(
        logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, ref_logprob: Tensor,
        entropy: Optional[Tensor], rollout_is_weights: Optional[Tensor], *,
        clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: Optional[float], kl_type: str,
        kl_coef: float, entropy_coef: float, loss_agg_mode: str,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Backend implementation over ``[S, T]`` tensors: ``(loss, metrics)``, differentiable in ``logprob`` and ``entropy``."""
        loss, metrics, _seq_weight, _totals = forward_op(
            logprob, old_logprob, advantages, mask, ref_logprob, entropy, rollout_is_weights,
            clip_ratio_low, clip_ratio_high, clip_ratio_c, kl_type, kl_coef, entropy_coef, loss_agg_mode,
        )
        return loss, {name: metrics[i] for i, name in enumerate(METRIC_NAMES)}

    return policy_loss



def policy_loss_fake(logprob, old_logprob, advantages, mask, ref_logprob, entropy, rollout_is_weights, *knobs):
    """Fake forward: ``(loss [], metrics [6], seq_weight [S], totals [2])`` fp32."""
    f32 = dict(dtype=torch.float32)
    return (
        logprob.new_empty((), **f32), logprob.new_empty(6, **f32),
        logprob.new_empty(logprob.shape[0], **f32), logprob.new_empty(2, **f32),
    )


def policy_loss_backward_fake(grad_loss, logprob, old_logprob, advantages, mask, ref_logprob, rollout_is_weights,
                              seq_weight, totals, clip_ratio_low, clip_ratio_high, clip_ratio_c, kl_type, kl_coef,
                              entropy_coef, loss_agg_mode, need_logprob_grad, entropy_dtype):
    """Fake backward: ``(d logprob or [0], d entropy or [0])``."""
    grad_lp = logprob.new_empty(logprob.shape if need_logprob_grad else (0,))
    grad_ent = logprob.new_empty(logprob.shape, dtype=entropy_dtype) if entropy_dtype is not None else logprob.new_empty(0)
    return grad_lp, grad_ent


def policy_loss_setup(ctx, inputs, output) -> None:
    """``setup_context`` of the forward op: save what the backward recomputes the token terms from."""
    logprob, old_logprob, advantages, mask, ref_logprob, entropy, weights = inputs[:7]
    _loss, metrics, seq_weight, totals = output
    ctx.save_for_backward(logprob, old_logprob, advantages, mask, ref_logprob, weights, seq_weight, totals)
    ctx.knobs = dict(zip(POLICY_LOSS_KNOBS, inputs[7:]))
    ctx.entropy_dtype = None if entropy is None else entropy.dtype
    ctx.mark_non_differentiable(metrics, seq_weight, totals)
    ctx.set_materialize_grads(False)


def policy_loss_backward(backward_op: Callable) -> Callable:
    """The autograd backward of a forward op whose backward is ``backward_op`` (the custom op, or its Python body in eager)."""

    def backward(ctx, grad_loss, _g_metrics, _g_seq_weight, _g_totals):
        logprob, old_logprob, advantages, mask, ref_logprob, weights, seq_weight, totals = ctx.saved_tensors
        need_lp = ctx.needs_input_grad[0]
        want_ent = ctx.needs_input_grad[5] and ctx.knobs["entropy_coef"] != 0.0
        if grad_loss is None or not (need_lp or want_ent):
            return (None,) * 14
        grad_lp, grad_ent = backward_op(
            grad_loss, logprob, old_logprob, advantages, mask, ref_logprob, weights, seq_weight, totals,
            *ctx.knobs.values(), need_lp, ctx.entropy_dtype if want_ent else None,
        )
        return (grad_lp if need_lp else None, None, None, None, None, grad_ent if want_ent else None) + (None,) * 8

    return backward


# ---------------------------------------------------------------- group_advantages


def group_advantages_fake(rewards, group_size, group_index, estimator, norm_by_std, eps):
    """Fake forward: advantages ``[N]``, fp64 for fp64 rewards, else fp32."""
    return rewards.new_empty(rewards.shape, dtype=torch.float64 if rewards.dtype == torch.float64 else torch.float32)


def group_advantages_impl(forward_op: Callable) -> Callable[..., Tensor]:
    """The backend implementation of ``group_advantages`` over the custom op ``forward_op``."""

    def group_advantages(
        rewards: Tensor, group_size: Optional[int], group_index: Optional[Tensor], *, estimator: str, norm_by_std: bool, eps: float
    ) -> Tensor:
        """Backend implementation: advantages ``[N]`` in ``forward_op``'s dtype (see its fake), not differentiable."""
        return forward_op(rewards.detach(), group_size, group_index, estimator, norm_by_std, eps)

    return group_advantages
