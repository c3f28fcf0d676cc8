"""bi_linear (and the bi_matmul under it): the Triton persistent matmul against fp64 formulas, with
bitwise row invariance.

Runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set per test) with small odd
shapes, and on CUDA (``gpu`` marker) with model-sized ones. Invariance is asserted with
``torch.equal``; accuracy with the contract plus one rounding to the output dtype.

Under the interpreter ``tl.dot`` is numpy's matmul, whose CPU BLAS micro-kernels treat a row
differently by its position inside the tile, so there the matmul is checked for the rows that keep
their position (the first n rows of a batch); on CUDA rows are also moved to other positions.
"""

from __future__ import annotations

import pytest
import torch

from rl_kernel_core import dispatch
from rl_kernel_core.batch_invariant_mode.api import bi_linear, bi_matmul
from oracles import bi_shape, close_in_dtype, rows_invariant

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matmul_and_linear_match_fp64_and_are_row_invariant(seed, device, dtype):
    s = bi_shape(device)
    a = torch.randn(s["n"], s["k"], device=device).to(dtype)
    b = torch.randn(s["k"], s["m"], device=device).to(dtype)
    w, bias = torch.randn(s["m"], s["k"], device=device).to(dtype), torch.randn(s["m"], device=device).to(dtype)
    mm = lambda t: bi_matmul(t, b, backend="triton")
    lin = lambda t: bi_linear(t, w, bias, backend="triton")
    close_in_dtype(mm(a), a.double() @ b.double(), "attention", dtype, "bi_matmul")
    close_in_dtype(lin(a), a.double() @ w.double().t() + bias.double(), "attention", dtype, "bi_linear")
    assert dispatch.explain("bi_linear").backend == "triton"
    rows_invariant(mm, a, s["sizes"], move_rows=device.type == "cuda")
    rows_invariant(lin, a, s["sizes"], move_rows=device.type == "cuda")
