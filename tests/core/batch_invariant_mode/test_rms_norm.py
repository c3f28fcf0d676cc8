"""rms_norm's gradients, through a chain of the batch-invariant ops (bi_linear, rms_norm,
bi_log_softmax + bi_mean), Triton against the fp64 reference. rms_norm's values and row invariance
are checked with the other row reductions (``test_bi_log_softmax.py``).

Runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set per test) and on CUDA
(``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core import contract
from rl_kernel_core.batch_invariant_mode.api import bi_linear, bi_log_softmax, bi_mean
from oracles import bi_shape

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


def test_gradients_match_fp64(seed, device):
    s = bi_shape(device)
    x = torch.randn(s["n"], s["k"], device=device, requires_grad=True)
    w = torch.randn(s["m"], s["k"], device=device, requires_grad=True)
    bias = torch.randn(s["m"], device=device, requires_grad=True)
    g = torch.randn(s["n"], s["m"], device=device)
    norm_w = torch.randn(s["m"], device=device, requires_grad=True)

    def chain(xx, ww, bb, nw, backend):
        y = bi_linear(xx, ww, bb, backend=backend)
        y = rk.rms_norm(y, nw, 1e-6, backend=backend)
        return bi_log_softmax(y, backend=backend) + bi_mean(y, -1, keepdim=True, backend=backend)

    leaves = (x, w, bias, norm_w)
    got = torch.autograd.grad(chain(*leaves, "triton"), leaves, g)
    x64, w64, bias64, norm_w64 = leaves64 = [t.detach().double().cpu().requires_grad_() for t in leaves]
    expected = torch.autograd.grad(chain(x64, w64, bias64, norm_w64, "torch"), leaves64, g.double().cpu())
    for name, a, e in zip(("x", "weight", "bias", "norm weight"), got, expected):
        contract.assert_close(a, e, "gradient", torch.float32, name=f"d{name}")
