"""The backward decorator of the ops' ``torch.autograd.Function``s, whose backwards are not differentiable."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.autograd.function import once_differentiable


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
