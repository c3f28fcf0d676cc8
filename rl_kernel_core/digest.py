"""Bit digests of tensors, to check that two copies of model weights hold the same bits.

:func:`row_digests` reads a tensor's raw bits (no arithmetic on its values, so ``-0.0`` and ``0.0``
or two NaN payloads differ) and reduces each row (index along the first dim) to one int64: the
sum over the row's elements of ``bits * (2 * column + 1)``, wrapping modulo 2**64. A row digest is
position-sensitive and changes with any single-bit change of the row. Digests per row, not per
tensor, because engines store some weights as row blocks of several checkpoint tensors (vLLM's
fused ``qkv_proj`` is ``q_proj``, ``k_proj`` and ``v_proj`` stacked): slicing the digest vector
compares the blocks without copying weights. One pass over the weights on their device, a block
of rows at a time (:data:`CHUNK_ELEMENTS`: the temporaries stay under 24 bytes times that, whatever
the tensor's size, a cast to another dtype included); the digests are small (one int64 per row).
Every dtype is digested by its raw bits: an element of 16 bytes (``complex128``) as two 8-byte words,
each with its own position weight.

A checksum against drift, not an integrity check: the digest is linear in the bits (modulo 2**64),
so two different tensors with equal digests are easy to construct on purpose (add ``k * w_j`` to
one element's bits and ``k * w_i`` less to another's). It catches what goes wrong by accident
(a sync that skipped or reordered a tensor, a rounding to another dtype, a stale copy, flipped
bits), where a one-bit change always changes the row's digest; it does not tell whether weights
are the ones a party intended when someone may have crafted them. For that, compare a
cryptographic hash of the bytes (``hashlib.sha256``) over a channel you trust.

Refused, with an error naming the argument (and in :func:`named_digests` the tensor's name): a
value that is not a ``torch.Tensor``, a sparse or other non-strided layout, a quantized tensor
(its bits mean nothing without its scale and zero point: digest ``int_repr()`` and those), a meta
tensor (no data), a 0-d tensor, and an ``as_dtype`` that is not a ``torch.dtype``.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK_ELEMENTS = 1 << 22
"""Elements per block of rows :func:`row_digests` widens to int64 at once (at least one row)."""


def row_digests(t: torch.Tensor, as_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``[R]`` int64 digests of ``t``'s rows (``t`` at least 1-D, any dtype; a 1-D tensor's
    elements are its rows), on ``t``'s device. ``as_dtype``: the digests of ``t.to(as_dtype)``,
    cast a block of rows at a time (no copy of the whole tensor)."""
    _check_digestible("t", t)
    if as_dtype is not None and not isinstance(as_dtype, torch.dtype):
        raise TypeError(f"row_digests: as_dtype must be a torch.dtype or None, got {type(as_dtype).__name__}")
    if t.dim() == 0:
        raise ValueError("row_digests needs a tensor of at least 1 dim, got a 0-d tensor")
    flat = t.detach().reshape(t.shape[0], math.prod(t.shape[1:]))
    dtype = as_dtype or flat.dtype
    size = dtype.itemsize
    if size > 8 and size % 8:
        raise TypeError(
            f"row_digests: dtype {str(dtype).replace('torch.', '')} has {size}-byte elements, which are "
            "not whole 8-byte words"
        )
    words = max(1, size // 8)  # an element's 8-byte words (complex128: 2), each weighted by its own position
    weights = torch.arange(1, 2 * flat.shape[1] * words + 1, 2, dtype=torch.int64, device=t.device)
    rows = max(1, CHUNK_ELEMENTS // max(1, flat.shape[1] * words))
    out = torch.empty(flat.shape[0], dtype=torch.int64, device=t.device)
    for start in range(0, flat.shape[0], rows):
        block = flat[start : start + rows].to(dtype).contiguous()
        out[start : start + rows] = (block.view(_BITS[min(size, 8)]).to(torch.int64) * weights).sum(dim=1)
    return out


def _check_digestible(name: str, t: object) -> None:
    """``t`` (called ``name`` in the message) is a dense, non-quantized tensor holding data."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"row_digests: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(
            f"row_digests: {name} must be a dense (strided) tensor, got layout {str(t.layout).replace('torch.', '')}"
        )
    if t.is_quantized:
        raise TypeError(
            f"row_digests: {name} must not be quantized (its bits mean nothing without its scale and zero "
            f"point; digest int_repr() and those), got dtype {str(t.dtype).replace('torch.', '')}"
        )
    if t.is_meta:
        raise ValueError(
            f"row_digests: {name} must hold data (its bits are digested), got a meta tensor of shape {tuple(t.shape)}"
        )


def named_digests(params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{name: row_digests(tensor)}`` moved to the CPU (one transfer per tensor, after all are computed).

    Raises:
        TypeError, ValueError: a tensor :func:`row_digests` refuses; the message starts with its name.
    """
    on_device = {}
    for name, t in params:
        try:
            on_device[name] = row_digests(t)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
    return {name: d.cpu() for name, d in on_device.items()}


def mismatches(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor]) -> list[str]:
    """Lines naming every tensor whose digests differ (with the first differing row), is missing
    on one side, or has another row count."""
    out = []
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            out.append(f"{name}: missing on the checked side")
        elif name not in expected:
            out.append(f"{name}: not in the reference")
        elif expected[name].shape != actual[name].shape:
            out.append(f"{name}: {expected[name].shape[0]} rows in the reference, {actual[name].shape[0]} checked")
        elif not torch.equal(expected[name], actual[name]):
            row = int((expected[name] != actual[name]).nonzero()[0])
            out.append(f"{name}: bits differ (first at row {row})")
    return out
