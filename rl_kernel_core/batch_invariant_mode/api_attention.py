"""``varlen_attention``: causal (or full) attention over packed variable-length sequences, with
GQA and a fixed KV split order, so a prefill and an incremental decode over a KV cache give the
same bits (see :mod:`rl_kernel_core.batch_invariant_mode.reference_attention` for the reduction order).

Backends: ``triton`` (:mod:`rl_kernel_core.batch_invariant_mode.triton_attention`, CUDA; picked by ``auto`` there) and
``torch`` (the reference, any device). Both walk the keys in fixed blocks in ascending order; each
is batch-invariant on its own, and they agree to the contract, not bit for bit.

``paged_attention`` / ``write_paged_kv``: the Triton forward over a paged KV cache (vLLM's
FlashAttention layout) with ``varlen_attention``'s bits and no host read, for an inference engine's
CUDA graphs (:mod:`rl_kernel_vllm.attention`)."""

from __future__ import annotations

from typing import Literal, Optional, Union, overload

import torch

from rl_kernel_core import _checks, dispatch
from rl_kernel_core.batch_invariant_mode.api import routing_suspended

_INDEX_DTYPES = (torch.int32, torch.int64)


def _offsets(name: str, cu: torch.Tensor, total: int) -> list[int]:
    _checks.tensor(name, cu, dtypes=_INDEX_DTYPES, ndim=1)
    _checks.needs_data(name, cu, "its offsets are read on the host")
    values = cu.tolist()
    if len(values) < 2 or values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must start at 0, never decrease and end at the token count {total}, got {values}")
    return values


@overload
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    return_lse: Literal[False] = False,
    backend: Optional[str] = "auto",
) -> torch.Tensor: ...
@overload
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    return_lse: Literal[True],
    backend: Optional[str] = "auto",
) -> tuple[torch.Tensor, torch.Tensor]: ...
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    return_lse: bool = False,
    backend: Optional[str] = "auto",
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
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
        of the other sequences (:mod:`rl_kernel_core.batch_invariant_mode.triton_attention`).
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
    scale = d**-0.5 if scale is None else _checks.positive("scale", scale)
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_k = cu_q if cu_seqlens_k is None else _offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(cu_k) != len(cu_q):
        raise ValueError(f"cu_seqlens_k must have as many entries as cu_seqlens_q ({len(cu_q)}), got {len(cu_k)}")
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if causal and lq > lk:
            raise ValueError(f"causal attention needs Lq <= Lk per sequence; sequence {b} has Lq={lq}, Lk={lk}")
        if lq > 0 and lk == 0:  # a softmax over no keys: 0/0
            raise ValueError(
                f"cu_seqlens_k must give every sequence with queries at least one key; sequence {b} has Lq={lq}, Lk=0"
            )
    out, lse = checked_varlen_attention(q, k, v, cu_q, cu_k, causal, scale, backend)
    return (out, lse) if return_lse else out


def checked_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: list[int],
    cu_k: list[int],
    causal: bool,
    scale: float,
    backend: Optional[str] = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`varlen_attention` with ``return_lse=True`` for a caller that has already checked its
    arguments as :func:`varlen_attention` does (the batch-invariant mode's transformers attention,
    once a layer at every decode step, builds the packed layout itself): offsets as Python lists,
    ``scale`` given, no checks."""
    impl = dispatch.select("varlen_attention", backend, q.device, q, k, v, cu_q, cu_k, causal, scale)
    # Every library call of both backends has a fixed shape already, so routing them through the
    # batch-invariant matmul as well would only cost time.
    with routing_suspended():
        return impl(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, causal, scale)


def _paged_kv_heads(kv_cache: torch.Tensor, name: str, like: torch.Tensor) -> int:
    """Hkv of a paged cache ``[num_blocks, Hkv, block_size, 2*D]`` in the dtype and on the device of
    the tensor ``like`` (named ``name``, ``[T, H, D]``), after checking it."""
    d = like.shape[2]
    _checks.tensor("kv_cache", kv_cache, dtypes=(like.dtype,), ndim=4)
    _checks.same_device(name, like, kv_cache=kv_cache)
    _checks.shape(
        "kv_cache",
        kv_cache,
        (kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[2], 2 * d),
        f"[num_blocks, Hkv, block_size, 2*D={2 * d}]",
    )
    if kv_cache.stride(3) != 1:
        raise ValueError(f"kv_cache's last dim must be contiguous, got strides {kv_cache.stride()}")
    return kv_cache.shape[1]


def _paged_kernels(device: torch.device):
    from rl_kernel_core.triton._jit import interpreting

    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"paged attention runs Triton kernels: expected CUDA tensors (or TRITON_INTERPRET=1), got {device}"
        )
    from rl_kernel_core.batch_invariant_mode import triton_attention as kernels

    return kernels


PAGED_MAX_SEQS = 4095
"""The most sequences one :func:`paged_attention` call takes: each program sums the sequences' tile
counts in registers (``BLOCK_S = next_power_of_2(B + 1)`` lanes)."""


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: Optional[int] = None,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`varlen_attention`'s forward over a paged KV cache, with its bits: a query's output equals
    bit for bit what ``varlen_attention`` (Triton backend) gives it over the same keys and values in
    a packed layout, whatever the other sequences, its tile position or the cache's block size.
    Reads every size and offset from device memory (no host read, no host-to-device copy), so a
    call can be captured in a CUDA graph and replayed with new offsets and block tables.

    Args:
        q: ``[T, Hq, D]`` (rows may be strided; the last dim contiguous), bfloat16/float16/float32,
            CUDA (or any device under ``TRITON_INTERPRET=1``).
        kv_cache: ``[num_blocks, Hkv, block_size, 2*D]`` in q's dtype: a token's key in the first D
            columns, its value in the last D (vLLM's FlashAttention cache layout); ``Hq % Hkv == 0``.
        block_table: ``[B', max_blocks]`` int32/int64, ``B' >= B``: sequence b's position ``p`` is in
            block ``block_table[b, p // block_size]`` at row ``p % block_size``.
        cu_seqlens_q: ``[B+1]`` int32/int64 offsets into q; sequence b's queries are its *last*
            ``Lq`` positions (causal bottom-right alignment, as ``varlen_attention``).
        seq_lens: ``[B]`` int32/int64: sequence b's key count ``Lk >= Lq`` (cached + new tokens;
            those must already be in the cache). A sequence with ``Lq = 0`` is skipped (padding).
        max_query_len: a host int ``>= max(Lq)``, which narrows the launch where ``B * cdiv(max_query_len,
            BLOCK_M)`` is fewer programs than ``cdiv(T, BLOCK_M) + B``; or None (default): the launch
            covers any query counts summing to at most T, so a CUDA graph captured once replays any
            mix of prefills, chunks and decodes of up to T queries.
        causal, scale: as :func:`varlen_attention`.
        out: optional ``[T, Hq, D]`` in q's dtype to write into (rows may be strided).

    Returns:
        ``out`` (or a new ``[T, Hq, D]`` tensor): rows of queries outside ``cu_seqlens_q``'s range are
        left as they were. Forward only (no autograd); the offsets' values are not checked (that
        would read them on the host).
    """
    _checks.tensor("q", q, dtypes=(torch.float32, torch.bfloat16, torch.float16), ndim=3)
    hq, d = q.shape[1], q.shape[2]
    hkv = _paged_kv_heads(kv_cache, "q", q)
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q's head count Hq={hq} must be a multiple of kv_cache's head count Hkv={hkv}")
    if d > 256:
        raise ValueError(f"q's head dim D={d} exceeds the kernel's limit of 256")
    _checks.tensor("block_table", block_table, dtypes=_INDEX_DTYPES, ndim=2)
    _checks.tensor("cu_seqlens_q", cu_seqlens_q, dtypes=_INDEX_DTYPES, ndim=1)
    _checks.tensor("seq_lens", seq_lens, dtypes=_INDEX_DTYPES, ndim=1)
    _checks.same_device("q", q, block_table=block_table, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
    b = seq_lens.shape[0]
    if b > PAGED_MAX_SEQS:
        raise ValueError(f"seq_lens: at most {PAGED_MAX_SEQS} sequences a call, got {b}")
    if cu_seqlens_q.shape[0] != b + 1:
        raise ValueError(f"cu_seqlens_q must have seq_lens' length + 1 = {b + 1} entries, got {cu_seqlens_q.shape[0]}")
    if block_table.shape[0] < b:
        raise ValueError(f"block_table must have a row per sequence (>= {b}), got shape {tuple(block_table.shape)}")
    if max_query_len is not None and (
        isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0
    ):
        raise ValueError(f"max_query_len must be None or an int >= 0, got {max_query_len!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = d**-0.5 if scale is None else _checks.positive("scale", scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        _checks.tensor("out", out, dtypes=(q.dtype,), ndim=3)
        _checks.shape("out", out, tuple(q.shape), "q's shape")
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous, got strides {t.stride()}")
    return _paged_kernels(q.device).paged_forward(
        q, kv_cache, block_table, cu_seqlens_q, seq_lens, max_query_len, causal, scale, out
    )


def write_paged_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store token ``i``'s key and value ``[Hkv, D]`` in ``kv_cache`` (layout of
    :func:`paged_attention`) at slot ``slot_mapping[i]``: block ``slot // block_size``, row ``slot %
    block_size``; a negative slot (padding) is skipped. ``key``/``value`` ``[T, Hkv, D]`` in the cache's
    dtype (rows may be strided; ``T >= len(slot_mapping)``, extra rows ignored), ``slot_mapping``
    ``[N]`` int32/int64. Exact copies, one launch, no host read."""
    _checks.tensor("key", key, dtypes=_checks.FLOAT_DTYPES, ndim=3)
    _checks.tensor("value", value, dtypes=(key.dtype,), ndim=3)
    _checks.same_shape("key", key, value=value)
    hkv = _paged_kv_heads(kv_cache, "key", key)
    _checks.shape("key", key, (key.shape[0], hkv, key.shape[2]), f"[T, Hkv={hkv}, D]")
    _checks.tensor("slot_mapping", slot_mapping, dtypes=_INDEX_DTYPES, ndim=1)
    _checks.same_device("key", key, value=value, slot_mapping=slot_mapping)
    if slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} key rows")
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous, got strides {t.stride()}")
    _paged_kernels(key.device).paged_write(kv_cache, key, value, slot_mapping)
