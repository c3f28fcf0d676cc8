"""How a differentiable op is defined once for every fast backend, and the reasons backends give.

Each fast backend (``triton``, ``native``) defines its ops with :func:`define_differentiable_op`:
one forward and one backward ``torch.library`` custom op (``rl_kernel::<backend>_<op>``) with
fake (meta) implementations, tied together with ``register_autograd``, and an eager path over
the same Python bodies. The backend-independent halves of each op family (fakes, ``setup``,
the autograd backward given the backend's backward, ``supports`` predicates) live in the family's package
(``rl_kernel_core/<family>/opdef.py``; :mod:`rl_kernel_core.linear.opdef` imports the backend-neutral
:mod:`rl_kernel_core.linear.chunks` for the tuning key). This module imports nothing of
``rl_kernel_core``, so every backend and the reference can import it.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch.autograd.function import once_differentiable

Tensor = torch.Tensor
FAST_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def single_backward(op: str) -> Callable[[Callable], Callable]:
    """Decorate an ``autograd.Function.backward`` that is not itself differentiable.

    A backward asked to build a graph (``create_graph=True``: grad mode is on inside it) raises
    ``RuntimeError`` naming ``op`` at once, rather than returning a detached gradient whose own
    backward fails later with a generic message. Otherwise it runs as under torch's
    ``once_differentiable``.
    """

    def decorate(backward: Callable) -> Callable:
        plain = once_differentiable(backward)

        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"{op} has no double backward: its backward is not differentiable, so it cannot run "
                    f"with create_graph=True (a gradient of its gradient); take this gradient without create_graph"
                )
            return plain(ctx, *grads)

        return checked

    return decorate


def define_differentiable_op(
    name: str,
    forward_fn: Callable,
    forward_fake: Callable,
    backward_fn: Callable,
    backward_fake: Callable,
    setup: Callable,
    make_backward: Callable[[Callable], Callable],
    *,
    schema: Optional[str] = None,
    backward_schema: Optional[str] = None,
    eager_backward_fn: Optional[Callable] = None,
) -> Callable:
    """Define the custom ops ``rl_kernel::<name>`` over ``forward_fn`` and ``rl_kernel::<name>_backward``
    over ``backward_fn`` (with these fakes, and autograd from ``setup`` and
    ``make_backward(backward op)``), and return what a backend implementation calls.

    The returned callable takes ``forward_fn``'s arguments: the types ``torch.library`` infers a
    schema from, or those of ``schema`` / ``backward_schema`` when given (the ops' schemas
    without the name, for bodies that take settings as one ``*args``). While ``torch.compile`` traces, it calls the custom op, so graphs see the op,
    its fake and its backward. In eager it applies a ``torch.autograd.Function`` over the same
    Python bodies, ``setup`` and backward: the same kernels, without the dispatcher's custom-op
    layers, which at RL sizes cost more host time per call than the kernels take on the GPU
    (``benchmarks/profile_host.py``); ``eager_backward_fn``, when given, replaces
    ``backward_fn`` there (a body that may reuse the node's own buffers, which a custom op may not
    return). Either way the backward is not itself differentiable.
    """
    forward_op = torch.library.custom_op(f"rl_kernel::{name}", forward_fn, mutates_args=(), schema=schema)
    backward_op = torch.library.custom_op(
        f"rl_kernel::{name}_backward", backward_fn, mutates_args=(), schema=backward_schema
    )
    forward_op.register_fake(forward_fake)
    backward_op.register_fake(backward_fake)
    forward_op.register_autograd(make_backward(backward_op), setup_context=setup)
    eager_backward = single_backward(f"rl_kernel::{name}")(make_backward(eager_backward_fn or backward_fn))

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


def none_if_empty(t: Tensor) -> Optional[Tensor]:
    """``t``, or None for the empty ``[0]`` tensor by which a custom op returns an output it was not asked for."""
    return None if t.numel() == 0 else t
