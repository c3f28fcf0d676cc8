"""bi_mean in a model: inside the batch-invariant mode, with the triton backend preferred, the
RMSNorm mean (and F.linear, log_softmax) of a model route to the Triton kernels, with row-invariant
bits. bi_mean's accuracy is checked with the other row reductions (``test_bi_log_softmax.py``), its
empty rows in ``test_bi_matmul.py``.

Runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set per test) and on CUDA
(``gpu`` marker); under the interpreter rows keep their positions (see ``test_bi_linear.py``).
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import dispatch
from oracles import bi_shape, rows_invariant

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


def test_mode_routes_model_ops_to_the_triton_kernels(seed, device, monkeypatch):
    """With the triton backend preferred (what ``auto`` picks on CUDA), F.linear, log_softmax and the
    RMSNorm mean of a model run the Triton kernels inside the mode, with row-invariant bits."""
    monkeypatch.setenv("RL_KERNEL_BACKEND", "triton")
    s = bi_shape(device)
    w = torch.randn(s["m"], s["k"], device=device)
    fn = lambda t: torch.log_softmax(
        torch.nn.functional.linear(t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True)), w), -1
    )
    x = torch.randn(s["n"], s["k"], device=device)
    with rk.batch_invariant():
        rows_invariant(fn, x, s["sizes"], move_rows=device.type == "cuda")
    for op in ("bi_matmul", "bi_mean", "bi_log_softmax"):
        assert dispatch.explain(op).backend == "triton", op
