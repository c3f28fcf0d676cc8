"""The backend-independent halves of ``group_advantages`` (see :mod:`rl_kernel_core.opdef`).

Schema the fast backends' ops share: :data:`SCHEMA`, ``-> advantages [N]`` (fp64 for fp64
rewards, else fp32), not differentiable.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

Tensor = torch.Tensor

SCHEMA = (
    "(Tensor rewards, SymInt? group_size, Tensor? group_index, str estimator, bool norm_by_std, float eps) -> Tensor"
)
"""``group_advantages``' custom ops: rewards ``[N]``, exactly one of ``group_size``/``group_index`` ``[N]``."""


def fake(rewards, group_size, group_index, estimator, norm_by_std, eps):
    """Fake forward: advantages ``[N]``, fp64 for fp64 rewards, else fp32."""
    return rewards.new_empty(rewards.shape, dtype=torch.float64 if rewards.dtype == torch.float64 else torch.float32)


def define_op(name: str, forward_fn: Callable) -> torch.library.CustomOpDef:
    """The custom op ``rl_kernel::<name>`` (:data:`SCHEMA`) over ``forward_fn``, with :func:`fake`."""
    op = torch.library.custom_op(f"rl_kernel::{name}", forward_fn, mutates_args=(), schema=SCHEMA)
    op.register_fake(fake)
    return op


def implementation(forward_op: Callable) -> Callable[..., Tensor]:
    """The backend implementation of ``group_advantages`` over the custom op ``forward_op``."""

    def group_advantages(
        rewards: Tensor,
        group_size: Optional[int],
        group_index: Optional[Tensor],
        *,
        estimator: str,
        norm_by_std: bool,
        eps: float,
    ) -> Tensor:
        """Backend implementation: advantages ``[N]`` in ``forward_op``'s dtype (see :func:`fake`), not differentiable."""
        return forward_op(rewards.detach(), group_size, group_index, estimator, norm_by_std, eps)

    return group_advantages
