"""The loss settings every backend receives, and the backend-independent halves of ``ratio_kl``,
``policy_loss`` and ``fused_linear_policy_loss`` (see :mod:`rl_kernel_core.opdef`).

Schemas the fast backends' ops share:

* ``ratio_kl``: ``(logprob, old_logprob, ref_logprob, kl_type) -> (ratio, kl)`` fp32; backward
  ``(logprob, old_logprob, ref_logprob, grad_ratio, grad_kl, kl_type) -> d logprob``.
* ``policy_loss``: :data:`POLICY_LOSS_SCHEMA` ``-> (loss [], metrics [6], seq_weight [S],
  totals [2])``; backward :data:`POLICY_LOSS_BACKWARD_SCHEMA` ``-> (d logprob or [0], d entropy
  or [0])``.
* ``fused_linear_policy_loss``: :data:`FUSED_LOSS_SCHEMA` ``-> (loss [], metrics [6], dh, dW,
  db)``, the gradients formed in the forward (``[0]`` where not asked for); backward
  :data:`FUSED_LOSS_BACKWARD_SCHEMA` scales them by the upstream gradient.

The loss settings travel as one :class:`LossSettings`; a custom op's schema spells its fields
out in declaration order (:data:`SETTINGS_SCHEMA`), and :meth:`LossSettings.from_args` rebuilds
it from them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Collection, NamedTuple, Optional

import torch

from rl_kernel_core.opdef import define_differentiable_op, fp64_reason, grad_reason, none_if_empty

Tensor = torch.Tensor

METRIC_NAMES: tuple[str, ...] = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss", "entropy")
"""The loss metrics, in the order of a backend's ``metrics [6]`` tensor."""


class FusedLossInputs(NamedTuple):
    """The tensors a ``fused_linear_policy_loss`` backend receives (validated, ``S·T >= 1``).

    ``hidden [S, T, D]`` 16-bit or fp32; ``weight [V, D]`` and ``bias [V]`` (or None) in hidden's
    dtype; ``targets [S, T]`` int64/int32 ids in ``[0, V)`` or ``ignore_index``; ``old_logprob``,
    ``advantages``, ``ref_logprob`` (never None) and ``rollout_is_weights`` (or None) ``[S, T]``
    float; ``mask [S, T]`` bool or float.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    old_logprob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    bias: Optional[torch.Tensor]
    ref_logprob: torch.Tensor
    rollout_is_weights: Optional[torch.Tensor]


@dataclass(frozen=True)
class LossSettings:
    """The validated settings of the PPO/GRPO loss (:func:`rl_kernel_core.loss.api.policy_loss` checks them).

    ``clip_ratio_low``/``clip_ratio_high`` >= 0; ``clip_ratio_c`` None (no dual clip) or > 1;
    ``kl_type`` canonical (``k1``, ``abs``, ``k2``, ``k3``, ``k1+``, ``abs+``, ``k3+``);
    ``kl_coef``/``entropy_coef`` >= 0; ``loss_agg_mode`` one of
    :data:`rl_kernel_core.loss.api.LOSS_AGG_MODES`.
    """

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: Optional[float]
    kl_type: str
    kl_coef: float
    entropy_coef: float
    loss_agg_mode: str

    def as_args(self) -> tuple:
        """The fields in declaration order: the custom ops' positional settings arguments."""
        return tuple(getattr(self, name) for name in _FIELD_NAMES)

    @classmethod
    def from_args(cls, args: tuple) -> "LossSettings":
        """The settings from :meth:`as_args`' tuple."""
        return cls(*args)


_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(LossSettings))
_SCHEMA_TYPES = {"float": "float", "Optional[float]": "float?", "str": "str"}
SETTINGS_SCHEMA: str = ", ".join(f"{_SCHEMA_TYPES[str(f.type)]} {f.name}" for f in fields(LossSettings))
""":class:`LossSettings` as ``torch.library`` schema arguments."""

POLICY_LOSS_SCHEMA = (
    "(Tensor logprob, Tensor old_logprob, Tensor advantages, Tensor mask, Tensor ref_logprob, Tensor? entropy, "
    f"Tensor? rollout_is_weights, {SETTINGS_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)"
)
POLICY_LOSS_BACKWARD_SCHEMA = (
    "(Tensor grad_loss, Tensor logprob, Tensor old_logprob, Tensor advantages, Tensor mask, Tensor ref_logprob, "
    f"Tensor? rollout_is_weights, Tensor seq_weight, Tensor totals, {SETTINGS_SCHEMA}, bool need_logprob_grad, "
    "ScalarType? entropy_dtype) -> (Tensor, Tensor)"
)
FUSED_LOSS_SCHEMA = (
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor old_logprob, Tensor advantages, "
    f"Tensor mask, Tensor ref_logprob, Tensor? rollout_is_weights, float temperature, int ignore_index, {SETTINGS_SCHEMA}, "
    "bool need_hidden_grad, bool need_weight_grad, bool need_bias_grad) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
FUSED_LOSS_BACKWARD_SCHEMA = (
    "(Tensor grad_loss, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias) -> (Tensor, Tensor, Tensor)"
)


def metrics_dict(metrics: Tensor) -> dict[str, Tensor]:
    """A backend's ``metrics [6]`` tensor as the public ``{name: 0-d tensor}``."""
    return {name: metrics[i] for i, name in enumerate(METRIC_NAMES)}


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


def ratio_kl_implementation(forward_op: Callable) -> Callable[..., tuple[Tensor, Tensor]]:
    """The backend implementation of ``ratio_kl`` over ``forward_op`` (see :func:`rl_kernel_core.opdef.define_differentiable_op`)."""

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


def define_ratio_kl(name: str, forward_fn: Callable, backward_fn: Callable) -> Callable[..., tuple[Tensor, Tensor]]:
    """``ratio_kl``'s backend implementation over the custom ops ``rl_kernel::<name>`` and its backward,
    whose bodies are ``forward_fn`` / ``backward_fn`` (the schemas above, inferred from their types)."""
    op = define_differentiable_op(
        name, forward_fn, ratio_kl_fake, backward_fn, ratio_kl_backward_fake, ratio_kl_setup, ratio_kl_backward
    )
    return ratio_kl_implementation(op)


# ---------------------------------------------------------------- policy_loss


def policy_loss_supports(
    backend: str, kl_types: Optional[Collection[str]] = None, agg_modes: Optional[Collection[str]] = None
) -> Callable[..., Optional[str]]:
    """``backend``'s ``supports`` predicate for ``policy_loss``.

    Refuses a ``loss_agg_mode`` not in ``agg_modes`` and a ``kl_type`` whose base estimator is not
    in ``kl_types`` (None: no such check), fp64 float inputs (a bool ``mask`` is fine), and any
    input but ``logprob`` and ``entropy`` that requires grad.
    """

    def supports(
        logprob, old_logprob, advantages, mask, ref_logprob, entropy, rollout_is_weights, settings
    ) -> Optional[str]:
        floats = dict(
            logprob=logprob,
            old_logprob=old_logprob,
            advantages=advantages,
            ref_logprob=ref_logprob,
            entropy=entropy,
            rollout_is_weights=rollout_is_weights,
        )
        if mask.dtype != torch.bool:
            floats["mask"] = mask
        if agg_modes is not None and settings.loss_agg_mode not in agg_modes:
            return f"loss_agg_mode={settings.loss_agg_mode!r} has no {backend} kernel"
        return (
            _kl_type_reason(backend, settings.kl_type, kl_types)
            or fp64_reason(backend, **floats)
            or grad_reason(
                backend,
                old_logprob=old_logprob,
                advantages=advantages,
                mask=mask,
                ref_logprob=ref_logprob,
                rollout_is_weights=rollout_is_weights,
            )
        )

    return supports


def policy_loss_implementation(forward_op: Callable) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The backend implementation of ``policy_loss`` over ``forward_op`` (see :func:`rl_kernel_core.opdef.define_differentiable_op`)."""

    def policy_loss(
        logprob: Tensor,
        old_logprob: Tensor,
        advantages: Tensor,
        mask: Tensor,
        ref_logprob: Tensor,
        entropy: Optional[Tensor],
        rollout_is_weights: Optional[Tensor],
        settings: LossSettings,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Backend implementation over ``[S, T]`` tensors: ``(loss, metrics)``, differentiable in ``logprob`` and ``entropy``."""
        loss, metrics, _seq_weight, _totals = forward_op(
            logprob,
            old_logprob,
            advantages,
            mask,
            ref_logprob,
            entropy,
            rollout_is_weights,
            *settings.as_args(),
        )
        return loss, metrics_dict(metrics)

    return policy_loss


def policy_loss_fake(logprob, old_logprob, advantages, mask, ref_logprob, entropy, rollout_is_weights, *settings):
    """Fake forward: ``(loss [], metrics [6], seq_weight [S], totals [2])`` fp32."""
    f32 = dict(dtype=torch.float32)
    return (
        logprob.new_empty((), **f32),
        logprob.new_empty(len(METRIC_NAMES), **f32),
        logprob.new_empty(logprob.shape[0], **f32),
        logprob.new_empty(2, **f32),
    )


def policy_loss_backward_fake(grad_loss, logprob, *args):
    """Fake backward: ``(d logprob or [0], d entropy or [0])``."""
    need_logprob_grad, entropy_dtype = args[-2:]
    grad_lp = logprob.new_empty(logprob.shape if need_logprob_grad else (0,))
    grad_ent = (
        logprob.new_empty(logprob.shape, dtype=entropy_dtype) if entropy_dtype is not None else logprob.new_empty(0)
    )
    return grad_lp, grad_ent


def policy_loss_setup(ctx, inputs, output) -> None:
    """``setup_context`` of the forward op: save what the backward recomputes the token terms from."""
    logprob, old_logprob, advantages, mask, ref_logprob, entropy, weights = inputs[:7]
    _loss, metrics, seq_weight, totals = output
    ctx.save_for_backward(logprob, old_logprob, advantages, mask, ref_logprob, weights, seq_weight, totals)
    ctx.settings = LossSettings.from_args(inputs[7:])
    ctx.entropy_dtype = None if entropy is None else entropy.dtype
    ctx.mark_non_differentiable(metrics, seq_weight, totals)
    ctx.set_materialize_grads(False)


def policy_loss_backward(backward_op: Callable) -> Callable:
    """The autograd backward of a forward op whose backward is ``backward_op`` (the custom op, or its Python body in eager)."""
    n_inputs = 7 + len(_FIELD_NAMES)

    def backward(ctx, grad_loss, _g_metrics, _g_seq_weight, _g_totals):
        logprob, old_logprob, advantages, mask, ref_logprob, weights, seq_weight, totals = ctx.saved_tensors
        need_lp = ctx.needs_input_grad[0]
        want_ent = ctx.needs_input_grad[5] and ctx.settings.entropy_coef != 0.0
        if grad_loss is None or not (need_lp or want_ent):
            return (None,) * n_inputs
        grad_lp, grad_ent = backward_op(
            grad_loss,
            logprob,
            old_logprob,
            advantages,
            mask,
            ref_logprob,
            weights,
            seq_weight,
            totals,
            *ctx.settings.as_args(),
            need_lp,
            ctx.entropy_dtype if want_ent else None,
        )
        grads = [None] * n_inputs
        grads[0] = grad_lp if need_lp else None
        grads[5] = grad_ent if want_ent else None
        return tuple(grads)

    return backward


def policy_loss_grad_buffers(
    logprob: Tensor, need_logprob_grad: bool, entropy_dtype: Optional[torch.dtype]
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Uninitialized ``d logprob`` (logprob's dtype) and ``d entropy`` (``entropy_dtype``) of logprob's
    ``[S, T]`` shape, None where not asked for."""
    grad_lp = torch.empty(logprob.shape, dtype=logprob.dtype, device=logprob.device) if need_logprob_grad else None
    grad_ent = (
        torch.empty(logprob.shape, dtype=entropy_dtype, device=logprob.device) if entropy_dtype is not None else None
    )
    return grad_lp, grad_ent


def define_policy_loss_op(name: str, forward_fn: Callable, grads_fn: Callable) -> Callable:
    """The custom ops ``rl_kernel::<name>`` (:data:`POLICY_LOSS_SCHEMA`) and its backward
    (:data:`POLICY_LOSS_BACKWARD_SCHEMA`), as :func:`rl_kernel_core.opdef.define_differentiable_op` returns them.

    ``forward_fn(logprob, old_logprob, advantages, mask, ref_logprob, entropy, rollout_is_weights,
    settings)`` returns ``(loss [], metrics [6], seq_weight [S], totals [2])`` fp32;
    ``grads_fn(grad_loss, logprob, old_logprob, advantages, mask, ref_logprob, rollout_is_weights,
    seq_weight, totals, settings, need_logprob_grad, entropy_dtype)`` returns ``(d logprob, d
    entropy)``, None where not asked for (the op returns ``[0]`` for it); ``settings`` a :class:`LossSettings`.
    """

    def forward(*args):
        return forward_fn(*args[:7], LossSettings.from_args(args[7:]))

    def backward(*args):
        settings = LossSettings.from_args(args[9:-2])
        grad_lp, grad_ent = grads_fn(*args[:9], settings, *args[-2:])
        logprob = args[1]
        return (logprob.new_empty(0) if grad_lp is None else grad_lp), (
            logprob.new_empty(0) if grad_ent is None else grad_ent
        )

    return define_differentiable_op(
        name,
        forward,
        policy_loss_fake,
        backward,
        policy_loss_backward_fake,
        policy_loss_setup,
        policy_loss_backward,
        schema=POLICY_LOSS_SCHEMA,
        backward_schema=POLICY_LOSS_BACKWARD_SCHEMA,
    )


# ---------------------------------------------------------------- fused_linear_policy_loss


def fused_loss_implementation(forward_op: Callable) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The backend implementation of ``fused_linear_policy_loss`` over ``forward_op``."""

    def fused_linear_policy_loss(
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        old_logprob: Tensor,
        advantages: Tensor,
        mask: Tensor,
        bias: Optional[Tensor],
        ref_logprob: Tensor,
        rollout_is_weights: Optional[Tensor],
        *,
        temperature: float,
        ignore_index: int,
        settings: LossSettings,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Backend implementation: ``(loss, metrics)``, ``loss`` differentiable in ``hidden``, ``weight`` and ``bias``."""
        grad_on = torch.is_grad_enabled()
        loss, metrics, _dh, _dw, _db = forward_op(
            hidden,
            weight,
            bias,
            targets,
            old_logprob,
            advantages,
            mask,
            ref_logprob,
            rollout_is_weights,
            float(temperature),
            int(ignore_index),
            *settings.as_args(),
            grad_on and hidden.requires_grad,
            grad_on and weight.requires_grad,
            grad_on and bias is not None and bias.requires_grad,
        )
        return loss, metrics_dict(metrics)

    return fused_linear_policy_loss


def fused_loss_fake(hidden, weight, bias, targets, *args):
    """Fake forward: ``(loss [], metrics [6], dh, dW, db)``, a gradient not asked for ``[0]``."""
    need_h, need_w, need_b = args[-3:]
    f32 = dict(dtype=torch.float32)
    return (
        hidden.new_empty((), **f32),
        hidden.new_empty(len(METRIC_NAMES), **f32),
        hidden.new_empty(hidden.shape if need_h else (0,)),
        weight.new_empty(weight.shape if need_w else (0,)),
        weight.new_empty(weight.shape[0] if need_b else 0),
    )


def fused_loss_backward_fake(grad_loss, grad_hidden, grad_weight, grad_bias):
    """Fake backward: the three stored gradients' shapes and dtypes."""
    return torch.empty_like(grad_hidden), torch.empty_like(grad_weight), torch.empty_like(grad_bias)


def fused_loss_setup(ctx, inputs, output) -> None:
    """``setup_context``: keep the gradients the forward formed; the backward only scales them."""
    _loss, metrics, dh, dw, db = output
    ctx.save_for_backward(dh, dw, db)
    ctx.mark_non_differentiable(metrics, dh, dw, db)
    ctx.set_materialize_grads(False)
    ctx.spent = False


def fused_loss_backward(backward_op: Callable) -> Callable:
    """The autograd backward: ``(dh, dW, db)`` times the upstream gradient, once per forward."""
    n_inputs = 11 + len(_FIELD_NAMES) + 3

    def backward(ctx, grad_loss, *_):
        if ctx.spent:
            raise RuntimeError(
                "fused_linear_policy_loss forms its gradient in the forward and hands it to one backward; "
                "for a second backward through the same graph, call the loss again"
            )
        ctx.spent = True
        if grad_loss is None:
            return (None,) * n_inputs
        dh, dw, db = backward_op(grad_loss, *ctx.saved_tensors)
        return (none_if_empty(dh), none_if_empty(dw), none_if_empty(db)) + (None,) * (n_inputs - 3)

    return backward
