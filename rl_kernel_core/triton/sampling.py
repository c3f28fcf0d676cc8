"""Triton kernel for ``sample``: seeded Gumbel-max over the filtered set, without sorting the vocab.

One program per row, every pass a read of the row in fixed-size blocks (fixed reduction order, so a
row's result depends on nothing but the row):

1. statistics: ``m = max z`` and ``s = sum exp(z - m)`` for ``z = fp32(logits) * inv_temp``, by
   :func:`rl_kernel_core.triton.logprob_from_logits.online_softmax_stats` with the forward's tile,
   so ``logprob = z[token] - (m + log s)`` has the bits of ``logprob_from_logits`` on this backend.
2. min-p: the kept floor is ``m + log(min_p)`` (``log(min_p)`` formed on the host, as the reference).
3. top-k, then top-p: each threshold is the largest key ``K`` with ``W(key >= K) >= target`` over the
   tokens kept so far, where ``key`` is the order-preserving integer image of the fp32 value, ``W``
   counts tokens (top-k, target ``k``) or sums ``exp(z - m)`` in fp64 (top-p, target
   ``top_p * W(kept)``). It is found by a search over keys: each pass evaluates ``PIVOTS`` evenly
   spaced pivots in the current interval and also the nearest token keys around them, so the interval
   shrinks by ``PIVOTS - 1`` per pass and closes as soon as one distinct value is left in it.
4. draw: ``argmax over kept tokens of z_i + g_i``, ``g_i = -log(-log u_i)`` in fp32, the uniforms
   from the counter-based hash of :mod:`rl_kernel_core.reference.sampling` keyed on ``(seed, i)``;
   blocks holding no kept token skip the hash. Ties go to the lowest index.

Greedy rows (temperature 0) take ``argmax logits`` and the log-prob at temperature 1.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.triton._jit import helper_jit, launch_time_jit
from rl_kernel_core.triton.logprob_from_logits import FWD_TILE, _block_v, online_softmax_stats

_SEARCH_BLOCK = 1024
_PIVOTS = 8
_KEY_MIN = -(2**31)  # below every fp32 key
_KEY_MAX = 2**31  # above every fp32 key


@helper_jit
def _key(z):
    """Order-preserving int64 image of fp32 ``z`` (``a <= b`` iff ``_key(a) <= _key(b)`` for non-NaN, -0 < +0)."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@helper_jit
def _threshold_search(base, stride_lv, V, inv_temp, m, floor, target, BY_MASS: tl.constexpr,
                      PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest key ``K >= floor`` with ``W(key >= K) >= target`` over finite tokens with key >= floor;
    ``floor`` when even ``W(key >= floor) < target``. ``W`` counts (``BY_MASS`` False) or sums
    ``exp(z - m)`` in fp64."""
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, PIVOTS).to(tl.int64)
    lo = floor
    hi = _key(m) + 1  # W(key >= hi) = 0 < target
    while hi - lo > 1:
        piv = lo + ((hi - lo) * j) // (PIVOTS - 1)  # piv[0] = lo, piv[-1] = hi
        w_ge = tl.zeros([PIVOTS], dtype=tl.float64)
        min_ge = tl.full([PIVOTS], _KEY_MAX, tl.int64)
        max_lt = tl.full([PIVOTS], _KEY_MIN, tl.int64)
        for start in range(0, V, BLOCK):
            cols = start + offs
            z = tl.load(base + cols * stride_lv, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_temp
            k = _key(z)
            live = (z > -float("inf")) & (k >= floor)
            if BY_MASS:
                w = tl.where(live, tl.exp(z.to(tl.float64) - m.to(tl.float64)), 0.0)
            else:
                w = tl.where(live, 1.0, 0.0).to(tl.float64)
            ge = live[:, None] & (k[:, None] >= piv[None, :])
            lt = live[:, None] & (k[:, None] < piv[None, :])
            w_ge += tl.sum(tl.where(ge, w[:, None], 0.0), axis=0)
            min_ge = tl.minimum(min_ge, tl.min(tl.where(ge, k[:, None], _KEY_MAX), axis=0))
            max_lt = tl.maximum(max_lt, tl.max(tl.where(lt, k[:, None], _KEY_MIN), axis=0))
        ok = w_ge >= target
        # No pivot reaches the target only on the first pass (W(key >= floor) < target): the
        # floor stands. Otherwise the answer lies in [lo, hi): raise lo to the first token key at
        # or above it, and lower hi to just above the last token key below it.
        none = tl.max(ok.to(tl.int32), axis=0) == 0
        new_lo = tl.max(tl.where(ok, min_ge, _KEY_MIN), axis=0)
        new_hi = tl.min(tl.where(ok, _KEY_MAX, max_lt), axis=0) + 1
        hi = tl.where(none, lo + 1, new_hi)
        lo = tl.where(none, lo, new_lo)
    return lo


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


@launch_time_jit
def _sample_kernel(
    logits_ptr, stride_ln, stride_lv,
    temp_ptr, inv_temp_ptr, seeds_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr,
    tokens_ptr, logprob_ptr,
    V,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_ln
    sampling = tl.load(temp_ptr + row) != 0.0  # temperature 0: greedy
    inv_temp = tl.load(inv_temp_ptr + row)
    m, s, _u = online_softmax_stats(base, stride_lv, V, inv_temp, False, BLOCK_V)
    lse = m + tl.log(s)

    floor = tl.full([], _KEY_MIN, tl.int64)
    if HAS_MIN_P:
        if sampling:
            floor = _key(m + tl.load(log_min_p_ptr + row))
    if HAS_TOP_K:
        if sampling:
            k = tl.load(top_k_ptr + row)
            if k < V:
                floor = _threshold_search(base, stride_lv, V, inv_temp, m, floor, k.to(tl.float64),
                                          False, PIVOTS, SEARCH_BLOCK)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row)
        if sampling & (top_p < 1.0):
            offs = tl.arange(0, SEARCH_BLOCK)
            total = tl.zeros([], dtype=tl.float64)
            for start in range(0, V, SEARCH_BLOCK):
                cols = start + offs
                z = tl.load(base + cols * stride_lv, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_temp
                live = (z > -float("inf")) & (_key(z) >= floor)
                total += tl.sum(tl.where(live, tl.exp(z.to(tl.float64) - m.to(tl.float64)), 0.0), axis=0)
            floor = _threshold_search(base, stride_lv, V, inv_temp, m, floor, top_p * total,
                                      True, PIVOTS, SEARCH_BLOCK)

    state = _mix64(tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True))
    offs = tl.arange(0, SEARCH_BLOCK)
    best = -float("inf")
    best_idx = tl.zeros([], dtype=tl.int64)
    for start in range(0, V, SEARCH_BLOCK):
        cols = start + offs
        z = tl.load(base + cols * stride_lv, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_temp
        keep = (z > -float("inf")) & (_key(z) >= floor)
        if tl.max(keep.to(tl.int32), axis=0) > 0:
            score = z
            if sampling:
                score = z - tl.log(-tl.log(_uniform(state, cols)))
            score = tl.where(keep, score, -float("inf"))
            block_best = tl.max(score, axis=0)
            if block_best > best:
                best = block_best
                best_idx = tl.min(tl.where(score == block_best, cols, V), axis=0).to(tl.int64)
    z_t = tl.load(base + best_idx * stride_lv).to(tl.float32) * inv_temp
    tl.store(tokens_ptr + row, best_idx)
    tl.store(logprob_ptr + row, z_t - lse)


def _supports(logits, temperature, seeds, top_k, top_p, min_p) -> Optional[str]:
    if logits.dtype == torch.float64:
        return "fp64 logits (the kernel computes in fp32; the torch backend keeps fp64 inputs' rounding to fp32 exact)"
    return None


@dispatch.register("sample", "triton", supports=_supports)
def sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
    top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor], min_p: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded sampling of ``logits [B, V]`` (fp32/bf16/fp16); see the module docstring and
    :mod:`rl_kernel_core.sampling` for the argument contract. Returns ``(tokens [B] int64, logprobs [B] fp32)``."""
    b, v = logits.shape
    dev = logits.device
    greedy = temperature == 0
    # the factor logprob_from_logits multiplies by: fp32(1 / T) with the division in double
    inv_temp = torch.where(greedy, 1.0, 1.0 / temperature.to(torch.float64)).to(torch.float32)
    log_min_p = None if min_p is None else torch.log(min_p)
    tokens = torch.full((b,), -1, dtype=torch.int64, device=dev)
    logprobs = torch.full((b,), float("nan"), dtype=torch.float32, device=dev)
    dummy = inv_temp
    block_v, num_warps = _block_v(v, FWD_TILE[0]), FWD_TILE[1]
    _sample_kernel[(b,)](
        logits, logits.stride(0), logits.stride(1),
        temperature, inv_temp, seeds,
        dummy if top_k is None else top_k, dummy if top_p is None else top_p, dummy if log_min_p is None else log_min_p,
        tokens, logprobs, v,
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
        BLOCK_V=block_v, SEARCH_BLOCK=min(_SEARCH_BLOCK, triton.next_power_of_2(max(v, 16))), PIVOTS=_PIVOTS,
        num_warps=num_warps,
    )
    return tokens, logprobs
