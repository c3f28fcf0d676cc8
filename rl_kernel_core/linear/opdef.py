"""The backend-independent half of ``linear_logprob`` (see :mod:`rl_kernel_core.opdef`).

Schemas every fast backend's ops share: :data:`LINEAR_SCHEMA` and :data:`LINEAR_BACKWARD_SCHEMA`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rl_kernel_core.linear.chunks import BackwardArgs, tuning_key
from rl_kernel_core.opdef import define_differentiable_op, none_if_empty

Tensor = torch.Tensor

LINEAR_SCHEMA = (
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, float temperature, int ignore_index, "
    "bool return_entropy, str? tp_group, str tuning) -> (Tensor, Tensor, Tensor)"
)
"""``linear_logprob``'s forward: ``(logprob [N], entropy [N] or [0], lse [N])`` fp32; ``tp_group`` is
the name of a process group :func:`register_group` recorded (vocab parallel), or None;
``tuning`` the :func:`rl_kernel_core.linear.chunks.tuning_key` of the forward, which the
backward runs under too."""
LINEAR_BACKWARD_SCHEMA = (
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor lse, Tensor entropy, Tensor? grad_logprob, "
    "Tensor? grad_entropy, float temperature, int ignore_index, str? tp_group, str tuning, bool need_hidden_grad, "
    "bool need_weight_grad, bool need_bias_grad) -> (Tensor, Tensor, Tensor)"
)
"""Its backward: ``(dh, dW, db)``, each ``[0]`` when not asked for."""

_GROUPS: dict[str, torch.distributed.ProcessGroup] = {}


def register_group(group: Optional[torch.distributed.ProcessGroup]) -> Optional[str]:
    """The name under which the ops find ``group`` (a ``torch.distributed.ProcessGroup``; None: None)."""
    if group is None:
        return None
    name = group.group_name
    _GROUPS[name] = group
    return name


def group_named(name: Optional[str]) -> Optional[torch.distributed.ProcessGroup]:
    """The process group :func:`register_group` recorded under ``name`` (None: None)."""
    return None if name is None else _GROUPS[name]


def linear_implementation(forward_op: Callable) -> Callable[..., tuple[Tensor, Optional[Tensor]]]:
    """The backend implementation of ``linear_logprob`` over ``forward_op``."""

    def linear_logprob(
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        bias: Optional[Tensor],
        temperature: float,
        ignore_index: int,
        return_entropy: bool,
        tp_group: Optional[torch.distributed.ProcessGroup],
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Backend implementation: ``(logprob [N], entropy [N] or None)`` fp32, differentiable in ``hidden``, ``weight`` and ``bias``."""
        logprob, entropy, _lse = forward_op(
            hidden,
            weight,
            bias,
            targets,
            float(temperature),
            int(ignore_index),
            bool(return_entropy),
            register_group(tp_group),
            tuning_key(),
        )
        return logprob, (entropy if return_entropy else None)

    return linear_logprob


def linear_fake(hidden, weight, bias, targets, temperature, ignore_index, return_entropy, tp_group, tuning):
    """Fake forward: ``(logprob [N], entropy [N] or [0], lse [N])`` fp32."""
    n = hidden.shape[0]
    f32 = dict(dtype=torch.float32)
    return hidden.new_empty(n, **f32), hidden.new_empty(n if return_entropy else 0, **f32), hidden.new_empty(n, **f32)


def linear_backward_fake(*args):
    """Fake backward (arguments: :class:`~rl_kernel_core.linear.chunks.BackwardArgs`): ``(dh, dW, db)``
    in the inputs' shapes and dtypes, ``[0]`` where not asked for."""
    call = BackwardArgs(*args)
    hidden, weight = call.hidden, call.weight
    return (
        hidden.new_empty(hidden.shape if call.need_hidden_grad else (0,)),
        weight.new_empty(weight.shape if call.need_weight_grad else (0,)),
        weight.new_empty(weight.shape[0] if call.need_bias_grad else 0),
    )


def linear_setup(ctx, inputs, output) -> None:
    """``setup_context``: save the inputs with ``lse`` and the entropy; only ``lse`` and ``entropy`` are ``[N]`` extra."""
    hidden, weight, bias, targets, temperature, ignore_index, _return_entropy, tp_group, tuning = inputs
    _logprob, entropy, lse = output
    ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
    ctx.temperature, ctx.ignore_index, ctx.tp_group, ctx.tuning = temperature, ignore_index, tp_group, tuning
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def linear_backward(backward_op: Callable) -> Callable:
    """The autograd backward of a forward op whose backward is ``backward_op`` (the custom op, or its Python body in eager)."""

    def run(ctx, grad_logprob, grad_entropy, _grad_lse):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        if (grad_logprob is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return (None,) * 9
        if entropy.numel() == 0:
            grad_entropy = None
        settings = (ctx.temperature, ctx.ignore_index, ctx.tp_group, ctx.tuning)
        dh, dw, db = backward_op(
            hidden, weight, bias, targets, lse, entropy, grad_logprob, grad_entropy, *settings, need_h, need_w, need_b
        )
        return (
            none_if_empty(dh) if need_h else None,
            none_if_empty(dw) if need_w else None,
            none_if_empty(db) if need_b else None,
        ) + (None,) * 6

    return run


def define_linear_logprob(name: str, forward_fn: Callable, backward_fn: Callable) -> Callable:
    """``linear_logprob``'s backend implementation over the custom ops ``rl_kernel::<name>`` and its
    backward (:data:`LINEAR_SCHEMA`, :data:`LINEAR_BACKWARD_SCHEMA`), whose bodies are ``forward_fn`` / ``backward_fn``."""
    return linear_implementation(
        define_differentiable_op(
            name,
            forward_fn,
            linear_fake,
            backward_fn,
            linear_backward_fake,
            linear_setup,
            linear_backward,
            schema=LINEAR_SCHEMA,
            backward_schema=LINEAR_BACKWARD_SCHEMA,
        )
    )
