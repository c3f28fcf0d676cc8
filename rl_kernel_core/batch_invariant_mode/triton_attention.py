"""Triton backend of ``varlen_attention`` (signature in :mod:`rl_kernel_core.batch_invariant_mode.api_attention`).

Forward: one program per (query tile, query head). A tile is ``BLOCK_M`` consecutive queries of one
sequence; the program walks that sequence's keys in blocks of ``BLOCK_N`` in ascending order 0, 1,
2, ... with an online softmax (running max, sum and weighted values in fp32), exactly the order of
the torch reference (:mod:`rl_kernel_core.batch_invariant_mode.reference_attention`), so a query visits the same blocks
in the same order whether it is computed in a full prefill or alone in a decode step over a KV
cache. A block that is entirely masked for a query (past its causal end, visited for the tile's
later rows) leaves its state bit for bit unchanged (rescale ``exp(0) = 1``, probabilities exactly
0). The tile table (which sequence and first query each tile holds) and the sequence offsets are
read from device memory (copied once per layout, see :func:`_tables`), and no per-call size is a
kernel argument, so every call runs the same compiled kernel. Tile sizes are fixed per dtype
(:data:`rl_kernel_core.triton.tuning.TILES`).

Paged forward (:func:`paged_forward`): the same tile shape and the same online softmax
(:func:`_attend_keys`), with the keys and values read through a block table from a paged cache, the
query heads of a GQA group in one tile (a decode step fills a row per head, not one row of a tile
per head; a row's bits do not depend on the other rows of its tile), and the tile of a program
found in the kernel from the query offsets (no tile table: the sequences' tile counts summed in
registers, programs past the last tile idle), so a query gets the forward's bits, the launch reads
nothing from the host and its size does not depend on the query counts.

Backward (FlashAttention-2 style, from the forward's ``out`` and log-sum-exp), two launches of
:func:`_attention_bwd_kernel`. Per sequence and query head, with ``S = Q K^T`` over the head's KV
head, ``P = exp(S * scale - lse)`` (0 where masked: the softmax the forward computed) and
``delta = rowsum(dO * O)``::

    dV = P^T dO        dS = P * (dO V^T - delta)        dQ = dS K * scale        dK = dS^T Q * scale

with dK and dV summed over the query heads of a GQA group: the gradient of the attention defined in
:mod:`rl_kernel_core.batch_invariant_mode.reference_attention`.

* dq pass, one program per (query tile, query head), over a tile table of the queries: the tile's
  delta (stored for the next pass), then its key blocks in ascending order, as the forward.
* dk/dv pass, one program per (key tile, KV head), over a tile table of the keys: the query heads
  of the KV head's GQA group in ascending order and, for each, the query blocks that see the tile
  in ascending order, summed into one fp32 accumulator (no atomics).

Products accumulate in fp32 (IEEE fp32 products for fp32 inputs; for 16-bit inputs ``P`` and
``dS`` are rounded to the input dtype before their products on CUDA, as FlashAttention does); each
gradient is rounded once to the input dtype. Guarantees: every sum runs in a fixed order, so the
gradients are bitwise deterministic run to run; and a program reads one sequence's rows only, with
tile boundaries counted from the sequence's start, so a sequence's gradients are bitwise
independent of the other sequences of the call and of its place among them (packed or padded
layouts alike). They do not have the torch reference's bits; and a layout that gives a sequence
other queries (a decode step, a prefill chunk) differentiates another function, whose gradients
are not comparable bit for bit with the whole sequence's.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.batch_invariant_mode import triton_launch as native_launch
from rl_kernel_core.triton._autograd import records_graph
from rl_kernel_core.triton._jit import helper_jit, interpreting, launch_time_jit
from rl_kernel_core.triton._matmul_helpers import dot_acc
from rl_kernel_core.triton.tuning import ATTENTION_INTERPRETED_TILES, BWD_TILES, TILES

FORWARD_KERNELS = "varlen_attention_forward"
"""The name under which the forward's launches record their route
(:func:`rl_kernel_core.dispatch.ran`): ``"triton+cpp_launch"`` where the C++ launcher served one,
else ``"triton"``; a launch under torch.compile or the interpreter records none (the backward
always launches through Triton)."""


@helper_jit
def _tile(tile_seq_ptr, tile_start_ptr, cu_q_ptr, cu_k_ptr):
    """Tile ``program_id(0)`` of a tile table (see :func:`_tables`): ``(its first row's index in its
    sequence, the sequence's first query row, Lq, first key row, Lk)``."""
    tile = tl.program_id(0)
    seq = tl.load(tile_seq_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    q0 = tl.load(cu_q_ptr + seq)
    lq = tl.load(cu_q_ptr + seq + 1) - q0
    k0 = tl.load(cu_k_ptr + seq)
    lk = tl.load(cu_k_ptr + seq + 1) - k0
    return start, q0, lq, k0, lk


@helper_jit
def _query_tile(
    head0,
    q_ptr,
    stride_qt,
    stride_qh,
    start,
    q0,
    lq,
    lk,
    PACK: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The query tile of a sequence (first query row ``q0``, ``lq`` queries, ``lk`` keys) whose first
    query is ``start``, at ``PACK`` query heads (``head0`` and the next), from queries with row
    stride ``stride_qt`` and head stride ``stride_qh``: row ``r`` is query ``start + r // PACK`` at
    head ``head0 + r % PACK``, so the tile holds ``BLOCK_M // PACK`` queries (rows past ``PACK``
    times that are absent). Returns ``(each row's head, its query index in the sequence, which rows
    exist, dims, which exist, the queries [BLOCK_M, BLOCK_D] (zero where absent), their key
    positions, how many key blocks the tile visits)``."""
    r = tl.arange(0, BLOCK_M)
    offset = lk - lq
    rows = start + r // PACK
    heads = head0 + r % PACK
    row_ok = (r < (BLOCK_M // PACK) * PACK) & (rows < lq)
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    q = tl.load(
        q_ptr + (q0 + rows)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST_DOT:  # the CPU interpreter multiplies 16-bit floats as integers; the upcast is exact
        q = q.to(tl.float32)
    qpos = offset + rows
    n_blocks = tl.cdiv(lk, BLOCK_N)
    if CAUSAL:
        last = offset + tl.minimum(start + BLOCK_M // PACK, lq) - 1
        n_blocks = tl.minimum(n_blocks, last // BLOCK_N + 1)
    return heads, rows, row_ok, dims, d_ok, q, qpos, n_blocks


@helper_jit
def _key_block(k_ptr, v_ptr, k0, kpos, lk, kv_head, HKV: tl.constexpr, D: tl.constexpr, dims, d_ok):
    """Keys and values at positions ``kpos`` of a sequence (first key row ``k0``, ``lk`` keys) and
    KV head ``kv_head`` of ``[Tk, HKV, D]`` tensors: ``(which positions exist, keys, values)``,
    ``[len(kpos), BLOCK_D]``, zero where absent."""
    k_ok = kpos < lk
    kv_off = ((k0 + kpos)[:, None].to(tl.int64) * HKV + kv_head) * D + dims[None, :]
    kb = tl.load(k_ptr + kv_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    vb = tl.load(v_ptr + kv_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    return k_ok, kb, vb


@helper_jit
def _paged_key_block(
    cache_ptr,
    block_row_ptr,
    kpos,
    lk,
    kv_head,
    stride_cb,
    stride_ch,
    stride_cr,
    D: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    dims,
    d_ok,
):
    """As :func:`_key_block`, from a paged cache ``[num_blocks, Hkv, CACHE_BLOCK, 2*D]`` (a token's
    key in the first D columns, its value in the last D): position ``p`` of the sequence lives in
    block ``block_row_ptr[p // CACHE_BLOCK]`` at row ``p % CACHE_BLOCK``."""
    k_ok = kpos < lk
    block = tl.load(block_row_ptr + kpos // CACHE_BLOCK, mask=k_ok, other=0).to(tl.int64)
    row_off = block * stride_cb + kv_head * stride_ch + (kpos % CACHE_BLOCK) * stride_cr
    mask = k_ok[:, None] & d_ok[None, :]
    kb = tl.load(cache_ptr + row_off[:, None] + dims[None, :], mask=mask, other=0.0)
    vb = tl.load(cache_ptr + row_off[:, None] + D + dims[None, :], mask=mask, other=0.0)
    return k_ok, kb, vb


@helper_jit
def _attend_keys(
    q,
    qpos,
    n_blocks,
    lk,
    kv_head,
    scale,
    k_ptr,
    v_ptr,
    k0,
    cache_ptr,
    block_row_ptr,
    stride_cb,
    stride_ch,
    stride_cr,
    dims,
    d_ok,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The forward's online softmax of a query tile over its first ``n_blocks`` key blocks in
    ascending order: ``(running max, sum, weighted values)`` in fp32. Keys from packed ``[Tk, HKV,
    D]`` tensors (:func:`_key_block`) or, ``PAGED``, from a paged cache (:func:`_paged_key_block`);
    the arithmetic is the same either way, so a paged decode and a packed prefill give a query the
    same bits."""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for j in range(0, n_blocks):
        kpos = j * BLOCK_N + cols
        if PAGED:
            k_ok, kb, vb = _paged_key_block(
                cache_ptr, block_row_ptr, kpos, lk, kv_head, stride_cb, stride_ch, stride_cr, D, CACHE_BLOCK, dims, d_ok
            )
        else:
            k_ok, kb, vb = _key_block(k_ptr, v_ptr, k0, kpos, lk, kv_head, HKV, D, dims, d_ok)
        if UPCAST_DOT:
            kb = kb.to(tl.float32)
            vb = vb.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(kb), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kb))
        valid = tl.broadcast_to(k_ok[None, :], (BLOCK_M, BLOCK_N))
        if CAUSAL:
            valid = valid & (kpos[None, :] <= qpos[:, None])
        s = tl.where(valid, s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m = m_new
    return m, l, acc


@launch_time_jit(do_not_specialize=["scale"])
def _attention_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    cu_q_ptr,
    cu_k_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    scale,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start, q0, lq, k0, lk = _tile(tile_seq_ptr, tile_start_ptr, cu_q_ptr, cu_k_ptr)
    head = tl.program_id(1)
    kv_head = head // GROUP
    _, rows, row_ok, dims, d_ok, q, qpos, n_blocks = _query_tile(
        head, q_ptr, HQ * D, D, start, q0, lq, lk, 1, D, BLOCK_D, CAUSAL, UPCAST_DOT, BLOCK_M, BLOCK_N
    )
    # packed keys (PAGED=False): the paged-cache arguments are placeholders the compiler drops
    m, l, acc = _attend_keys(
        q,
        qpos,
        n_blocks,
        lk,
        kv_head,
        scale,
        k_ptr,
        v_ptr,
        k0,
        k_ptr,
        k_ptr,
        0,
        0,
        0,
        dims,
        d_ok,
        HQ // GROUP,
        D,
        BLOCK_D,
        False,
        1,
        CAUSAL,
        IEEE,
        UPCAST_DOT,
        BLOCK_M,
        BLOCK_N,
    )
    out = acc / l[:, None]
    tl.store(
        o_ptr + ((q0 + rows)[:, None].to(tl.int64) * HQ + head) * D + dims[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + (q0 + rows).to(tl.int64) * HQ + head, m + tl.log(l), mask=row_ok)


@launch_time_jit(do_not_specialize=["scale", "num_seqs"])
def _paged_attention_fwd_kernel(
    q_ptr,
    cache_ptr,
    o_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    block_table_ptr,
    num_seqs,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ch,
    stride_cr,
    stride_bt,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    PACK: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The forward over a paged KV cache: program ``p * (HQ // PACK) + b`` holds the ``p``-th query
    tile of the call at the query heads ``b * PACK`` to ``b * PACK + PACK - 1`` (``PACK`` divides the
    GQA group: they share a KV head, whose blocks the program reads once for all of them), counting
    sequence 0's ``cdiv(Lq, BLOCK_M // PACK)`` tiles first, then sequence 1's, ... (each tile
    ``BLOCK_M // PACK`` queries from the sequence's first, at each of its heads: a decode step fills
    ``PACK`` rows; programs past the last tile do nothing). A row's arithmetic is a row of
    :func:`_attend_keys` whichever rows share its tile. The tile counts are summed here from ``cu_q``
    (``BLOCK_S >= num_seqs + 1``), so sizes and offsets are read from device memory only: a launch
    can be captured in a CUDA graph and replayed with new ones, as long as it has a program per tile
    (``cdiv(T, BLOCK_M // PACK) + num_seqs`` tiles always do)."""
    tile = tl.program_id(0) // (HQ // PACK)
    head0 = (tl.program_id(0) % (HQ // PACK)) * PACK
    kv_head = head0 // GROUP
    per_tile = BLOCK_M // PACK
    seqs = tl.arange(0, BLOCK_S)
    bounds = tl.load(cu_q_ptr + seqs, mask=seqs <= num_seqs, other=0)
    lengths = tl.where(seqs < num_seqs, tl.load(cu_q_ptr + seqs + 1, mask=seqs < num_seqs, other=0) - bounds, 0)
    tiles = (lengths + per_tile - 1) // per_tile
    ends = tl.cumsum(tiles, 0)  # tiles of sequences 0..s
    seq_found = tl.sum((ends <= tile).to(tl.int32), 0)  # the sequence whose tiles hold this one
    idle = seq_found >= num_seqs
    seq = tl.where(idle, 0, seq_found)
    first_tile = tl.sum(tl.where(seqs == seq, ends - tiles, 0), 0)
    start = (tile - first_tile) * per_tile
    q0 = tl.load(cu_q_ptr + seq)
    lq = tl.where(idle, 0, tl.load(cu_q_ptr + seq + 1) - q0)
    lk = tl.load(seq_lens_ptr + seq)
    heads, rows, row_ok, dims, d_ok, q, qpos, n_blocks = _query_tile(
        head0, q_ptr, stride_qt, stride_qh, start, q0, lq, lk, PACK, D, BLOCK_D, CAUSAL, UPCAST_DOT, BLOCK_M, BLOCK_N
    )
    n_blocks = tl.where(start < lq, n_blocks, 0)
    block_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    m, l, acc = _attend_keys(
        q,
        qpos,
        n_blocks,
        lk,
        kv_head,
        scale,
        cache_ptr,
        cache_ptr,
        0,
        cache_ptr,
        block_row_ptr,
        stride_cb,
        stride_ch,
        stride_cr,
        dims,
        d_ok,
        HQ // GROUP,
        D,
        BLOCK_D,
        True,
        CACHE_BLOCK,
        CAUSAL,
        IEEE,
        UPCAST_DOT,
        BLOCK_M,
        BLOCK_N,
    )
    out = acc / l[:, None]
    tl.store(
        o_ptr + (q0 + rows)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@launch_time_jit()
def _paged_write_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_cr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
):
    """Token ``program_id(0)``'s key and value at KV head ``program_id(1)`` into its cache slot (block
    ``slot // CACHE_BLOCK``, row ``slot % CACHE_BLOCK``); a negative slot (padding) writes nothing."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    dst = cache_ptr + (slot // CACHE_BLOCK) * stride_cb + h * stride_ch + (slot % CACHE_BLOCK) * stride_cr + dims
    keep = d_ok & (slot >= 0)
    tl.store(dst, tl.load(key_ptr + t * stride_kt + h * stride_kh + dims, mask=d_ok), mask=keep)
    tl.store(dst + D, tl.load(value_ptr + t * stride_vt + h * stride_vh + dims, mask=d_ok), mask=keep)


@launch_time_jit(do_not_specialize=["scale"])
def _attention_bwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    cu_q_ptr,
    cu_k_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    scale,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DKDV: tl.constexpr,
):
    """One program of the backward's dq pass (``DKDV`` false; grid: query tiles x query heads) or
    of its dk/dv pass (grid: key tiles x KV heads), which reads the dq pass's delta."""
    if not DKDV:
        # dq of one query tile and head, and its delta; the tile's key blocks in ascending order.
        start, q0, lq, k0, lk = _tile(tile_seq_ptr, tile_start_ptr, cu_q_ptr, cu_k_ptr)
        head = tl.program_id(1)
        kv_head = head // GROUP
        _, rows, row_ok, dims, d_ok, q, qpos, n_blocks = _query_tile(
            head, q_ptr, HQ * D, D, start, q0, lq, lk, 1, D, BLOCK_D, CAUSAL, UPCAST_DOT, BLOCK_M, BLOCK_N
        )
        io_off = ((q0 + rows)[:, None].to(tl.int64) * HQ + head) * D + dims[None, :]
        io_mask = row_ok[:, None] & d_ok[None, :]
        do = tl.load(do_ptr + io_off, mask=io_mask, other=0.0)
        delta = tl.sum(do.to(tl.float32) * tl.load(o_ptr + io_off, mask=io_mask, other=0.0).to(tl.float32), 1)
        row_off = (q0 + rows).to(tl.int64) * HQ + head
        tl.store(delta_ptr + row_off, delta, mask=row_ok)
        lse = tl.load(lse_ptr + row_off, mask=row_ok, other=0.0)
        cols = tl.arange(0, BLOCK_N)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for j in range(0, n_blocks):
            kpos = j * BLOCK_N + cols
            k_ok, kb, vb = _key_block(k_ptr, v_ptr, k0, kpos, lk, kv_head, HQ // GROUP, D, dims, d_ok)
            valid = tl.broadcast_to(k_ok[None, :], (BLOCK_M, BLOCK_N))
            if CAUSAL:
                valid = valid & (kpos[None, :] <= qpos[:, None])
            s = dot_acc(q, tl.trans(kb), zeros, IEEE, UPCAST_DOT)
            p = tl.exp(tl.where(valid, s * scale, float("-inf")) - lse[:, None])
            ds = p * (dot_acc(do, tl.trans(vb), zeros, IEEE, UPCAST_DOT) - delta[:, None])
            dq = dot_acc(ds if IEEE else ds.to(kb.dtype), kb, dq, IEEE, UPCAST_DOT)
        tl.store(dq_ptr + io_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=io_mask)
    else:
        # dk, dv of one key tile and KV head, computed transposed (rows are keys): over the group's
        # query heads in ascending order and, for each, over the query blocks that see the tile,
        # in ascending order.
        kv_head = tl.program_id(1)
        start, q0, lq, k0, lk = _tile(tile_seq_ptr, tile_start_ptr, cu_q_ptr, cu_k_ptr)
        offset = lk - lq
        kpos = start + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, BLOCK_D)
        d_ok = dims < D
        # Rows past the sequence's keys (zero keys and values) give dK/dV rows that are not stored.
        k_ok, kb, vb = _key_block(k_ptr, v_ptr, k0, kpos, lk, kv_head, HQ // GROUP, D, dims, d_ok)
        first = 0
        if CAUSAL:  # the query block holding the first query that sees key `start`
            first = tl.maximum(start - offset, 0) // BLOCK_M * BLOCK_M
        cols = tl.arange(0, BLOCK_M)
        zeros = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        for g in range(0, GROUP):
            head = kv_head * GROUP + g
            for m in range(first, lq, BLOCK_M):
                rows = m + cols
                row_ok = rows < lq
                io_off = ((q0 + rows)[:, None].to(tl.int64) * HQ + head) * D + dims[None, :]
                io_mask = row_ok[:, None] & d_ok[None, :]
                qb = tl.load(q_ptr + io_off, mask=io_mask, other=0.0)
                dob = tl.load(do_ptr + io_off, mask=io_mask, other=0.0)
                # Rows past the sequence's queries: lse = +inf makes their probabilities exactly 0.
                row_off = (q0 + rows).to(tl.int64) * HQ + head
                lse = tl.load(lse_ptr + row_off, mask=row_ok, other=float("inf"))
                delta = tl.load(delta_ptr + row_off, mask=row_ok, other=0.0)
                st = dot_acc(kb, tl.trans(qb), zeros, IEEE, UPCAST_DOT) * scale
                if CAUSAL:
                    st = tl.where(kpos[:, None] <= (offset + rows)[None, :], st, float("-inf"))
                pt = tl.exp(st - lse[None, :])
                dv = dot_acc(pt if IEEE else pt.to(dob.dtype), dob, dv, IEEE, UPCAST_DOT)
                dst = pt * (dot_acc(vb, tl.trans(dob), zeros, IEEE, UPCAST_DOT) - delta[None, :])
                dk = dot_acc(dst if IEEE else dst.to(qb.dtype), qb, dk, IEEE, UPCAST_DOT)
        kv_off = ((k0 + kpos)[:, None].to(tl.int64) * (HQ // GROUP) + kv_head) * D + dims[None, :]
        tl.store(dk_ptr + kv_off, (dk * scale).to(dk_ptr.dtype.element_ty), mask=k_ok[:, None] & d_ok[None, :])
        tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=k_ok[:, None] & d_ok[None, :])


TABLE_CACHE_SIZE = 64
"""Layouts (offsets and tile size) whose device tables :func:`_tables` keeps."""


@functools.lru_cache(maxsize=TABLE_CACHE_SIZE)
def _tables(
    device: torch.device, bm: int, cu_q: tuple[int, ...], cu_k: tuple[int, ...]
) -> Optional[tuple[torch.Tensor, ...]]:
    """Device int32 copies of the offsets and of the tile table over the first offsets (each
    ``bm``-row tile's sequence and first row), or None when they hold no rows. The forward and the
    backward's dq pass tile the queries; the dk/dv pass passes the key offsets first and tiles the
    keys. Kept per layout: the layers of one
    forward share them (one host-to-device copy per forward, not per layer), and a CUDA graph
    captured after a call with the same layout reads tensors that stay alive while the layout is
    among the last :data:`TABLE_CACHE_SIZE` used (capture itself cannot copy from host memory)."""
    tile_seq, tile_start = [], []
    for b in range(len(cu_q) - 1):
        for start in range(0, cu_q[b + 1] - cu_q[b], bm):
            tile_seq.append(b)
            tile_start.append(start)
    if not tile_seq:
        return None
    return tuple(
        torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)
        for values in (cu_q, cu_k, tile_seq, tile_start)
    )


def _forward_launch(dtype: torch.dtype, hq: int, hkv: int, d: int, causal: bool) -> dict:
    """The compile-time arguments (and launch options) of both forward kernels: the packed one and
    the paged one take the same tiles and arithmetic from here, which is what gives a query the
    same bits in either. Not to be modified: kept per arguments (a decode step asks once a layer)."""
    return _launch_constants(dtype, hq, hkv, d, causal, interpreting())


@functools.lru_cache(maxsize=64)
def _launch_constants(dtype: torch.dtype, hq: int, hkv: int, d: int, causal: bool, interpreted: bool) -> dict:
    bm, bn = ATTENTION_INTERPRETED_TILES if interpreted else TILES[dtype][:2]
    extra = {} if interpreted else {"num_warps": TILES[dtype][2], "num_stages": TILES[dtype][3]}
    return dict(
        HQ=hq,
        GROUP=hq // hkv,
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        CAUSAL=causal,
        IEEE=dtype == torch.float32 or interpreted,
        UPCAST_DOT=interpreted,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **extra,
    )


def _forward(q, k, v, cu_q: list[int], cu_k: list[int], causal: bool, scale: float):
    tq, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((tq, hq), dtype=torch.float32, device=q.device)
    interpreted = interpreting()
    launch = _launch_constants(q.dtype, hq, k.shape[1], d, causal, interpreted)
    tables = _tables(q.device, launch["BLOCK_M"], tuple(cu_q), tuple(cu_k))
    if tables is None:
        return out, lse
    # launched from C++ where a kernel for this specialization is kept (native_launch); torch.compile
    # traces Triton launches, not the extension's
    planned = not interpreted and q.is_cuda and not torch.compiler.is_compiling()
    tensors = [q, k, v, out, lse, *tables]
    block = (launch["BLOCK_M"], launch["BLOCK_N"])
    if planned:
        served = native_launch.attention_forward(tensors, scale, block, causal) is not None
        dispatch.ran(FORWARD_KERNELS, "triton+cpp_launch" if served else "triton")
        if served:
            return out, lse
    grid = (tables[2].shape[0], hq)
    compiled = _attention_fwd_kernel[grid](q, k, v, out, lse, *tables, float(scale), **launch)
    if planned:
        native_launch.remember_attention_forward(_attention_fwd_kernel, compiled, tensors, scale, block, causal, grid)
    return out, lse


def _backward(
    q,
    k,
    v,
    out,
    lse,
    grad_out,
    cu_q: list[int],
    cu_k: list[int],
    causal: bool,
    scale: float,
    tiles: Optional[tuple[tuple[int, int, int, int], tuple[int, int, int, int]]] = None,
):
    """(dq, dk, dv) in q's dtype: the dq pass over query tiles (it also writes delta), then the
    dk/dv pass over key tiles, which reads delta. ``tiles`` replaces the dtype's entry of
    :data:`~rl_kernel_core.triton.tuning.BWD_TILES` (compiled launches only; the tile sweep of
    ``benchmarks/bench_attention.py``)."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    interpreted = interpreting()
    grad_out = grad_out.contiguous()
    passes: tuple[tuple[int, int, Optional[int], Optional[int]], ...] = (
        ((*ATTENTION_INTERPRETED_TILES, None, None),) * 2 if interpreted else tiles or BWD_TILES[q.dtype]
    )
    for dkdv, (bm, bn, warps, stages) in zip((False, True), passes):
        # A pass's tile table runs over the rows its programs hold: queries, or keys for dk/dv.
        cu_tiled, cu_other = (cu_k, cu_q) if dkdv else (cu_q, cu_k)
        tables = _tables(q.device, bn if dkdv else bm, tuple(cu_tiled), tuple(cu_other))
        if tables is None:  # no rows to hold
            continue
        cu_q_t, cu_k_t = (tables[1], tables[0]) if dkdv else tables[:2]
        extra = {} if interpreted else {"num_warps": warps, "num_stages": stages}
        _attention_bwd_kernel[(tables[2].shape[0], hkv if dkdv else hq)](
            q,
            k,
            v,
            out,
            grad_out,
            lse,
            delta,
            dq,
            dk,
            dv,
            cu_q_t,
            cu_k_t,
            tables[2],
            tables[3],
            float(scale),
            HQ=hq,
            GROUP=hq // hkv,
            D=d,
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            CAUSAL=causal,
            IEEE=q.dtype == torch.float32 or interpreted,
            UPCAST_DOT=interpreted,
            BLOCK_M=bm,
            BLOCK_N=bn,
            DKDV=dkdv,
            **extra,
        )
    return dq, dk, dv


def paged_forward(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: Optional[int],
    causal: bool,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`rl_kernel_core.batch_invariant_mode.api_attention.paged_attention` (arguments checked there) on the forward's
    tiles and arithmetic: writes ``out`` and returns it. One launch, no host read: a program per
    possible query tile and group of ``PACK`` query heads (the GQA group, where it fits a tile),
    ``cdiv(T, BLOCK_M // PACK) + B`` tiles (``T`` query rows, ``B`` sequences), or ``B *
    cdiv(max_query_len, BLOCK_M // PACK)`` where that is fewer."""
    hq = q.shape[1]
    launch = _forward_launch(q.dtype, hq, kv_cache.shape[1], q.shape[2], causal)
    pack = launch["GROUP"] if launch["GROUP"] <= launch["BLOCK_M"] else 1
    per_tile = launch["BLOCK_M"] // pack
    num_seqs = seq_lens.shape[0]
    tiles = triton.cdiv(q.shape[0], per_tile) + num_seqs
    if max_query_len is not None:
        tiles = min(tiles, num_seqs * triton.cdiv(max_query_len, per_tile))
    if num_seqs == 0 or tiles == 0:
        return out
    _paged_attention_fwd_kernel[(tiles * (hq // pack),)](
        q,
        kv_cache,
        out,
        cu_q,
        seq_lens,
        block_table,
        num_seqs,
        float(scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        CACHE_BLOCK=kv_cache.shape[2],
        BLOCK_S=triton.next_power_of_2(num_seqs + 1),
        PACK=pack,
        **launch,
    )
    return out


def paged_write(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """:func:`rl_kernel_core.batch_invariant_mode.api_attention.write_paged_kv` (arguments checked there): one launch over
    ``slot_mapping``'s tokens and the KV heads, no host read."""
    n, hkv, d = slot_mapping.shape[0], kv_cache.shape[1], key.shape[2]
    if n == 0:
        return
    _paged_write_kernel[(n, hkv)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        CACHE_BLOCK=kv_cache.shape[2],
    )


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale):
        out, lse = _forward(q, k, v, cu_q, cu_k, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (cu_q, cu_k, causal, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, grad_out, *ctx.args)
        return dq, dk, dv, None, None, None, None


def _supports(q: torch.Tensor, *args, **kwargs) -> Optional[str]:
    if q.dtype == torch.float64:
        return "the triton kernel accumulates in fp32; fp64 inputs need the torch backend"
    if q.shape[2] > 256:
        return f"head_dim D={q.shape[2]} exceeds the kernel's limit of 256"
    return None


@dispatch.register("varlen_attention", "triton", supports=_supports, kernels=FORWARD_KERNELS)
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` contiguous, offsets as Python lists -> (out ``[Tq, Hq, D]``
    in q's dtype, lse ``[Tq, Hq]`` fp32)."""
    if records_graph(q, k, v):
        return _VarlenAttention.apply(q, k, v, cu_q, cu_k, causal, scale)
    return _forward(q, k, v, cu_q, cu_k, causal, scale)
