"""bi_log_softmax and the other Triton row reductions (bi_mean, rms_norm) against fp64 formulas,
with bitwise row invariance; ``-inf`` logits keep probability 0.

Runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set per test) with small odd
shapes, and on CUDA (``gpu`` marker) with model-sized ones and a 151936-wide vocabulary.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.batch_invariant_mode.api import bi_log_softmax, bi_mean
from oracles import bi_shape, close_in_dtype, rows_invariant

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_reductions_match_fp64_and_are_row_invariant(seed, device, dtype):
    s = bi_shape(device)
    width = 150 if device.type == "cpu" else 151936
    x = (torch.randn(s["n"], width, device=device) * 3).to(dtype)
    x[0, :7] = float("-inf")  # -inf logits are legal: probability 0
    weight = torch.randn(width, device=device)
    y, y64 = x[1:], x[1:].double()
    lsm = lambda t: bi_log_softmax(t, backend="triton")
    mean = lambda t: bi_mean(t, -1, backend="triton")
    rms = lambda t: rk.rms_norm(t, weight, 1e-5, backend="triton")
    x64 = x.double()
    close_in_dtype(
        lsm(x)[:, 7:], (x64 - torch.logsumexp(x64, -1, keepdim=True))[:, 7:], "logprob", dtype, "bi_log_softmax"
    )
    assert bool((lsm(x)[0, :7] == float("-inf")).all())
    close_in_dtype(mean(y), y64.mean(-1), "reduction", dtype, "bi_mean")
    expected = y64 / (y64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * weight.double()
    close_in_dtype(rms(y), expected, "reduction", dtype, "rms_norm")
    rows_invariant(lsm, x, s["sizes"])
    for fn in (mean, rms):
        rows_invariant(fn, y, [n - 1 for n in s["sizes"]])
