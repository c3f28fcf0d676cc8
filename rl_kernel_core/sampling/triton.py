"""Triton kernels for ``sample``: seeded Gumbel-max over the filtered set, without sorting the vocab.

The row is read in blocks of ``BLOCK`` logits, the tile of ``logprob_from_logits``' forward (4096
at the serving vocab). The two passes over the logits launch one program per (row, block), so a
batch of 128 rows fills every SM many times over; the per-row stages between and after them read
only per-block summaries. Every per-block value is a function of its block alone and every merge
runs in block order, takes a max/min or adds integers, so a row's result depends on nothing but
the row. Keys: ``key(z)`` is the order-preserving int32 image of an fp32 value. A token is *live*
when it is finite and survives min-p. Stages, one kernel each:

1. Block scan (``_block_scan_kernel``, per block): for ``z = fp32(logits) * inv_temp``, the block
   max ``M_b`` and the keys of the maxima of ``GROUPS`` strided groups of the block.
2. Row plan (``_row_plan_kernel``, per row): ``m = max M_b``; the row's parameters; the min-p
   floor ``z >= m + log(min_p)``; and the *cut*, the largest key ``T`` with at least ``target``
   group maxima ``>= T`` (a bitwise search), so at least ``target`` finite tokens have key ``>= T``
   and the live tokens at or above the cut form a complete set (every live token at least as large
   as its smallest member). ``target`` is ``k`` for top-k and ``CANDIDATES / 2`` for top-p alone.
3. Block gather (``_block_gather_kernel``, per block, with the forward's tile and warps): the block
   term ``E_b = sum exp(z - r_b)`` of the forward's online log-sum-exp, ``r_b`` the running max
   after block ``b``; then, by the row's plan, either the live tokens at or above the cut appended
   to the row's candidate list as ``key << 32 | index`` (and, for top-p alone, the block's live
   mass ``sum exp(z - m)``), or, for rows without top-k/top-p, the block's best Gumbel score and
   its lowest index.
4. Finish (``_finish_kernel``, per row): ``lse`` by the forward's recurrence ``s = s * exp(m - r_b)
   + E_b`` in block order, so ``logprob = z[token] - lse`` has the bits of ``logprob_from_logits``.
   Rows without top-k/top-p take the best block score. Otherwise each of the (at most
   ``CANDIDATES``) candidates is compared with all the others: ``n``, the number of strictly larger
   candidates, and ``G``, their mass, with masses ``exp(z - m)`` (fp64) held as integer multiples
   of ``2**-52`` so that sums do not depend on the order the gather appended them in. A candidate
   survives top-k when ``n < k`` (ties at the k-th survive) and top-p when ``G < top_p * (mass of
   the top-k survivors, or of all live tokens)``, which is the reference's sorted-prefix rule with
   ties at its last value kept. Top-p alone is exact there when the candidates hold at least that
   mass. The draw: ``argmax z_i + g_i`` over the survivors, lowest index among ties.
5. Exact path (``_exact_kernel``, per row; only rows the candidates could not settle: more than
   ``CANDIDATES`` of them, from ties at the top-k threshold or ``k`` above the capacity, or a top-p
   set beyond them): the top-k threshold by a search over keys by live count, then the top-p
   threshold by a search over keys by live mass. A pass over the row measures both at ``PIVOTS``
   evenly spaced keys and keeps the interval holding the crossing; once it holds at most
   ``CANDIDATES`` tokens they are gathered and the search ends on them. Then the draw over the row.

The noise ``g_i = -log(-log u_i)`` is fp32, ``u_i`` from the counter-based hash of
:mod:`rl_kernel_core.sampling.reference` keyed on ``(seed, position, i)``. Greedy rows
(temperature 0) take ``argmax logits`` and the log-prob at temperature 1.
"""

from __future__ import annotations

import math
import struct
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.logprob.triton import _block_v
from rl_kernel_core.triton._jit import helper_jit, launch_time_jit
from rl_kernel_core.triton.tuning import (
    EXACT_TILE,
    FWD_TILE,
    GATHER_PART,
    RANK_TILE,
    SAMPLING_PLAN_WARPS,
    SAMPLING_SCAN_WARPS,
)

CANDIDATES = 1024
"""Most candidates the fast path gathers and ranks per row (a power of two); small vocabularies use
fewer (:func:`candidates`)."""
GROUPS = 32
"""Strided groups per block whose maxima place the candidate cut: over ordinary logits two of the
top-k rarely share a group, so the cut keeps little more than ``k`` tokens (and their ties)."""
_KEY_MIN = tl.constexpr(-(2**31))
_PACKED_MIN = tl.constexpr(-(2**63))  # below every packed candidate
_ABSENT, _SCALAR, _ROWS = 0, 1, 2  # how a parameter reaches the kernel
_TINY_TOP_P = 1e-300  # below every max probability: the same kept set as any smaller top_p
# a row's plan: _PLAN int64 fields written by _row_plan_kernel
_PLAN = tl.constexpr(9)
_P_MODE, _P_FLAGS, _P_FLOOR, _P_CUT, _P_K, _P_TOP_P, _P_STATE, _P_INV_TEMP, _P_M = (tl.constexpr(i) for i in range(9))
_DRAW_ROW, _GATHER, _EXACT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # plan modes
_SAMPLING, _HAS_K, _HAS_P = tl.constexpr(1), tl.constexpr(2), tl.constexpr(4)  # plan flags


@helper_jit
def _key(z):
    """Order-preserving int32 image of fp32 ``z`` (``a <= b`` iff ``key(a) <= key(b)`` for non-NaN; -0 < +0)."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@helper_jit
def _value(key):
    """The fp32 whose :func:`_key` is ``key`` (int32)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@helper_jit
def _load_z(base, stride_lv, cols, V, inv_temp):
    return tl.load(base + cols * stride_lv, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_temp


@helper_jit
def _mix64(z):
    """SplitMix64's finaliser on uint64."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@helper_jit
def _row_state(seed, pos):
    """A row's hash state from its int64 ``seed`` and ``pos`` (uint64 arithmetic): the seed, then
    the position, absorbed through SplitMix64's finaliser, as
    :func:`rl_kernel_core.sampling.reference.row_state`."""
    start = _mix64(seed.to(tl.uint64, bitcast=True) + 0xD1B54A32D192ED03)
    return _mix64(start + pos.to(tl.uint64, bitcast=True) * 0xDB4F0B9175AE2165)


@helper_jit
def _uniform(state, idx):
    """``u`` in (0, 1), fp32: SplitMix64 of ``state + (idx + 1) * golden``, its top 23 bits, centred."""
    z = _mix64(state + (idx.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    return ((z >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23


@helper_jit
def _gumbel_score(z, state, cols):
    """``z + g`` with ``g = -log(-log u)`` the keyed noise of token ``cols``."""
    return z - tl.log(-tl.log(_uniform(state, cols)))


@helper_jit
def _temperature(temp_ptr, temp_val, inv_temp_val, row, temp_mode):
    """``(sampling, inv_temp)`` of a row: temperature != 0, and fp32(1 / T) with the division in
    fp64 (1 for greedy rows); a scalar temperature arrives with its factor formed on the host."""
    if temp_mode == 2:
        t = tl.load(temp_ptr + row)  # fp64
        sampling = t != 0.0
        inv_temp = tl.where(sampling, (1.0 / t).to(tl.float32), 1.0)
    else:
        sampling = tl.cast(temp_val, tl.float32) != 0.0
        inv_temp = tl.cast(inv_temp_val, tl.float32)
    return sampling, inv_temp


@helper_jit
def _f32_field(plan, field):
    """An fp32 stored in a plan field by its bits."""
    return tl.load(plan + field).to(tl.int32).to(tl.float32, bitcast=True)


@helper_jit
def _kth_largest(keys, target):
    """The largest int32 ``t`` with at least ``target`` of ``keys`` at or above it (``KEY_MIN``
    when fewer than ``target`` keys exceed ``KEY_MIN``): a bitwise search on ``key - KEY_MIN``."""
    u = (keys ^ _KEY_MIN).to(tl.uint32, bitcast=True)
    t = tl.zeros([], dtype=tl.uint32)
    for i in tl.static_range(32):
        trial = t | (tl.full([], 1, tl.uint32) << (31 - i))
        n = tl.sum((u >= trial).to(tl.int32), axis=0)
        t = tl.where(n >= target, trial, t)
    return t.to(tl.int32, bitcast=True) ^ _KEY_MIN


@helper_jit
def _fixed_mass(key, m):
    """``exp(z - m)`` (fp64, at most 1 for ``z <= m``) of the fp32 with key ``key``, as an int64
    count of ``2**-52``: sums of these are exact, so they do not depend on the order of terms."""
    return (tl.exp(_value(key).to(tl.float64) - m.to(tl.float64)) * 4503599627370496.0).to(tl.int64)


@helper_jit
def _rank_and_draw(
    scratch, count, m, k, top_p, has_k, has_p, live_mass, state, V, SIZE: tl.constexpr, PAIR_TILE: tl.constexpr
):
    """Stage 4 on the ``count <= SIZE`` candidates at ``scratch`` (in any order): ``(token, exact)``;
    ``exact`` is false when top-p alone needs more mass than the candidates hold (then ``token`` is
    meaningless). A step compares the ``SIZE`` candidates with ``PAIR_TILE // SIZE`` others."""
    pos = tl.arange(0, SIZE)
    valid = pos < count
    packed = tl.load(scratch + pos, mask=valid, other=_PACKED_MIN)
    ckey = (packed >> 32).to(tl.int32)
    cidx = packed & 0x7FFFFFFF  # V < 2**31
    w = tl.where(valid, _fixed_mass(ckey, m), 0)
    tl.store(scratch + SIZE + pos, w, mask=valid)  # beside the candidates, for the steps below
    tl.debug_barrier()
    # per candidate: how many candidates are strictly larger, and their mass
    n_above = tl.zeros([SIZE], dtype=tl.int32)
    mass_above = tl.zeros([SIZE], dtype=tl.int64)
    jj = tl.arange(0, PAIR_TILE // SIZE)
    for j0 in range(0, count, PAIR_TILE // SIZE):
        other = j0 + jj < count
        okey = (tl.load(scratch + j0 + jj, mask=other, other=_PACKED_MIN) >> 32).to(tl.int32)
        larger = okey[None, :] > ckey[:, None]  # KEY_MIN past the end: below every candidate
        n_above += tl.sum(larger.to(tl.int32), axis=1)
        other_mass = tl.load(scratch + SIZE + j0 + jj, mask=other, other=0)
        mass_above += tl.sum(tl.where(larger, other_mass[None, :], 0), axis=1)
    # a token survives top-k when fewer than k are larger (ties at the k-th all survive),
    # and top-p when the mass of the larger survivors is below top_p of the survivors' mass
    keep = valid
    if has_k:
        keep = keep & (n_above < k)
    exact = True
    if has_p:
        cand_mass = tl.sum(tl.where(keep, w, 0), axis=0).to(tl.float64)
        limit = top_p * tl.where(has_k, cand_mass, live_mass * 4503599627370496.0)
        keep = keep & (mass_above.to(tl.float64) < limit)
        exact = has_k | (cand_mass >= limit)
    score = tl.where(keep, _gumbel_score(_value(ckey), state, cidx), -float("inf"))
    best = tl.max(score, axis=0)
    token = tl.min(tl.where(keep & (score == best), cidx, V), axis=0)
    return token, exact


@helper_jit
def _threshold_search(
    base,
    stride_lv,
    V,
    inv_temp,
    m,
    lo,
    goal,
    band,
    BY_COUNT: tl.constexpr,
    PIVOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
):
    """The largest key ``K >= lo`` with ``W(key >= K) >= target`` (``lo`` when ``W(key >= lo) <
    target``) over the finite tokens with key ``>= lo``: ``W`` their number and ``target = goal``
    (``BY_COUNT``), or ``W`` their fp64 mass ``exp(z - m)`` and ``target = goal * W(key >= lo)``,
    which the first pass measures at its lowest pivot.

    Each pass over the row measures ``W`` and the token count at ``PIVOTS`` evenly spaced keys of
    ``[lo, hi)`` (``BLOCK x PIVOTS`` tiles accumulated elementwise, reduced once, each block loaded
    one step ahead of its use) and keeps the interval between the last pivot that reaches the
    target and the next. Once that interval holds at most ``CAP`` tokens (or one key), its tokens
    are written to ``band`` (keys, then fp64 masses ``CAP`` further) and the search ends bitwise
    on them: ``W(key >= K) = W(key >= hi) + W(band keys >= K)`` for ``K`` in ``[lo, hi)``."""
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, PIVOTS)
    floor = lo
    lo = floor.to(tl.int64)
    hi = _key(m).to(tl.int64) + 1  # W(key >= hi) = 0 < target
    target = goal
    if BY_COUNT:
        w_hi = tl.zeros([], dtype=tl.int32)
    else:
        w_hi = tl.zeros([], dtype=tl.float64)
    n_band = tl.full([], CAP + 1, tl.int32)
    first = True
    while (n_band > CAP) & (hi - lo > 1):
        piv = (lo + ((hi - lo) * j.to(tl.int64)) // (PIVOTS - 1)).to(tl.int32)  # piv[0] = lo, piv[-1] = hi
        n_ge = tl.zeros([BLOCK, PIVOTS], dtype=tl.int32)
        w_ge = tl.zeros([BLOCK, PIVOTS], dtype=tl.float64)
        z_next = _load_z(base, stride_lv, offs, V, inv_temp)
        for start in range(0, V, BLOCK):
            z = z_next
            z_next = _load_z(base, stride_lv, start + BLOCK + offs, V, inv_temp)
            key = _key(z)
            ge = ((z > -float("inf")) & (key >= floor))[:, None] & (key[:, None] >= piv[None, :])
            n_ge += ge.to(tl.int32)
            if not BY_COUNT:
                w_ge += tl.where(ge, tl.exp(z - m).to(tl.float64)[:, None], 0.0)
        n = tl.sum(n_ge, axis=0)
        if BY_COUNT:
            w = n
        else:
            w = tl.sum(w_ge, axis=0)
            target = tl.where(first, goal * tl.sum(tl.where(j == 0, w, 0.0), axis=0), target)
        first = False
        # W falls as the pivot rises (sums of subsets in one order), so the pivots reaching the
        # target are a prefix; none (W(key >= lo) < target) or all (a zero target) ends the search
        n_ok = tl.sum((w >= target).to(tl.int32), axis=0)
        stop = (n_ok == 0) | (n_ok == PIVOTS)
        at_lo = j == n_ok - 1
        at_hi = j == n_ok
        n_band = tl.sum(tl.where(at_lo, n, 0), axis=0) - tl.sum(tl.where(at_hi, n, 0), axis=0)
        w_hi = tl.sum(tl.where(at_hi, w, 0), axis=0)
        hi = tl.where(stop, lo + 1, tl.sum(tl.where(at_hi, piv, 0), axis=0).to(tl.int64))
        lo = tl.where(stop, lo, tl.sum(tl.where(at_lo, piv, 0), axis=0).to(tl.int64))
    if hi - lo > 1:
        n_band = tl.zeros([], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            z = _load_z(base, stride_lv, cols, V, inv_temp)
            key = _key(z)
            sel = ((z > -float("inf")) & (key >= floor) & (key >= lo) & (key < hi)).to(tl.int32)
            slot = n_band + tl.cumsum(sel, axis=0) - 1
            tl.store(band + slot, key.to(tl.int64), mask=sel > 0)
            if not BY_COUNT:
                tl.store(band + CAP + slot, tl.exp(z - m).to(tl.float64).to(tl.int64, bitcast=True), mask=sel > 0)
            n_band += tl.sum(sel, axis=0)
        tl.debug_barrier()  # the band written by every thread is read by every thread
        pos = tl.arange(0, CAP)
        valid = pos < n_band
        u = tl.load(band + pos, mask=valid, other=0) - lo  # in [0, hi - lo)
        if BY_COUNT:
            bw = valid.to(tl.int32)
        else:
            bw = tl.where(valid, tl.load(band + CAP + pos, mask=valid, other=0).to(tl.float64, bitcast=True), 0.0)
        t = tl.zeros([], dtype=tl.int64)
        for i in tl.static_range(32):
            trial = t | (tl.full([], 1, tl.int64) << (31 - i))
            t = tl.where(w_hi + tl.sum(tl.where(valid & (u >= trial), bw, 0), axis=0) >= target, trial, t)
        lo = lo + t
    return lo.to(tl.int32)


@helper_jit
def _draw_row(base, stride_lv, V, inv_temp, floor, state, BLOCK: tl.constexpr):
    """``argmax z_i + g_i`` over the finite tokens with key ``>= floor`` (lowest index among ties;
    0 when there are none), keeping the best score of each lane across the row's blocks and loading
    each block one step ahead of its use."""
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -float("inf"), tl.float32)
    arg = tl.full([BLOCK], V, tl.int32)
    z_next = _load_z(base, stride_lv, offs, V, inv_temp)
    for start in range(0, V, BLOCK):
        cols = start + offs
        z = z_next
        z_next = _load_z(base, stride_lv, cols + BLOCK, V, inv_temp)
        keep = (z > -float("inf")) & (_key(z) >= floor)
        if tl.max(keep.to(tl.int32), axis=0) > 0:  # the hash only where a token is kept
            score = tl.where(keep, _gumbel_score(z, state, cols), -float("inf"))
            better = score > best  # an equal score later in the lane has a larger index
            best = tl.where(better, score, best)
            arg = tl.where(better, cols, arg)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, arg, V), axis=0)
    return tl.where(token < V, token, 0).to(tl.int64)


@launch_time_jit(do_not_specialize=["temp_mode"])
def _block_scan_kernel(
    logits_ptr,
    stride_ln,
    stride_lv,
    temp_ptr,
    temp_val,
    inv_temp_val,
    block_max_ptr,
    group_key_ptr,
    V,
    n_blocks,
    temp_mode,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """Stage 1 for one block of one row: its max and the keys of its strided group maxima
    (``KEY_MIN`` for a group of ``-inf``)."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    _sampling, inv_temp = _temperature(temp_ptr, temp_val, inv_temp_val, row, temp_mode)
    z = _load_z(logits_ptr + row * stride_ln, stride_lv, blk * BLOCK + tl.arange(0, BLOCK), V, inv_temp)
    at = row * n_blocks + blk
    tl.store(block_max_ptr + at, tl.max(z, axis=0))
    g = tl.max(tl.reshape(z, [BLOCK // GROUPS, GROUPS]), axis=0)
    tl.store(group_key_ptr + at * GROUPS + tl.arange(0, GROUPS), tl.where(g > -float("inf"), _key(g), _KEY_MIN))


@launch_time_jit(
    do_not_specialize=[
        "pos_val",
        "top_k_val",
        "top_p_bits",
        "temp_mode",
        "pos_mode",
        "top_k_mode",
        "top_p_mode",
        "min_p_mode",
    ]
)
def _row_plan_kernel(
    temp_ptr,
    temp_val,
    inv_temp_val,
    seeds_ptr,
    pos_ptr,
    pos_val,
    top_k_ptr,
    top_k_val,
    top_p_ptr,
    top_p_bits,
    log_min_p_ptr,
    log_min_p_val,
    block_max_ptr,
    group_key_ptr,
    plan_ptr,
    count_ptr,
    V,
    n_blocks,
    n_groups,
    temp_mode,
    pos_mode,
    top_k_mode,
    top_p_mode,
    min_p_mode,
    CAP: tl.constexpr,
    BLOCKS: tl.constexpr,
    GROUP_KEYS: tl.constexpr,
):
    """Stage 2 for one row: its plan (mode, flags, floor, cut, parameters, ``m``); zeroes its
    candidate count."""
    row = tl.program_id(0).to(tl.int64)
    sampling, inv_temp = _temperature(temp_ptr, temp_val, inv_temp_val, row, temp_mode)
    blocks = tl.arange(0, BLOCKS)
    m = tl.max(tl.load(block_max_ptr + row * n_blocks + blocks, mask=blocks < n_blocks, other=-float("inf")), axis=0)

    # each parameter: absent (mode 0), one number for the batch (1) or a [B] tensor (2); the modes
    # are runtime values, so one compiled kernel serves every combination
    if min_p_mode == 2:
        log_min_p = tl.load(log_min_p_ptr + row)
    else:
        log_min_p = tl.cast(log_min_p_val, tl.float32)
    floor = tl.where(sampling & (min_p_mode != 0), _key(m + log_min_p), _KEY_MIN)
    if top_k_mode == 2:
        k = tl.load(top_k_ptr + row).to(tl.int32)
    else:
        k = tl.cast(top_k_val, tl.int32)
    has_k = sampling & (top_k_mode != 0) & (k < V)
    if top_p_mode == 2:
        top_p = tl.load(top_p_ptr + row)
    else:
        top_p = tl.cast(top_p_bits, tl.int64).to(tl.float64, bitcast=True)
    has_p = sampling & (top_p_mode != 0) & (top_p < 1.0)
    if pos_mode == 2:
        pos = tl.load(pos_ptr + row)
    else:
        pos = tl.cast(pos_val, tl.int64)
    state = _row_state(tl.load(seeds_ptr + row), pos)

    mode = tl.full([], _DRAW_ROW, tl.int32)
    cut = tl.full([], _KEY_MIN, tl.int32)
    if has_k | has_p:
        if V > CAP:  # otherwise every live token is a candidate
            g = tl.arange(0, GROUP_KEYS)
            keys = tl.load(group_key_ptr + row * n_groups + g, mask=g < n_groups, other=_KEY_MIN)
            cut = _kth_largest(keys, tl.where(has_k, k, CAP // 2))
        mode = tl.where(has_k & (k > CAP), _EXACT, _GATHER)
    flags = sampling.to(tl.int64) * _SAMPLING + has_k.to(tl.int64) * _HAS_K + has_p.to(tl.int64) * _HAS_P
    plan = plan_ptr + row * _PLAN
    tl.store(plan + _P_MODE, mode.to(tl.int64))
    tl.store(plan + _P_FLAGS, flags)
    tl.store(plan + _P_FLOOR, floor.to(tl.int64))
    tl.store(plan + _P_CUT, tl.maximum(cut, floor).to(tl.int64))
    tl.store(plan + _P_K, k.to(tl.int64))
    tl.store(plan + _P_TOP_P, top_p.to(tl.int64, bitcast=True))
    tl.store(plan + _P_STATE, state.to(tl.int64, bitcast=True))
    tl.store(plan + _P_INV_TEMP, inv_temp.to(tl.int32, bitcast=True).to(tl.int64))
    tl.store(plan + _P_M, m.to(tl.int32, bitcast=True).to(tl.int64))
    tl.store(count_ptr + row, 0)


@launch_time_jit
def _block_gather_kernel(
    logits_ptr,
    stride_ln,
    stride_lv,
    block_max_ptr,
    plan_ptr,
    block_sum_ptr,
    block_mass_ptr,
    block_best_ptr,
    block_arg_ptr,
    count_ptr,
    scratch_ptr,
    V,
    n_blocks,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCKS: tl.constexpr,
    CAP: tl.constexpr,
):
    """Stage 3 for one block of one row: its log-sum-exp term over the whole block
    (``logprob_from_logits``' tile and warps), then, reading the block again in ``SUB``-wide parts
    (cached), its candidates (and, for top-p alone, its live mass) or its best Gumbel score by the
    row's plan."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    base = logits_ptr + row * stride_ln
    plan = plan_ptr + row * _PLAN
    blocks = tl.arange(0, BLOCKS)
    block_max = tl.load(block_max_ptr + row * n_blocks + blocks, mask=blocks <= blk, other=-float("inf"))
    inv_temp = _f32_field(plan, _P_INV_TEMP)
    z = _load_z(base, stride_lv, blk * BLOCK + tl.arange(0, BLOCK), V, inv_temp)
    mode = tl.load(plan + _P_MODE)
    flags = tl.load(plan + _P_FLAGS)
    floor = tl.load(plan + _P_FLOOR).to(tl.int32)
    at = row * n_blocks + blk
    # the forward's term for this block: exp relative to the running max after it
    r = tl.max(block_max, axis=0)
    tl.store(block_sum_ptr + at, tl.sum(tl.exp(z - tl.where(r == -float("inf"), 0.0, r)), axis=0))
    offs = tl.arange(0, SUB)
    if mode == _GATHER:
        cut = tl.load(plan + _P_CUT).to(tl.int32)
        mass_only_p = flags == _SAMPLING + _HAS_P  # top-p alone: its limit is a share of the live mass
        m = _f32_field(plan, _P_M)
        mass = 0.0
        # a block whose max is below the cut holds no candidate
        if mass_only_p | (_key(tl.max(tl.where(blocks == blk, block_max, -float("inf")), axis=0)) >= cut):
            for part in range(0, BLOCK, SUB):
                cols = blk * BLOCK + part + offs
                zp = _load_z(base, stride_lv, cols, V, inv_temp)
                key = _key(zp)
                live = (zp > -float("inf")) & (key >= floor)
                sel = (live & (key >= cut)).to(tl.int32)
                n = tl.sum(sel, axis=0)
                if n > 0:
                    slot = tl.atomic_add(count_ptr + row, n, sem="relaxed") + tl.cumsum(sel, axis=0) - 1
                    tl.store(
                        scratch_ptr + row * 2 * CAP + slot,
                        (key.to(tl.int64) << 32) | cols,
                        mask=(sel > 0) & (slot < CAP),
                    )
                if mass_only_p:
                    mass += tl.sum(tl.where(live, tl.exp(zp - m), 0.0), axis=0)
        tl.store(block_mass_ptr + at, mass)
    elif mode == _DRAW_ROW:
        sampling = (flags & _SAMPLING) != 0
        state = tl.load(plan + _P_STATE).to(tl.uint64, bitcast=True)
        best = tl.full([SUB], -float("inf"), tl.float32)
        arg = tl.full([SUB], V, tl.int32)
        for part in range(0, BLOCK, SUB):
            cols = blk * BLOCK + part + offs
            zp = _load_z(base, stride_lv, cols, V, inv_temp)
            live = (zp > -float("inf")) & (_key(zp) >= floor)
            if tl.max(live.to(tl.int32), axis=0) > 0:  # the hash only where a token is live
                score = zp
                if sampling:
                    score = _gumbel_score(zp, state, cols)
                score = tl.where(live, score, -float("inf"))
                better = score > best  # an equal score later in the lane has a larger index
                best = tl.where(better, score, best)
                arg = tl.where(better, cols, arg)
        top = tl.max(best, axis=0)
        tl.store(block_best_ptr + at, top)
        tl.store(block_arg_ptr + at, tl.min(tl.where(best == top, arg, V), axis=0))


@launch_time_jit
def _finish_kernel(
    logits_ptr,
    stride_ln,
    stride_lv,
    block_max_ptr,
    block_sum_ptr,
    block_mass_ptr,
    block_best_ptr,
    block_arg_ptr,
    plan_ptr,
    count_ptr,
    scratch_ptr,
    status_ptr,
    lse_ptr,
    tokens_ptr,
    logprob_ptr,
    V,
    n_blocks,
    CAP: tl.constexpr,
    SMALL: tl.constexpr,
    PAIR_TILE: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Stage 4 for one row: ``lse``; the token and its log-prob, or ``status = 1`` for the exact path."""
    row = tl.program_id(0).to(tl.int64)
    at = row * n_blocks
    # logprob_from_logits' online recurrence, block by block
    m = -float("inf")
    s = 0.0
    for b in range(0, n_blocks):
        m_new = tl.maximum(m, tl.load(block_max_ptr + at + b))
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        s = s * alpha + tl.load(block_sum_ptr + at + b)
        m = m_new
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    plan = plan_ptr + row * _PLAN
    mode = tl.load(plan + _P_MODE)
    token = tl.zeros([], dtype=tl.int64)
    done = 0
    if mode == _DRAW_ROW:
        blocks = tl.arange(0, BLOCKS)
        best = tl.load(block_best_ptr + at + blocks, mask=blocks < n_blocks, other=-float("inf"))
        arg = tl.load(block_arg_ptr + at + blocks, mask=blocks < n_blocks, other=V)
        first = tl.min(tl.where(best == tl.max(best, axis=0), arg, V), axis=0)
        token = tl.where(first < V, first, 0).to(tl.int64)
        done = 1
    elif mode == _GATHER:
        count = tl.load(count_ptr + row)
        if (count > 0) & (count <= CAP):
            flags = tl.load(plan + _P_FLAGS)
            has_k = (flags & _HAS_K) != 0
            has_p = (flags & _HAS_P) != 0
            m_row = _f32_field(plan, _P_M)
            k = tl.load(plan + _P_K).to(tl.int32)
            top_p = tl.load(plan + _P_TOP_P).to(tl.float64, bitcast=True)
            state = tl.load(plan + _P_STATE).to(tl.uint64, bitcast=True)
            live_mass = tl.zeros([], dtype=tl.float64)
            if flags == _SAMPLING + _HAS_P:
                blocks = tl.arange(0, BLOCKS)
                block_mass = tl.load(block_mass_ptr + at + blocks, mask=blocks < n_blocks, other=0.0)
                live_mass = tl.sum(block_mass.to(tl.float64), axis=0)
            scratch = scratch_ptr + row * 2 * CAP
            if count <= SMALL:
                first, exact = _rank_and_draw(
                    scratch, count, m_row, k, top_p, has_k, has_p, live_mass, state, V, SMALL, PAIR_TILE
                )
            else:
                first, exact = _rank_and_draw(
                    scratch, count, m_row, k, top_p, has_k, has_p, live_mass, state, V, CAP, PAIR_TILE
                )
            token = first.to(tl.int64)
            done = exact.to(tl.int32)
    tl.store(status_ptr + row, 1 - done)
    if done != 0:
        z_t = tl.load(logits_ptr + row * stride_ln + token * stride_lv).to(tl.float32) * _f32_field(plan, _P_INV_TEMP)
        tl.store(tokens_ptr + row, token)
        tl.store(logprob_ptr + row, z_t - lse)


@launch_time_jit
def _exact_kernel(
    logits_ptr,
    stride_ln,
    stride_lv,
    plan_ptr,
    status_ptr,
    scratch_ptr,
    lse_ptr,
    tokens_ptr,
    logprob_ptr,
    V,
    CAP: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
    DRAW_BLOCK: tl.constexpr,
):
    """Stage 5 for one row with ``status = 1``: exact thresholds on the whole row, then the draw."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(status_ptr + row) != 0:
        base = logits_ptr + row * stride_ln
        plan = plan_ptr + row * _PLAN
        flags = tl.load(plan + _P_FLAGS)
        inv_temp = _f32_field(plan, _P_INV_TEMP)
        m = _f32_field(plan, _P_M)
        floor = tl.load(plan + _P_FLOOR).to(tl.int32)
        band = scratch_ptr + row * 2 * CAP
        if (flags & _HAS_K) != 0:
            # the cut is at or below the k-th largest live key (or is the floor)
            floor = _threshold_search(
                base,
                stride_lv,
                V,
                inv_temp,
                m,
                tl.load(plan + _P_CUT).to(tl.int32),
                tl.load(plan + _P_K).to(tl.int32),
                band,
                True,
                PIVOTS,
                SEARCH_BLOCK,
                CAP,
            )
        if (flags & _HAS_P) != 0:
            floor = _threshold_search(
                base,
                stride_lv,
                V,
                inv_temp,
                m,
                floor,
                tl.load(plan + _P_TOP_P).to(tl.float64, bitcast=True),
                band,
                False,
                PIVOTS,
                SEARCH_BLOCK,
                CAP,
            )
        token = _draw_row(
            base, stride_lv, V, inv_temp, floor, tl.load(plan + _P_STATE).to(tl.uint64, bitcast=True), DRAW_BLOCK
        )
        z_t = tl.load(base + token * stride_lv).to(tl.float32) * inv_temp
        tl.store(tokens_ptr + row, token)
        tl.store(logprob_ptr + row, z_t - tl.load(lse_ptr + row))


def _supports(logits, temperature, seeds, positions, top_k, top_p, min_p) -> Optional[str]:
    if logits.dtype == torch.float64:
        return "fp64 logits (the kernel computes in fp32; the torch backend keeps fp64 inputs' rounding to fp32 exact)"
    return None


Param = Union[int, float, torch.Tensor, None]


def candidates(vocab: int) -> int:
    """The candidate capacity for a vocabulary: :data:`CANDIDATES`, or an eighth of a small vocabulary
    (at least 16), so the ranking never runs over slots few tokens could fill."""
    return min(CANDIDATES, max(16, triton.next_power_of_2(vocab) // 8))


def _mode(value: Param) -> int:
    return _ABSENT if value is None else (_ROWS if isinstance(value, torch.Tensor) else _SCALAR)


def _fp32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _float_bits(value: float) -> int:
    """The IEEE binary64 bits of ``value`` as an int (a Python float kernel argument becomes fp32)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


@dispatch.register("sample", "triton", supports=_supports)
def sample(
    logits: torch.Tensor,
    temperature: Union[float, torch.Tensor],
    seeds: torch.Tensor,
    positions: Param,
    top_k: Param,
    top_p: Param,
    min_p: Param,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded sampling of ``logits [B, V]`` (fp32/bf16/fp16); see the module docstring and
    :mod:`rl_kernel_core.sampling.api` for the argument contract (numbers or ``[B]`` tensors).
    Returns ``(tokens [B] int64, logprobs [B] fp32)``."""
    b, v = logits.shape
    dev = logits.device
    block = _block_v(v, FWD_TILE[0])
    n_blocks = triton.cdiv(v, block)
    groups = min(GROUPS, block)
    cap = candidates(v)
    filtered = top_k is not None or top_p is not None
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logprobs = torch.empty(b, dtype=torch.float32, device=dev)
    # One allocation per buffer, not views of one: a view's pointer alignment would vary with b, and
    # Triton compiles a kernel per argument alignment, so an unseen batch size would compile again.
    block_max, block_sum, block_mass, block_best = (
        torch.empty((b, n_blocks), dtype=torch.float32, device=dev) for _ in range(4)
    )  # max, lse term, live mass, best
    block_arg = torch.empty((b, n_blocks), dtype=torch.int32, device=dev)
    group_keys = torch.empty((b, n_blocks * groups), dtype=torch.int32, device=dev)
    plan = torch.empty((b, _PLAN.value), dtype=torch.int64, device=dev)
    count, status = (torch.empty(b, dtype=torch.int32, device=dev) for _ in range(2))  # candidates, row status
    lse = torch.empty(b, dtype=torch.float32, device=dev)
    scratch = torch.empty((b if filtered else 1, 2 * cap), dtype=torch.int64, device=dev)  # candidates, then masses
    unused_fp64 = torch.empty(1, dtype=torch.float64, device=dev)  # the pointer of a parameter passed as a number
    if isinstance(temperature, torch.Tensor):
        temp_args = (temperature, 0.0, 1.0)
    else:  # the factor logprob_from_logits multiplies by: fp32(1 / T), the division in double
        temp_args = (unused_fp64, temperature, 1.0 if temperature == 0 else 1.0 / temperature)
    if isinstance(min_p, torch.Tensor):
        log_min_p, log_min_p_val = torch.log(min_p.to(torch.float64)).to(torch.float32), 0.0
    else:  # fp32(log(fp32(min_p))), the per-row path's value
        log_min_p, log_min_p_val = logprobs, (float("-inf") if not min_p else _fp32(math.log(_fp32(min_p))))
    # a number as an int64 kernel argument that both the compiler and the interpreter pass unchanged
    top_p_bits = _float_bits(1.0 if top_p is None or isinstance(top_p, torch.Tensor) else max(top_p, _TINY_TOP_P))
    blocks = triton.next_power_of_2(n_blocks)
    lv = (logits, logits.stride(0), logits.stride(1))
    _block_scan_kernel[(b, n_blocks)](
        *lv,
        *temp_args,
        block_max,
        group_keys,
        v,
        n_blocks,
        _mode(temperature),
        BLOCK=block,
        GROUPS=groups,
        num_warps=SAMPLING_SCAN_WARPS,
    )
    _row_plan_kernel[(b,)](
        *temp_args,
        seeds,
        positions if isinstance(positions, torch.Tensor) else tokens,
        positions if isinstance(positions, int) else 0,
        top_k if isinstance(top_k, torch.Tensor) else tokens,
        top_k if isinstance(top_k, int) else 0,
        top_p if isinstance(top_p, torch.Tensor) else unused_fp64,
        top_p_bits,
        log_min_p,
        log_min_p_val,
        block_max,
        group_keys,
        plan,
        count,
        v,
        n_blocks,
        n_blocks * groups,
        _mode(temperature),
        _mode(positions),
        _mode(top_k),
        _mode(top_p),
        _mode(min_p),
        CAP=cap,
        BLOCKS=blocks,
        GROUP_KEYS=triton.next_power_of_2(n_blocks * groups),
        num_warps=SAMPLING_PLAN_WARPS,
    )
    _block_gather_kernel[(b, n_blocks)](
        *lv,
        block_max,
        plan,
        block_sum,
        block_mass,
        block_best,
        block_arg,
        count,
        scratch,
        v,
        n_blocks,
        BLOCK=block,
        SUB=min(GATHER_PART, block),
        BLOCKS=blocks,
        CAP=cap,
        num_warps=FWD_TILE[1],
    )
    small, pair_tile, rank_warps = RANK_TILE
    _finish_kernel[(b,)](
        *lv,
        block_max,
        block_sum,
        block_mass,
        block_best,
        block_arg,
        plan,
        count,
        scratch,
        status,
        lse,
        tokens,
        logprobs,
        v,
        n_blocks,
        CAP=cap,
        SMALL=min(small, cap),
        PAIR_TILE=pair_tile,
        BLOCKS=blocks,
        num_warps=rank_warps,
    )
    if filtered:
        search_block, pivots, draw_block, warps = EXACT_TILE
        _exact_kernel[(b,)](
            *lv,
            plan,
            status,
            scratch,
            lse,
            tokens,
            logprobs,
            v,
            CAP=cap,
            SEARCH_BLOCK=min(search_block, block),
            PIVOTS=pivots,
            DRAW_BLOCK=min(draw_block, block),
            num_warps=warps,
        )
    return tokens, logprobs
