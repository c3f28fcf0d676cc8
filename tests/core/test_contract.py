"""The tolerance table is complete and assert_close enforces it."""

import pytest
import torch

from rl_kernel_core import contract


def test_table_covers_every_class_and_dtype():
    for op_class in contract.OP_CLASSES:
        for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            tol = contract.tolerance(op_class, dtype)
            assert 0 < tol.atol < 1 and 0 < tol.rtol < 1


def test_low_precision_is_never_tighter_than_fp32():
    for op_class in contract.OP_CLASSES:
        fp32 = contract.tolerance(op_class, torch.float32)
        for dtype in (torch.bfloat16, torch.float16):
            low = contract.tolerance(op_class, dtype)
            assert low.atol >= fp32.atol and low.rtol >= fp32.rtol


def test_assert_close_accepts_within_and_rejects_outside():
    expected = torch.randn(100, dtype=torch.float64)
    tol = contract.tolerance("logprob", torch.float32)
    contract.assert_close(expected + tol.atol * 0.5, expected, "logprob", torch.float32)
    worse = expected.clone()
    worse[17] += 10 * (tol.atol + tol.rtol * abs(worse[17].item()))
    with pytest.raises(AssertionError, match="flat index 17"):
        contract.assert_close(worse, expected, "logprob", torch.float32, name="lp")


def test_assert_close_rejects_nan_and_shape_mismatch():
    expected = torch.randn(4, dtype=torch.float64)
    bad = expected.clone()
    bad[1] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        contract.assert_close(bad, expected, "elementwise", torch.float32)
    with pytest.raises(AssertionError, match="shape"):
        contract.assert_close(expected[:3], expected, "elementwise", torch.float32)


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match="op_class"):
        contract.tolerance("matmul", torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        contract.tolerance("logprob", torch.int32)


def test_gradient_atol_scales_with_the_largest_reference_value():
    expected = torch.tensor([1e-6, 50.0], dtype=torch.float64)
    tol = contract.tolerance("gradient", torch.float32)
    nudged = expected + torch.tensor([tol.atol * 40, 0.0], dtype=torch.float64)
    contract.assert_close(nudged, expected, "gradient", torch.float32)
    with pytest.raises(AssertionError):
        contract.assert_close(nudged, expected, "logprob", torch.float32)
