"""Per-token log-probs (and entropies) from logits.

Public op: :func:`logprob_from_logits` (:func:`rl_kernel_core.linear.api.linear_logprob` takes
hidden states; it shares this module's result helpers). It validates its arguments,
flattens the leading dims to N rows (making the inputs contiguous, so strided inputs give the same
bits as contiguous ones), returns empty results for N = 0 without calling a backend, and otherwise
runs the implementation chosen by :func:`rl_kernel_core.dispatch.select`.

Backend contract (what ``@dispatch.register(op, backend)`` implementations receive; arguments are
already validated, tensors are on one device and contiguous except where noted):

``"logprob_from_logits"``::

    impl(logits, targets, temperature, ignore_index, return_entropy)
        -> (logprob [N], entropy [N] or None)

    logits  [N, V]  float32 / bfloat16 / float16 / float64, N >= 1, unit stride along V (rows
                    may be strided: a view is passed as is, never copied to fp32 whole)
    targets [N]     int64 or int32, each in [0, V) or == ignore_index

Outputs are fp32 (fp64 when the inputs are fp64). The implementation owns autograd: it returns
tensors attached to the graph (e.g. through a ``torch.autograd.Function``) whose gradients reach
``hidden``, ``weight``, ``bias`` / ``logits`` in their own dtypes, through both outputs. Rows whose
target equals ``ignore_index`` give 0 log-prob, 0 entropy and no gradient. ``entropy`` is ``None``
exactly when ``return_entropy`` is False. A ``-inf`` logit (or ``bias`` entry) is legal: probability
0, nothing added to the entropy, gradient 0, never NaN; a ``-inf`` target logit gives log-prob
``-inf`` and a finite gradient. A row's log-prob has the same bits whatever ``return_entropy`` and
whether or not a gradient is recorded (and, for ``linear_logprob``, as inside
``fused_linear_policy_loss``). ``dispatch.select`` passes the same arguments to a
backend's ``supports`` predicate.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from rl_kernel_core import _checks, dispatch
from rl_kernel_core.batch_invariant_mode.api import is_batch_invariant
from rl_kernel_core.logprob import reference as _reference  # noqa: F401  (registers the torch backend)

Result = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def _scalars(temperature: float, ignore_index: int, return_entropy: bool) -> float:
    temperature = _checks.temperature("temperature", temperature)
    _checks.int64("ignore_index", ignore_index)
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy must be a bool, got {type(return_entropy).__name__}")
    return temperature


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty(shape: torch.Size, dtype: torch.dtype, first: torch.Tensor, *more: Optional[torch.Tensor]) -> torch.Tensor:
    """An empty result of ``shape`` on ``first``'s device, attached to the graph of ``first`` and
    ``more`` (so ``backward`` works)."""
    out = torch.zeros(shape, dtype=dtype, device=first.device)
    for src in (first, *more):
        if src is not None:
            out = out + src.reshape(-1)[:0].to(dtype).reshape(shape)
    return out


def _pack(logprob: torch.Tensor, entropy: Optional[torch.Tensor], shape: torch.Size, return_entropy: bool) -> Result:
    logprob = logprob.reshape(shape)
    if not return_entropy:
        return logprob
    assert entropy is not None, "a backend asked for the entropy returned none"
    return logprob, entropy.reshape(shape)


def logprob_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    backend: Optional[str] = "auto",
    id_check: str = "host",
) -> Result:
    """Log-probability of ``targets`` (and entropy) under ``softmax(logits / temperature)``.

    For logits a framework already holds: no fp32 copy of the whole ``logits`` is made (each
    row-chunk is upcast on its own). Masked entries (``-inf``) are allowed: they carry
    probability 0, add 0 to the entropy and get gradient 0.

    Args:
        logits: ``[..., V]`` float32/bfloat16/float16/float64; leading dims flatten to N.
        targets: ``[...]`` (``logits``' leading shape) int64/int32 ids in ``[0, V)`` or ``ignore_index``.
        temperature: a number >= the smallest normal fp32 (about 1.18e-38, so that
            ``1 / temperature`` is finite in fp32; whatever the dtype) dividing the logits.
        ignore_index: an int64; rows whose target equals it give 0 log-prob, 0 entropy and no gradient.
        return_entropy: also return the entropy of the tempered distribution.
        backend: ``"auto"`` (or None; ``RL_KERNEL_BACKEND`` applies), ``"native"``, ``"triton"``
            or ``"torch"``.
        id_check: ``"host"`` (default): an id outside ``[0, V)`` raises ValueError, at one
            device→host sync. ``"device"``: a device-side assert, no sync (an engine's sampler
            loop, whose ids are its own); a bad id then aborts the CUDA context.

    Returns:
        ``logprob`` with ``targets``' shape, fp32 (fp64 for fp64 logits); or ``(logprob, entropy)``
        when ``return_entropy``. Differentiable w.r.t. ``logits`` through both; the gradient comes
        back in ``logits``' dtype.

    Raises:
        TypeError: a wrong type or dtype. ValueError: a wrong shape, device, target id or
        temperature. rl_kernel_core.BackendUnavailableError: an explicit ``backend`` cannot run.
    """
    _checks.tensor("logits", logits, dtypes=_checks.FLOAT_DTYPES, min_ndim=1)
    _checks.tensor("targets", targets, dtypes=_checks.INDEX_DTYPES)
    _checks.same_device("logits", logits, targets=targets)
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(f"logits' last dim V must be >= 1, got shape {tuple(logits.shape)}")
    _checks.shape("targets", targets, logits.shape[:-1], f"logits' leading shape {tuple(logits.shape[:-1])}")
    temperature = _scalars(temperature, ignore_index, return_entropy)
    _checks.target_ids("targets", targets, vocab, ignore_index, id_check)

    if targets.numel() == 0:
        out = _out_dtype(logits.dtype)
        return _pack(
            _empty(targets.shape, out, logits), _empty(targets.shape, out, logits), targets.shape, return_entropy
        )
    l2d = logits.reshape(-1, vocab)
    if l2d.stride(-1) != 1:
        l2d = l2d.contiguous()
    t1d = targets.reshape(-1).contiguous()
    if is_batch_invariant() and not return_entropy:
        return _pack(_mode_logprob(l2d, t1d, temperature, ignore_index), None, targets.shape, False)
    impl = dispatch.select(
        "logprob_from_logits", backend, logits.device, l2d, t1d, temperature, ignore_index, return_entropy
    )
    logprob, entropy = impl(l2d, t1d, temperature, ignore_index, return_entropy)
    if is_batch_invariant():  # the entropy from the fused kernel, the log-prob with the mode's definition
        logprob = _mode_logprob(l2d, t1d, temperature, ignore_index)
    return _pack(logprob, entropy, targets.shape, return_entropy)


def _mode_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float, ignore_index: int) -> torch.Tensor:
    """The batch-invariant mode's log-prob ``[N]``: ``z[t] - logsumexp(z)`` with ``z = logits.float() /
    temperature`` by PyTorch's own division and the mode's routed ``logsumexp``, the formulation a
    trainer writes by hand (``log_softmax(z).gather``, ``-cross_entropy(z, t)``, ``z.gather(t) -
    logsumexp(z)``), so each of those gives these bits under the mode (docs/consistency.md)."""
    z = logits.to(_out_dtype(logits.dtype))
    if temperature != 1.0:
        z = z / temperature
    ignored = targets == ignore_index
    picked = z.gather(-1, targets.masked_fill(ignored, 0).to(torch.int64)[:, None]).squeeze(-1)
    return (picked - torch.logsumexp(z, dim=-1)).masked_fill(ignored, 0.0)
