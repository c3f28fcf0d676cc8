"""The numerical contract: the one tolerance table every test and benchmark reads.

Each entry bounds the error of an rl-kernel result against an fp64 reference computed on the
*same* inputs (the low-precision inputs upcast to fp64, not a fresh fp64 draw): a value passes
when ``|actual - expected| <= atol + rtol * |expected|`` elementwise. The input dtype is the key:
our outputs (log-probs, entropies, losses) are always fp32 and accumulation is always fp32, so
bf16/fp16 rows bound fp32-accumulation error over bf16/fp16 operands, not output rounding.

Op classes:

* ``elementwise``: per-element maps (ratio, KL estimators, clipped surrogate terms).
* ``reduction``: sums/means over tokens or groups (aggregated losses, advantages, norms).
* ``logprob``: log-softmax at the target and entropy, from logits or hidden states (a length-D
  dot product per logit, then a length-V log-sum-exp).
* ``gradient``: gradients of the above with respect to hidden, weight, bias or logits.
* ``attention``: the batch-invariant attention/matmul chain.

For ``gradient`` and ``reduction`` the atol is scaled by the largest reference magnitude in the
tensor (:func:`error_bound`): those values are sums whose terms can cancel.

``docs/numerical_contract.md`` explains how each number was chosen and calibrated.

Bitwise rules (:data:`BITWISE_INVARIANCES`) are not tolerances: the results must be equal bit
for bit, and tests compare them with ``torch.equal``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OP_CLASSES: tuple[str, ...] = ("elementwise", "reduction", "logprob", "gradient", "attention")


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# Classes whose values are sums over many terms that can cancel (dW sums over all tokens, a
# loss over all tokens): an element's error scales with the magnitude of the terms, not of the
# element, so their atol is relative to the largest reference magnitude in the tensor.
SCALED_ATOL_CLASSES: frozenset[str] = frozenset({"gradient", "reduction"})


_DTYPE_KEYS = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("elementwise", "fp64"): Tolerance(1e-12, 1e-12),
    ("elementwise", "fp32"): Tolerance(1e-6, 1e-5),
    ("elementwise", "bf16"): Tolerance(1e-6, 1e-5),
    ("elementwise", "fp16"): Tolerance(1e-6, 1e-5),
    ("reduction", "fp64"): Tolerance(1e-12, 1e-10),
    ("reduction", "fp32"): Tolerance(1e-5, 1e-5),
    ("reduction", "bf16"): Tolerance(1e-5, 1e-5),
    ("reduction", "fp16"): Tolerance(1e-5, 1e-5),
    ("logprob", "fp64"): Tolerance(1e-10, 1e-10),
    ("logprob", "fp32"): Tolerance(2e-4, 1e-4),
    ("logprob", "bf16"): Tolerance(2e-3, 1e-3),
    ("logprob", "fp16"): Tolerance(2e-3, 1e-3),
    ("gradient", "fp64"): Tolerance(1e-10, 1e-8),
    ("gradient", "fp32"): Tolerance(1e-4, 1e-3),
    ("gradient", "bf16"): Tolerance(2e-2, 2e-2),
    ("gradient", "fp16"): Tolerance(1e-2, 1e-2),
    ("attention", "fp64"): Tolerance(1e-10, 1e-10),
    ("attention", "fp32"): Tolerance(1e-4, 1e-4),
    ("attention", "bf16"): Tolerance(2e-2, 2e-2),
    ("attention", "fp16"): Tolerance(5e-3, 5e-3),
}

BITWISE_INVARIANCES: tuple[str, ...] = (
    "same inputs run twice on the same device and backend give bitwise equal outputs and gradients",
    "a row's log-prob/entropy does not depend on the number of rows N or on the other rows' values",
    "a row's log-prob does not depend on padding, or on packing it with other sequences",
    "a row's log-prob has the same bits with and without entropy, with and without grad, and inside fused_linear_policy_loss",
    "vocab-parallel linear_logprob gives the same bits for TP sizes 1, 2 and 4",
    "with per-row seeds, a sampled token depends only on its row's logits, parameters and seed",
)


def dtype_key(dtype: torch.dtype) -> str:
    """The table key ('fp64', 'fp32', 'bf16', 'fp16') for a floating dtype."""
    try:
        return _DTYPE_KEYS[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {list(_DTYPE_KEYS)}, got {dtype}") from None


def tolerance(op_class: str, dtype: torch.dtype) -> Tolerance:
    """The (atol, rtol) bound for ``op_class`` results computed from ``dtype`` inputs."""
    if op_class not in OP_CLASSES:
        raise ValueError(f"op_class must be one of {OP_CLASSES}, got {op_class!r}")
    return TOLERANCES[(op_class, dtype_key(dtype))]


def error_bound(expected: torch.Tensor, op_class: str, dtype: torch.dtype) -> torch.Tensor:
    """Per-element allowed |actual - expected| for the fp64 reference ``expected``.

    ``atol + rtol * |expected|``; for :data:`SCALED_ATOL_CLASSES` the atol term is multiplied
    by ``max(1, max |expected|)``.
    """
    tol = tolerance(op_class, dtype)
    e = expected.detach().abs().to(torch.float64)
    atol = tol.atol
    if op_class in SCALED_ATOL_CLASSES and e.numel():
        atol = atol * max(1.0, float(e.max()))
    return atol + tol.rtol * e


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, op_class: str, dtype: torch.dtype, name: str = "value"
) -> None:
    """Assert ``actual`` is within the contract of ``expected`` (the fp64 reference).

    NaN or inf anywhere in ``actual`` where ``expected`` is finite fails. The message names the
    value, the worst element and the bound.
    """
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != reference shape {tuple(e.shape)}")
    if a.numel() == 0:
        return
    bad_nonfinite = ~torch.isfinite(a) & torch.isfinite(e)
    if bad_nonfinite.any():
        raise AssertionError(f"{name}: {int(bad_nonfinite.sum())} non-finite values where the reference is finite")
    err = (a - e).abs()
    bound = error_bound(e, op_class, dtype)
    excess = err - bound
    if (excess > 0).any():
        tol = tolerance(op_class, dtype)
        i = int(torch.argmax(excess))
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())}/{a.numel()} elements outside {op_class}/{dtype_key(dtype)} "
            f"contract (atol={tol.atol}, rtol={tol.rtol}); worst at flat index {i}: "
            f"actual={a.flatten()[i].item():.8g} expected={e.flatten()[i].item():.8g} err={err.flatten()[i].item():.3g}"
        )


def verdict(
    actual: torch.Tensor, expected: torch.Tensor, op_class: str, dtype: torch.dtype, name: str = "value"
) -> dict:
    """:func:`assert_close` as a record instead of an exception, for benchmarks that report every check.

    Returns ``{"within_contract": bool, "max_abs_err": float, "worst_fraction": float}`` (the
    largest ``|actual - expected|`` over its bound: at most 1 passes) plus ``"error"``, the
    :func:`assert_close` message, when it fails.
    """
    try:
        assert_close(actual, expected, op_class, dtype, name)
        message = None
    except AssertionError as exc:
        message = str(exc)
    row: dict = {"within_contract": message is None}
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape == e.shape and a.numel():
        err = (a - e).abs()
        row["max_abs_err"] = float(err.max())
        row["worst_fraction"] = float((err / error_bound(e, op_class, dtype)).max())
    else:
        row["max_abs_err"] = row["worst_fraction"] = 0.0 if a.shape == e.shape else float("inf")
    if message is not None:
        row["error"] = message
    return row
