"""bi_logsumexp against the fp64 formula, with bitwise row invariance, and the lse that bi_log_softmax
subtracts bit for bit (the shared lse behind the trainer formulations of
``tests/core/test_trainer_formulations.py``); the routed ``torch.logsumexp`` under the mode.

Runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set per test) and through the torch
reference, and on CUDA (``gpu`` marker) with a 151936-wide vocabulary.
"""

from __future__ import annotations

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.batch_invariant_mode.api import bi_log_softmax, bi_logsumexp
from oracles import bi_shape, close_in_dtype, rows_invariant

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64_row_invariant_and_is_log_softmax_lse(seed, device, dtype, backend):
    s = bi_shape(device)
    width = 150 if device.type == "cpu" else 151936
    x = (torch.randn(s["n"], width, device=device) * 3).to(dtype)
    x[0, :7] = float("-inf")  # -inf logits are legal: probability 0
    x[1, :] = float("-inf")  # a row of only -inf: lse -inf, as torch.logsumexp
    lse = lambda t: bi_logsumexp(t, -1, backend=backend)
    x64 = x.double()
    close_in_dtype(lse(x)[2:], torch.logsumexp(x64, -1)[2:], "logprob", dtype, "bi_logsumexp")
    assert lse(x)[1] == float("-inf")
    rows_invariant(lse, x, s["sizes"])
    if dtype == torch.float32:  # in fp32 x - lse is computed as the kernel's own subtraction
        assert torch.equal(x[2:] - lse(x)[2:, None], bi_log_softmax(x[2:], backend=backend))


def test_keepdim_dim_and_errors(seed):
    x = torch.randn(3, 5, 7)
    assert torch.equal(bi_logsumexp(x, 1, keepdim=True), bi_logsumexp(x.transpose(1, 2), -1).unsqueeze(1))
    with pytest.raises(ValueError, match="dim"):
        bi_logsumexp(x, 3)
    with pytest.raises(TypeError, match="keepdim"):
        bi_logsumexp(x, -1, keepdim=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="x"):
        bi_logsumexp(torch.ones(3, dtype=torch.int64))


def test_routed_under_the_mode(seed, device):
    """torch.logsumexp over one dim is routed (rows bitwise invariant); several dims go to PyTorch."""
    x = torch.randn(40, 333, device=device)
    with rk.batch_invariant():
        routed = torch.logsumexp(x, -1)
        assert torch.equal(torch.logsumexp(x[7:8], dim=1), routed[7:8])
        out = torch.empty(0, device=device)
        torch.logsumexp(x, -1, out=out)
        assert torch.equal(out, routed)
        both = torch.logsumexp(x, (0, 1))
    assert torch.equal(routed, bi_logsumexp(x))
    assert torch.equal(both, torch.logsumexp(x, (0, 1)))
