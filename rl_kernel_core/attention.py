"""``varlen_attention``: causal (or full) attention over packed variable-length sequences, with
GQA and a fixed KV split order, so a prefill and an incremental decode over a KV cache give the
same bits (see :mod:`rl_kernel_core.reference.attention` for the reduction order).

Backends: ``triton`` (:mod:`rl_kernel_core.triton.attention`, CUDA; picked by ``auto`` there) and
``torch`` (the reference, any device). Both walk the keys in fixed blocks in ascending order; each
is batch-invariant on its own, and they agree to the contract, not bit for bit."""

from __future__ import annotations

from typing import Literal, Optional, Union, overload

import torch

from rl_kernel_core import _checks, dispatch
from rl_kernel_core.invariance import routing_suspended
from rl_kernel_core.reference import attention as _reference  # registers the torch backend

_INDEX_DTYPES = (torch.int32, torch.int64)


def _offsets(name: str, cu: torch.Tensor, total: int) -> list[int]:
    _checks.tensor(name, cu, dtypes=_INDEX_DTYPES, ndim=1)
    values = cu.tolist()
    if len(values) < 2 or values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must start at 0, never decrease and end at the token count {total}, got {values}")
    return values


@overload
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: Optional[torch.Tensor] = None, *, causal: bool = True, scale: Optional[float] = None,
                     return_lse: Literal[False] = False, backend: Optional[str] = "auto") -> torch.Tensor: ...
@overload
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: Optional[torch.Tensor] = None, *, causal: bool = True, scale: Optional[float] = None,
                     return_lse: Literal[True], backend: Optional[str] = "auto") -> tuple[torch.Tensor, torch.Tensor]: ...
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: Optional[torch.Tensor] = None, *, causal: bool = True, scale: Optional[float] = None,
                     return_lse: bool = False, backend: Optional[str] = "auto") -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention over packed sequences: sequence b's queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``
    attend to its keys/values ``k, v[cu_seqlens_k[b]:cu_seqlens_k[b+1]]``.

    Args:
        q: ``[Tq, Hq, D]`` float32/bfloat16/float16/float64.
        k, v: ``[Tk, Hkv, D]`` in q's dtype, with ``Hq % Hkv == 0`` (GQA: query head h reads KV head
            ``h // (Hq // Hkv)``).
        cu_seqlens_q: ``[B+1]`` int32/int64 offsets into q (0, ..., Tq).
        cu_seqlens_k: ``[B+1]`` offsets into k/v; defaults to ``cu_seqlens_q`` (self-attention).
        causal: a sequence's queries are its *last* Lq positions (bottom-right alignment, as in
            FlashAttention); query i sees keys ``0 .. Lk - Lq + i``. Decoding one token over a KV
            cache is ``Lq = 1`` with the cache as k/v. Requires ``Lq <= Lk``. Either way a
            sequence with queries needs at least one key.
        scale: softmax scale; default ``D ** -0.5`` (``D >= 1``).
        return_lse: a bool: also return the log-sum-exp of the scaled scores, ``[Tq, Hq]`` fp32.
        backend: ``"auto"`` (or None: ``RL_KERNEL_BACKEND``, default auto) or a backend name.

    Returns:
        ``[Tq, Hq, D]`` in q's dtype (and lse). A query's result is bitwise independent of the other
        sequences, of how many queries of its own sequence are computed with it (prefill vs decode)
        and of its position in the packed batch. Differentiable in q, k and v; the Triton
        backend's gradients are deterministic run to run, and a sequence's are bitwise independent
        of the other sequences (:mod:`rl_kernel_core.triton.attention`).
    """
    _checks.tensor("q", q, dtypes=_checks.FLOAT_DTYPES, ndim=3)
    _checks.tensor("k", k, dtypes=(q.dtype,), ndim=3)
    _checks.tensor("v", v, dtypes=(q.dtype,), ndim=3)
    _checks.same_device("q", q, k=k, v=v)
    _checks.same_shape("k", k, v=v)
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    if d == 0:
        raise ValueError(f"q must have a head dim D >= 1, got shape {tuple(q.shape)}")
    _checks.shape("k", k, (k.shape[0], hkv, d), f"[Tk, Hkv, D={d}]")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q's head count Hq={hq} must be a multiple of k's head count Hkv={hkv}")
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    scale = d ** -0.5 if scale is None else _checks.positive("scale", scale)
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_k = cu_q if cu_seqlens_k is None else _offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(cu_k) != len(cu_q):
        raise ValueError(f"cu_seqlens_k must have as many entries as cu_seqlens_q ({len(cu_q)}), got {len(cu_k)}")
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if causal and lq > lk:
            raise ValueError(f"causal attention needs Lq <= Lk per sequence; sequence {b} has Lq={lq}, Lk={lk}")
        if lq > 0 and lk == 0:  # a softmax over no keys: 0/0
            raise ValueError(f"cu_seqlens_k must give every sequence with queries at least one key; sequence {b} has Lq={lq}, Lk=0")
    impl = dispatch.select("varlen_attention", backend, q.device, q, k, v, cu_q, cu_k, causal, scale)
    # Every library call of both backends has a fixed shape already, so routing them through the
    # batch-invariant matmul as well would only cost time.
    with routing_suspended():
        out, lse = impl(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, causal, scale)
    return (out, lse) if return_lse else out
