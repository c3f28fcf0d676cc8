"""Whether a Triton backend's call must go through its ``torch.autograd.Function``."""

from __future__ import annotations

from typing import Optional

import torch


def records_graph(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd records this call; without a graph the ``autograd.Function`` wrapper only
    costs host time (the batch-invariant mode's routes, inference, a decode step)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
