"""Native ``group_advantages``: the CUDA kernel of ``native/csrc/advantages.cu`` as the custom op
``rl_kernel::native_group_advantages`` (fake in :mod:`rl_kernel_core.advantages.opdef`),
registered as the ``native`` backend. Importing this module builds the ``advantages`` extension."""

from __future__ import annotations

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.loss_codes import ESTIMATOR_CODES
from rl_kernel_core.native import extension
from rl_kernel_core.advantages import opdef

Tensor = torch.Tensor
_ext = extension("advantages")


def _group_advantages(rewards, group_size, group_index, estimator, norm_by_std, eps) -> Tensor:
    """Advantages ``[N]`` (fp32; fp64 for fp64 rewards), group statistics in fp64 (:data:`~rl_kernel_core.advantages.opdef.SCHEMA`)."""
    return _ext.group_advantages(rewards, group_size, group_index, ESTIMATOR_CODES[estimator], norm_by_std, eps)


group_advantages_op = opdef.define_op("native_group_advantages", _group_advantages)
group_advantages = dispatch.register("group_advantages", "native")(opdef.implementation(group_advantages_op))
