"""Triton kernels for ``sample``: seeded Gumbel-max over the filtered set, without sorting the vocab.

One program per row in each of two kernels; every pass reads the row in fixed-size blocks in a
fixed order, so a row's result depends on nothing but the row. Keys: ``key(z)`` is the
order-preserving int32 image of an fp32 value and ``d = 0x7FFFFFFF - key`` (uint32) its descending
image, so the largest values have the smallest ``d``. A token is *live* when it is finite and
survives min-p.

1. Statistics (``_stats_kernel``): ``m = max z`` and ``lse = m + log sum exp(z - m)`` for
   ``z = fp32(logits) * inv_temp``, by
   :func:`rl_kernel_core.triton.logprob_from_logits.online_softmax_stats` with the forward's tile
   and warps, so ``logprob = z[token] - lse`` has the bits of ``logprob_from_logits`` on this
   backend. The remaining steps (``_sample_kernel``) use larger blocks and more warps.
2. Min-p: live tokens have ``z >= m + log(min_p)``.
3. Top-k / top-p candidates by radix select on ``d``: a pass builds a histogram of one digit
   (11, 11, then 10 bits from the top) of the live tokens inside the current bucket, and the next
   pass descends into the bucket holding the target rank. It stops as soon as the tokens above and
   inside that bucket number at most ``CANDIDATES`` (top-k: the bucket holding the k-th largest;
   top-p alone: the buckets above the one holding rank ``CANDIDATES + 1``). For top-k 50 over
   ordinary logits one pass suffices: a bucket of the first digit is a quarter of a binade.
4. Candidate pass: the live tokens above the cut (a complete set: every live token at least as
   large as its smallest member) are written to a per-row scratch row as ``key << 32 | index``.
   Each candidate is compared with all the others: ``n`` larger candidates and their fp64 mass
   ``G`` (masses ``exp(z - m)``). It survives top-k when ``n < k`` (ties at the k-th survive) and
   top-p when ``G < top_p * (mass of the top-k survivors, or of all live tokens)``, which is the
   reference's sorted-prefix rule with ties at its last value kept. Top-p alone is exact there
   when the candidates hold at least that mass. The draw runs on the candidates:
   ``argmax z_i + g_i`` over the survivors, lowest index among ties.
5. Otherwise (greedy rows, no top-k/top-p, more than ``CANDIDATES`` tokens tied at the top-k
   threshold, a top-p set beyond the candidates): the radix search leaves the exact top-k
   threshold; top-p takes a search over keys by live mass (each pass tests ``PIVOTS`` evenly
   spaced keys and the nearest token keys around them); a final pass draws over the row.

The noise ``g_i = -log(-log u_i)`` is fp32, ``u_i`` from the counter-based hash of
:mod:`rl_kernel_core.reference.sampling` keyed on ``(seed, position, i)``. Greedy rows
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
from rl_kernel_core.triton._jit import helper_jit, launch_time_jit
from rl_kernel_core.triton.logprob_from_logits import FWD_TILE, _block_v, online_softmax_stats

CANDIDATES = 1024
"""Most candidates the fast path gathers and ranks per row (a power of two); small vocabularies use
fewer (:func:`candidates`)."""
SAMPLE_TILE: tuple[int, int, int] = (8192, 2048, 8)
"""``(BLOCK, DRAW_BLOCK, num_warps)`` of the passes after the statistics: radix and candidate passes
read ``BLOCK`` logits per step, the whole-row draw (64-bit hashing per token) ``DRAW_BLOCK``. With B
around the SM count each row's program has an SM to itself, so a pass is bound by the bytes it
keeps in flight: larger blocks and more warps than the statistics pass, which must keep
``logprob_from_logits``' tile."""
_RADIX_BINS = 2048  # 11-bit digits (a warp's histogram lowers to numBins / 32 registers per lane)
_PAIR_BLOCK = 4  # candidates compared with all the others per step
_PIVOTS = 8
_PIVOT_BLOCK = 128
_KEY_MIN = tl.constexpr(-(2**31))
_KEY_MAX = tl.constexpr(2**31 - 1)
_ALL = tl.constexpr(2**32 - 1)  # the largest descending key: a cut that keeps every live token
_ABSENT, _SCALAR, _ROWS = 0, 1, 2  # how a parameter reaches the kernel
_TINY_TOP_P = 1e-300  # below every max probability: the same kept set as any smaller top_p


@helper_jit
def _key(z):
    """Order-preserving int32 image of fp32 ``z`` (``a <= b`` iff ``key(a) <= key(b)`` for non-NaN; -0 < +0)."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@helper_jit
def _descending(key):
    """``0x7FFFFFFF - key`` as uint32: the descending image of an int32 :func:`_key`."""
    return (key ^ 0x7FFFFFFF).to(tl.uint32, bitcast=True)


@helper_jit
def _value(key):
    """The fp32 whose :func:`_key` is ``key`` (int32)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@helper_jit
def _load_z(base, stride_lv, cols, V, inv_temp):
    return tl.load(base + cols * stride_lv, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_temp


@helper_jit
def _radix_step(base, stride_lv, V, inv_temp, floor, target, by_count, prefix, above,
                SHIFT: tl.constexpr, WIDTH: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                CAP: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """One radix-select pass over the live tokens whose descending key ``d`` lies in the bucket
    starting at ``prefix`` (``above`` live tokens lie before it). Returns ``(stop, cut, count,
    prefix, above)``: when ``stop``, the candidates are the live tokens with ``d <= cut`` and
    there are ``count`` of them; otherwise the next pass descends into the new ``prefix``.

    ``by_count`` (top-k): descend into the bucket holding rank ``target``; stop when it and
    everything above fit ``CAP``, or at the last digit (then ``cut`` is the exact key of rank
    ``target``). Otherwise (top-p alone, ``target = CAP + 1``): stop once the buckets above the
    one holding rank ``target`` hold at least ``CAP // 4`` tokens, or at the last digit; ``cut``
    then excludes that bucket. Fewer live tokens than ``target``: every live token is a candidate.
    """
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros([BINS], dtype=tl.int32)
    bucket = (prefix >> (SHIFT + WIDTH)).to(tl.uint32) if not FIRST else 0
    for start in range(0, V, BLOCK):
        z = _load_z(base, stride_lv, start + offs, V, inv_temp)
        key = _key(z)
        d = _descending(key)
        sel = (z > -float("inf")) & (key >= floor)
        if not FIRST:
            sel = sel & ((d >> (SHIFT + WIDTH)) == bucket)
        digit = ((d >> SHIFT) & ((1 << WIDTH) - 1)).to(tl.int32)
        hist += tl.histogram(digit, BINS, mask=sel)
    cum = above + tl.cumsum(hist, axis=0)
    bins = tl.arange(0, BINS)
    j = tl.sum((cum < target).to(tl.int32), axis=0)  # the bucket holding rank target (BINS: none)
    none = j >= BINS
    count_j = tl.sum(tl.where(bins == j, cum, 0), axis=0)
    before_j = count_j - tl.sum(tl.where(bins == j, hist, 0), axis=0)
    lo_j = prefix + (j.to(tl.int64) << SHIFT)
    total = tl.max(cum, axis=0)
    if LAST:
        stop_k = True
        stop_p = True
    else:
        stop_k = none | (count_j <= CAP)
        stop_p = none | (before_j >= CAP // 4)
    stop = tl.where(by_count, stop_k, stop_p)
    cut = tl.where(none, tl.full([], _ALL, tl.int64), tl.where(by_count, lo_j + ((1 << SHIFT) - 1), lo_j - 1))
    count = tl.where(none, total, tl.where(by_count, count_j, before_j))
    return stop.to(tl.int32), cut, count, lo_j, before_j


@helper_jit
def _mass_threshold(base, stride_lv, V, inv_temp, m, floor, target, PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest key ``K >= floor`` with ``W(key >= K) >= target``, ``W`` the fp64 sum of
    ``exp(z - m)`` over live tokens (finite, key >= floor); ``floor`` when ``W(key >= floor) < target``.
    Tiles are ``BLOCK x PIVOTS``: a small ``BLOCK`` keeps them in registers."""
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, PIVOTS).to(tl.int64)
    lo = floor.to(tl.int64)
    hi = _key(m).to(tl.int64) + 1  # W(key >= hi) = 0 < target
    while hi - lo > 1:
        piv = lo + ((hi - lo) * j) // (PIVOTS - 1)  # piv[0] = lo, piv[-1] = hi
        w_ge = tl.zeros([PIVOTS], dtype=tl.float64)
        min_ge = tl.full([PIVOTS], _KEY_MAX + 1, tl.int64)
        max_lt = tl.full([PIVOTS], _KEY_MIN - 1, tl.int64)
        for start in range(0, V, BLOCK):
            z = _load_z(base, stride_lv, start + offs, V, inv_temp)
            k = _key(z).to(tl.int64)
            live = (z > -float("inf")) & (k >= floor)
            w = tl.where(live, tl.exp(z - m), 0.0).to(tl.float64)
            ge = live[:, None] & (k[:, None] >= piv[None, :])
            lt = live[:, None] & (k[:, None] < piv[None, :])
            w_ge += tl.sum(tl.where(ge, w[:, None], 0.0), axis=0)
            min_ge = tl.minimum(min_ge, tl.min(tl.where(ge, k[:, None], _KEY_MAX + 1), axis=0))
            max_lt = tl.maximum(max_lt, tl.max(tl.where(lt, k[:, None], _KEY_MIN - 1), axis=0))
        ok = w_ge >= target
        # No pivot reaches the target only on the first pass (W(key >= floor) < target): the
        # floor stands. Otherwise the answer lies in [lo, hi): raise lo to the first token key at
        # or above it, and lower hi to just above the last token key below it.
        none = tl.max(ok.to(tl.int32), axis=0) == 0
        new_lo = tl.max(tl.where(ok, min_ge, _KEY_MIN - 1), axis=0)
        new_hi = tl.min(tl.where(ok, _KEY_MAX + 1, max_lt), axis=0) + 1
        hi = tl.where(none, lo + 1, new_hi)
        lo = tl.where(none, lo, new_lo)
    return lo.to(tl.int32)


@helper_jit
def _mix64(z):
    """SplitMix64's finaliser on uint64."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@helper_jit
def _uniform(state, idx):
    """``u`` in (0, 1), fp32: SplitMix64 of ``state + (idx + 1) * golden``, its top 23 bits, centred."""
    z = _mix64(state + (idx.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    return ((z >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23


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


@launch_time_jit(do_not_specialize=["temp_mode"])
def _stats_kernel(logits_ptr, stride_ln, stride_lv, temp_ptr, temp_val, inv_temp_val, stats_ptr, B, V, temp_mode,
                  BLOCK_V: tl.constexpr):
    """Step 1 for one row: ``stats[0, row] = m`` and ``stats[1, row] = m + log s``, with
    ``logprob_from_logits``' tile and warps, so the log-sum-exp has its bits."""
    row = tl.program_id(0).to(tl.int64)
    _sampling, inv_temp = _temperature(temp_ptr, temp_val, inv_temp_val, row, temp_mode)
    m, s, _u = online_softmax_stats(logits_ptr + row * stride_ln, stride_lv, V, inv_temp, False, BLOCK_V)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + B + row, m + tl.log(s))


@launch_time_jit(do_not_specialize=["pos_val", "top_k_val", "top_p_bits", "temp_mode", "pos_mode", "top_k_mode",
                                    "top_p_mode", "min_p_mode"])
def _sample_kernel(
    logits_ptr, stride_ln, stride_lv,
    temp_ptr, temp_val, inv_temp_val,
    seeds_ptr, pos_ptr, pos_val,
    top_k_ptr, top_k_val, top_p_ptr, top_p_bits, log_min_p_ptr, log_min_p_val,
    stats_ptr, scratch_ptr, tokens_ptr, logprob_ptr,
    B, V, temp_mode, pos_mode, top_k_mode, top_p_mode, min_p_mode,
    BLOCK: tl.constexpr, BINS: tl.constexpr, CAP: tl.constexpr, PAIR_BLOCK: tl.constexpr,
    DRAW_BLOCK: tl.constexpr, PIVOTS: tl.constexpr, PIVOT_BLOCK: tl.constexpr,
):
    """Steps 2-5 for one row, from the statistics of :func:`_stats_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_ln
    sampling, inv_temp = _temperature(temp_ptr, temp_val, inv_temp_val, row, temp_mode)
    m = tl.load(stats_ptr + row)
    lse = tl.load(stats_ptr + B + row)

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
    state = _mix64(_mix64(tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)) + _mix64(pos.to(tl.uint64, bitcast=True)))

    offs = tl.arange(0, BLOCK)
    token = tl.zeros([], dtype=tl.int64)
    drawn = 0
    if has_k | has_p:
        # 3. radix select of the candidates
        by_count = has_k
        target = tl.where(has_k, k, CAP + 1)
        prefix = tl.zeros([], dtype=tl.int64)
        above = tl.zeros([], dtype=tl.int32)
        stop, cut, count, prefix, above = _radix_step(base, stride_lv, V, inv_temp, floor, target, by_count, prefix, above,
                                                      21, 11, True, False, CAP, BLOCK, BINS)
        if stop == 0:
            stop, cut, count, prefix, above = _radix_step(base, stride_lv, V, inv_temp, floor, target, by_count, prefix, above,
                                                          10, 11, False, False, CAP, BLOCK, BINS)
            if stop == 0:
                stop, cut, count, prefix, above = _radix_step(base, stride_lv, V, inv_temp, floor, target, by_count, prefix, above,
                                                              0, 10, False, True, CAP, BLOCK, BINS)
        if (count > 0) & (count <= CAP):
            # 4. gather the candidates; survivors and draw on them
            scratch = scratch_ptr + row * CAP
            cut32 = cut.to(tl.uint32)
            n = tl.zeros([], dtype=tl.int32)
            live_mass = tl.zeros([], dtype=tl.float64)
            for start in range(0, V, BLOCK):
                cols = start + offs
                z = _load_z(base, stride_lv, cols, V, inv_temp)
                key = _key(z)
                live = (z > -float("inf")) & (key >= floor)
                sel = live & (_descending(key) <= cut32)
                sel32 = sel.to(tl.int32)
                slot = n + tl.cumsum(sel32, axis=0) - 1
                tl.store(scratch + slot, (key.to(tl.int64) << 32) | cols, mask=sel)
                n += tl.sum(sel32, axis=0)
                live_mass += tl.sum(tl.where(live, tl.exp(z - m), 0.0), axis=0).to(tl.float64)
            tl.debug_barrier()  # the scratch row written by every thread is read by every thread
            # for each candidate: how many candidates are larger, and their fp64 mass
            idx = tl.arange(0, CAP)
            valid = idx < count
            packed = tl.load(scratch + idx, mask=valid, other=0)
            ckey = tl.where(valid, (packed >> 32).to(tl.int32), _KEY_MIN)
            cidx = packed & 0x7FFFFFFF  # V < 2**31
            cz = _value(ckey)
            n_above = tl.zeros([CAP], dtype=tl.int32)
            mass_above = tl.zeros([CAP], dtype=tl.float64)
            jj = tl.arange(0, PAIR_BLOCK)
            for j0 in range(0, count, PAIR_BLOCK):
                other = tl.load(scratch + j0 + jj, mask=j0 + jj < count, other=0)
                okey = tl.where(j0 + jj < count, (other >> 32).to(tl.int32), _KEY_MIN)
                ow = tl.where(j0 + jj < count, tl.exp(_value(okey).to(tl.float64) - m.to(tl.float64)), 0.0)
                larger = okey[None, :] > ckey[:, None]
                n_above += tl.sum(larger.to(tl.int32), axis=1)
                mass_above += tl.sum(tl.where(larger, ow[None, :], 0.0), axis=1)
            # a token survives top-k when fewer than k are larger (ties at the k-th all survive),
            # and top-p when the mass of the larger survivors is below top_p of the survivors' mass
            keep = valid
            if has_k:
                keep = keep & (n_above < k)
            exact = True
            if has_p:
                w = tl.where(keep, tl.exp(cz.to(tl.float64) - m.to(tl.float64)), 0.0)
                cand_mass = tl.sum(w, axis=0)
                limit = top_p * tl.where(has_k, cand_mass, live_mass)
                keep = keep & (mass_above < limit)
                exact = has_k | (cand_mass >= limit)
            if exact:
                score = tl.where(keep, cz - tl.log(-tl.log(_uniform(state, cidx))), -float("inf"))
                best = tl.max(score, axis=0)
                token = tl.min(tl.where(keep & (score == best), cidx, V), axis=0).to(tl.int64)
                drawn = 1
        if drawn == 0:
            # 5. exact thresholds on the whole row
            if has_k:
                floor = tl.maximum(floor, (0x7FFFFFFF - cut).to(tl.int32))
            if has_p:
                total = tl.zeros([], dtype=tl.float64)
                for start in range(0, V, BLOCK):
                    z = _load_z(base, stride_lv, start + offs, V, inv_temp)
                    live = (z > -float("inf")) & (_key(z) >= floor)
                    total += tl.sum(tl.where(live, tl.exp(z - m), 0.0), axis=0).to(tl.float64)
                floor = _mass_threshold(base, stride_lv, V, inv_temp, m, floor, top_p * total, PIVOTS, PIVOT_BLOCK)
    if drawn == 0:
        best = -float("inf")
        draw_offs = tl.arange(0, DRAW_BLOCK)
        for start in range(0, V, DRAW_BLOCK):
            cols = start + draw_offs
            z = _load_z(base, stride_lv, cols, V, inv_temp)
            keep = (z > -float("inf")) & (_key(z) >= floor)
            if tl.max(keep.to(tl.int32), axis=0) > 0:
                score = z
                if sampling:
                    score = z - tl.log(-tl.log(_uniform(state, cols)))
                score = tl.where(keep, score, -float("inf"))
                block_best = tl.max(score, axis=0)
                if block_best > best:
                    best = block_best
                    token = tl.min(tl.where(score == block_best, cols, V), axis=0).to(tl.int64)
    z_t = tl.load(base + token * stride_lv).to(tl.float32) * inv_temp
    tl.store(tokens_ptr + row, token)
    tl.store(logprob_ptr + row, z_t - lse)


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
def sample(logits: torch.Tensor, temperature: Union[float, torch.Tensor], seeds: torch.Tensor, positions: Param,
           top_k: Param, top_p: Param, min_p: Param) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded sampling of ``logits [B, V]`` (fp32/bf16/fp16); see the module docstring and
    :mod:`rl_kernel_core.sampling` for the argument contract (numbers or ``[B]`` tensors).
    Returns ``(tokens [B] int64, logprobs [B] fp32)``."""
    b, v = logits.shape
    dev = logits.device
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logprobs = torch.empty(b, dtype=torch.float32, device=dev)
    stats = torch.empty((2, b), dtype=torch.float32, device=dev)
    cap = candidates(v)
    scratch = torch.empty((b if top_k is not None or top_p is not None else 1, cap), dtype=torch.int64, device=dev)
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
    block, draw_block = (min(size, triton.next_power_of_2(max(v, 16))) for size in SAMPLE_TILE[:2])
    _stats_kernel[(b,)](
        logits, logits.stride(0), logits.stride(1), *temp_args, stats, b, v, _mode(temperature),
        BLOCK_V=_block_v(v, FWD_TILE[0]), num_warps=FWD_TILE[1],
    )
    _sample_kernel[(b,)](
        logits, logits.stride(0), logits.stride(1), *temp_args,
        seeds, positions if isinstance(positions, torch.Tensor) else tokens, positions if isinstance(positions, int) else 0,
        top_k if isinstance(top_k, torch.Tensor) else tokens, top_k if isinstance(top_k, int) else 0,
        top_p if isinstance(top_p, torch.Tensor) else unused_fp64, top_p_bits,
        log_min_p, log_min_p_val,
        stats, scratch, tokens, logprobs, b, v,
        _mode(temperature), _mode(positions), _mode(top_k), _mode(top_p), _mode(min_p),
        BLOCK=block, BINS=_RADIX_BINS, CAP=cap, PAIR_BLOCK=min(_PAIR_BLOCK, cap),
        DRAW_BLOCK=draw_block, PIVOTS=_PIVOTS, PIVOT_BLOCK=min(_PIVOT_BLOCK, block), num_warps=SAMPLE_TILE[2],
    )
    return tokens, logprobs
