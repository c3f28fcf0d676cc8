"""Native ``logprob_from_logits``: the CUDA kernels of ``native/csrc/logprob_from_logits.cu`` as the
custom ops ``rl_kernel::native_logprob_from_logits`` and its backward (schemas and autograd glue
in :mod:`rl_kernel_core.logprob.opdef`), registered as the ``native`` backend. Importing this
module builds the ``logprob_from_logits`` extension (:func:`rl_kernel_core.native.extension`)."""

from __future__ import annotations

from typing import Optional

import torch

from rl_kernel_core import dispatch
from rl_kernel_core.native import extension
from rl_kernel_core.logprob import opdef

Tensor = torch.Tensor
_ext = extension("logprob_from_logits")


def _forward(
    logits: Tensor, targets: Tensor, temperature: float, ignore_index: int, return_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(logprob [N], entropy [N] or [0], lse [N])`` fp32 from ``logits [N, V]`` in one read."""
    logprob, entropy, lse = _ext.logprob_fwd(logits, targets, temperature, ignore_index, return_entropy)
    return logprob, entropy, lse


def _backward(
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logprob: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    temperature: float,
    ignore_index: int,
) -> Tensor:
    """``d/d logits`` ``[N, V]`` in the logits' dtype, the softmax recomputed from ``logits`` and ``lse``."""
    return _ext.logprob_bwd(logits, targets, lse, entropy, grad_logprob, grad_entropy, temperature, ignore_index)


logprob_from_logits = dispatch.register("logprob_from_logits", "native", supports=opdef.supports("native"))(
    opdef.define_logprob_from_logits("native_logprob_from_logits", _forward, _backward)
)
