"""The backend-independent half of ``logprob_from_logits`` (see :mod:`rl_kernel_core.opdef`).

Schemas every fast backend's ops share: ``logprob_from_logits``' forward ``(logits, targets,
temperature, ignore_index, return_entropy) -> (logprob [N], entropy [N] or [0], lse [N])``
(fp32) and its backward ``(logits, targets, lse, entropy, grad_logprob, grad_entropy,
temperature, ignore_index) -> d logits``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rl_kernel_core.opdef import define_differentiable_op, fp64_reason

Tensor = torch.Tensor


def supports(backend: str) -> Callable[..., Optional[str]]:
    """``backend``'s ``supports`` predicate: fp32/bf16/fp16 logits with unit stride along V."""

    def predicate(logits, targets, temperature, ignore_index, return_entropy) -> Optional[str]:
        reason = fp64_reason(backend, logits=logits)
        if reason is None and logits.dim() == 2 and logits.shape[1] > 1 and logits.stride(1) != 1:
            reason = f"logits must have unit stride along V, got strides {tuple(logits.stride())}"
        return reason

    return predicate


def implementation(forward_op: Callable) -> Callable[..., tuple[Tensor, Optional[Tensor]]]:
    """The backend implementation over ``forward_op`` (see :func:`rl_kernel_core.opdef.define_differentiable_op`)."""

    def logprob_from_logits(
        logits: Tensor, targets: Tensor, temperature: float, ignore_index: int, return_entropy: bool
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Backend implementation: ``(logprob [N] fp32, entropy [N] fp32 or None)``, differentiable in ``logits``."""
        logprob, entropy, _lse = forward_op(
            logits, targets, float(temperature), int(ignore_index), bool(return_entropy)
        )
        return logprob, (entropy if return_entropy else None)

    return logprob_from_logits


def forward_fake(logits, targets, temperature, ignore_index, return_entropy):
    """Fake forward: ``(logprob [N], entropy [N] or [0], lse [N])`` fp32."""
    n = logits.shape[0]
    f32 = dict(dtype=torch.float32, device=logits.device)
    return logits.new_empty(n, **f32), logits.new_empty(n if return_entropy else 0, **f32), logits.new_empty(n, **f32)


def backward_fake(logits, targets, lse, entropy, grad_logprob, grad_entropy, temperature, ignore_index):
    """Fake backward: ``d logits`` of the logits' shape and dtype."""
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def setup(ctx, inputs, output) -> None:
    """``setup_context`` of the forward op: save the logits, targets, lse and entropy."""
    logits, targets, temperature, ignore_index, _return_entropy = inputs
    _logprob, entropy, lse = output
    ctx.save_for_backward(logits, targets, lse, entropy)
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def backward(backward_op: Callable) -> Callable:
    """The autograd backward of a forward op whose backward is ``backward_op`` (the custom op, or its Python body in eager)."""

    def run(ctx, grad_logprob, grad_entropy, _grad_lse):
        logits, targets, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logprob is None and grad_entropy is None):
            return None, None, None, None, None
        if entropy.numel() == 0:
            grad_entropy = None
        grad = backward_op(logits, targets, lse, entropy, grad_logprob, grad_entropy, ctx.temperature, ctx.ignore_index)
        return grad, None, None, None, None

    return run


def define_logprob_from_logits(name: str, forward_fn: Callable, backward_fn: Callable) -> Callable:
    """``logprob_from_logits``' backend implementation over the custom ops ``rl_kernel::<name>`` and
    its backward, whose bodies are ``forward_fn`` / ``backward_fn`` (the schemas above)."""
    return implementation(
        define_differentiable_op(name, forward_fn, forward_fake, backward_fn, backward_fake, setup, backward)
    )
