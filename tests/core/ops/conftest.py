"""Fixtures of the op tests that run one backend's kernels: ``device`` (Triton's) and ``route``
(the linear kernels')."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device(triton_device) -> torch.device:
    """``cpu`` runs the Triton kernels in the interpreter; ``cuda`` (``gpu`` marker) compiles them
    (see ``triton_device`` in tests/conftest.py)."""
    return triton_device


@pytest.fixture(params=("gemm", "chunked"))
def route(request, tune) -> str:
    """Run linear_logprob's and fused_linear_policy_loss's forward, backward and loss on one kernel
    route (``gemm``: ``tl.dot`` tiles in registers; ``chunked``: an fp32 logits chunk from cuBLAS)."""
    tune(route=request.param)
    return request.param
