"""Statistics pass of the Triton ``linear_logprob``: per-tile softmax statistics and the target
logit, then their merge into ``logprob``, ``lse`` and ``entropy``.

For a row with scaled logits ``z`` and target ``t`` (the math is stated once here;
``rl_kernel_core.linear.reference`` states the same): per vocab tile ``j`` of ``BLOCK_N``
columns, ``m_j = max z``, ``s_j = sum exp(z - m_j)``, ``a_j = sum exp(z - m_j) (z - m_j)``, and
the target logit ``z_t`` from the tile that holds ``t`` (:func:`_stats_kernel`). Merged over
tiles in ascending order (:func:`_merge_kernel`) with ``M = max m_j``, ``S = sum s_j e^(m_j - M)``,
``A = sum e^(m_j - M) (a_j + (m_j - M) s_j)``: ``lse = M + log S``, ``logprob = z_t - lse``,
``entropy = log S - A / S``. ``z_t`` is read from the same tile as the other logits, so the
gradient pass (:mod:`.triton_grad`), which recomputes the tile, forms ``z - lse`` from the
forward's bits. Tile statistics are reduced by a fixed tree and merged in a fixed order, without
atomics: deterministic and batch invariant. On Hopper the pass may run as a CUDA kernel with the
same bits (:mod:`.triton_sm90`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from rl_kernel_core import dispatch
from rl_kernel_core.linear import triton_sm90
from rl_kernel_core.linear.chunks import Chunk
from rl_kernel_core.linear.triton_tile import grid, linear, logits_tile, row_block, tile_args, tiles
from rl_kernel_core.triton._jit import launch_time_jit
from rl_kernel_core.triton._matmul_helpers import grouped_tile
from rl_kernel_core.triton.tuning import MERGE_BLOCK_R, MERGE_BLOCK_T


@launch_time_jit
def _stats_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    tgt_ptr,
    M,
    V,
    D,
    stride_xm,
    stride_xk,
    stride_wv,
    stride_wk,
    inv_temp,
    ignore_index,
    pmax_ptr,
    psum_ptr,
    pent_ptr,
    ztgt_ptr,
    stride_pm,
    keep_ptr,
    stride_km,
    n_progs,
    FROM_LOGITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WANT_ENT: tl.constexpr,
    KEEP: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    TMA: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``(m_j, s_j, a_j)`` of every (row block, vocab tile) unit of rows ``[0, M)``, and ``z_t``
    from the tile holding each row's target. With ``KEEP``, each tile's logits before bias and
    scale go to ``keep_ptr`` (fp32, row stride ``stride_km``), for a gradient pass that reads them
    instead of forming them again. Program ``i`` of ``n_progs`` takes units ``i, i + n_progs, ...``
    (one unit each unless launched persistent)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(V, BLOCK_N)
    # with FLATTEN the compiler overlaps one unit's epilogue with the next unit's loads
    for pid in tl.range(tl.program_id(0), num_pid_m * n_tiles, n_progs, flatten=FLATTEN):
        pid_m, pid_g = grouped_tile(pid, num_pid_m, n_tiles, GROUP_M)
        rows, row_ok, tgt = row_block(pid_m, M, tgt_ptr, ignore_index, BLOCK_M)
        rows_safe = tl.where(row_ok, rows, 0).to(tl.int64)
        # a loop of one tile: the flattened persistent loop nest is faster with it
        # (benchmarks/results/restructure_h100/linear_before_after)
        for t in range(pid_g, tl.minimum(pid_g + 1, n_tiles)):
            z, cols, col_ok, raw = logits_tile(
                x_ptr,
                w_ptr,
                b_ptr,
                rows_safe,
                row_ok,
                pid_m,
                t,
                V,
                D,
                stride_xm,
                stride_xk,
                stride_wv,
                stride_wk,
                inv_temp,
                FROM_LOGITS,
                HAS_BIAS,
                False,
                EVEN_K,
                IEEE,
                UPCAST_DOT,
                TMA,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            if KEEP:
                tl.store(
                    keep_ptr + rows_safe[:, None] * stride_km + cols[None, :],
                    raw,
                    mask=row_ok[:, None] & col_ok[None, :],
                )
            zm = tl.where(col_ok[None, :], z, float("-inf"))
            m = tl.max(zm, axis=1)
            # a tile of -inf logits (a -inf bias) has m = -inf: exponentials relative to 0 give
            # s = 0 instead of exp(-inf - -inf) = NaN
            ref = tl.where(m == -float("inf"), 0.0, m)
            e = tl.exp(zm - ref[:, None])
            s = tl.sum(e, axis=1)
            p_off = rows_safe * stride_pm + t
            tl.store(pmax_ptr + p_off, m, mask=row_ok)
            tl.store(psum_ptr + p_off, s, mask=row_ok)
            if WANT_ENT:  # e = 0 (a -inf logit, or past V) adds 0, not 0 * -inf
                a_stat = tl.sum(tl.where(e > 0.0, e * (z - ref[:, None]), 0.0), axis=1)
                tl.store(pent_ptr + p_off, a_stat, mask=row_ok)
            zt = tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
            owns = (tgt >= t * BLOCK_N) & (tgt < t * BLOCK_N + BLOCK_N)
            tl.store(ztgt_ptr + rows, zt, mask=row_ok & owns)


@launch_time_jit
def _merge_kernel(
    pmax_ptr,
    psum_ptr,
    pent_ptr,
    ztgt_ptr,
    tgt_ptr,
    lp_ptr,
    ent_ptr,
    lse_ptr,
    M,
    n_tiles,
    stride_pm,
    ignore_index,
    WANT_ENT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Merge each row's tile statistics in ascending tile order into logprob, lse and (when
    ``WANT_ENT``) entropy."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    run_m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    run_s = tl.zeros((BLOCK_R,), tl.float32)
    run_a = tl.zeros((BLOCK_R,), tl.float32)
    for t0 in range(0, n_tiles, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        ok = row_ok[:, None] & (ts < n_tiles)[None, :]
        off = rows[:, None] * stride_pm + ts[None, :]
        tm = tl.load(pmax_ptr + off, mask=ok, other=float("-inf"))
        tsum = tl.load(psum_ptr + off, mask=ok, other=0.0)
        new_m = tl.maximum(run_m, tl.max(tm, axis=1))
        # the reference point of the exponentials: 0 while a row has seen only -inf tiles (or
        # is past M); a -inf tile (s_j = 0) then adds f = 0, never exp(-inf - -inf) = NaN
        ref = tl.where(new_m == float("-inf"), 0.0, new_m)
        f = tl.exp(tm - ref[:, None])
        blk_s = tl.sum(f * tsum, axis=1)
        first = run_m == float("-inf")
        g = tl.where(first, 0.0, tl.exp(run_m - ref))
        if WANT_ENT:
            ta = tl.load(pent_ptr + off, mask=ok, other=0.0)
            blk_a = tl.sum(tl.where(f > 0.0, f * (ta + (tm - ref[:, None]) * tsum), 0.0), axis=1)
            shift = tl.where(first, 0.0, run_m - ref)
            run_a = g * (run_a + shift * run_s) + blk_a
        run_s = g * run_s + blk_s
        run_m = new_m
    log_s = tl.log(run_s)
    lse = run_m + log_s
    entropy = log_s - run_a / run_s  # unused (and constant-folded away) without WANT_ENT
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=ignore_index)
    valid = row_ok & (tgt != ignore_index)
    zt = tl.load(ztgt_ptr + rows, mask=valid, other=0.0)
    tl.store(lp_ptr + rows, tl.where(valid, zt - lse, 0.0), mask=row_ok)
    if WANT_ENT:
        tl.store(ent_ptr + rows, tl.where(valid, entropy, 0.0), mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)


def stats_rows(n_tiles: int) -> int:
    """Rows per chunk of the gemm-route forward (a function of the tile count only, never of N):
    as many as fit ``n_tiles`` tiles of statistics in ``LinearTuning.stats_bytes``, from 16 to 16384."""
    return max(MERGE_BLOCK_R, min(16384, linear().stats_bytes // (12 * n_tiles)))


def launch_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    rows: int,
    inv_temp: float,
    ignore_index: int,
    partials: torch.Tensor,
    ztgt: torch.Tensor,
    from_logits: bool,
    want_entropy: bool,
    keep: Optional[torch.Tensor] = None,
) -> None:
    """Tile statistics of ``rows`` rows into ``partials [3, >=rows, n_tiles]`` and ``ztgt [>=rows]``
    (``partials[2]``, the entropy statistic, only with ``want_entropy``).

    ``x`` is ``hidden [rows, D]`` (gemm route) or an fp32 logits chunk ``[>=rows, V]`` (chunked).
    ``keep`` (gemm route only): an fp32 ``[>=rows, V]`` buffer that receives the rows' logits
    before bias and temperature, which a ``from_logits`` gradient pass over it turns into the
    gemm route's logits bit for bit. A gemm-route pass runs the Hopper CUDA kernel where
    :func:`~rl_kernel_core.linear.triton_sm90.serves` says so, with the same bits.
    """
    if keep is not None and from_logits:
        raise ValueError(
            "launch_stats: keep takes the gemm route's logits; from_logits passes already read stored ones"
        )
    ext = None if from_logits else triton_sm90.serves("stats", x[:rows], weight, bias)
    dispatch.ran(triton_sm90.KERNELS, "triton" if ext is None else "triton+sm90")
    if ext is not None:
        group_m = tiles(weight.dtype, weight.device, False).group_m
        ext.linear_stats_sm90(
            x[:rows], weight, bias, targets, rows, inv_temp, ignore_index, partials, ztgt, want_entropy, keep, group_m
        )
        return
    cfg = tiles(weight.dtype, weight.device, from_logits)
    n_tiles = triton.cdiv(weight.shape[0], cfg.block_n)
    g = grid(triton.cdiv(rows, cfg.block_m) * n_tiles, cfg, x.device, from_logits)
    args, flags = tile_args(x, weight, bias, targets, rows, inv_temp, ignore_index, cfg, from_logits)
    _stats_kernel[g](
        *args,
        partials[0],
        partials[1],
        partials[2],
        ztgt,
        partials.stride(1),
        ztgt if keep is None else keep,
        0 if keep is None else keep.stride(0),
        g[0],
        WANT_ENT=want_entropy,
        KEEP=keep is not None,
        **flags,
    )


def launch_merge(
    partials: torch.Tensor,
    ztgt: torch.Tensor,
    targets: torch.Tensor,
    rows: int,
    n_tiles: int,
    ignore_index: int,
    lp: torch.Tensor,
    ent: Optional[torch.Tensor],
    lse: torch.Tensor,
) -> None:
    """Merge ``rows`` rows of tile statistics into ``lp``, ``lse`` and, unless None, ``ent`` (fp32 ``[rows]``)."""
    _merge_kernel[(triton.cdiv(rows, MERGE_BLOCK_R),)](
        partials[0],
        partials[1],
        partials[2],
        ztgt,
        targets,
        lp,
        lp if ent is None else ent,
        lse,
        rows,
        n_tiles,
        partials.stride(1),
        ignore_index,
        WANT_ENT=ent is not None,
        BLOCK_R=MERGE_BLOCK_R,
        BLOCK_T=MERGE_BLOCK_T,
        num_warps=4,
    )


@dataclass
class StatsScratch:
    """One chunk's tile statistics (``ChunkBuffers.scratch`` of the Triton passes): fp32
    ``partials [3, rows, n_tiles]`` (``m_j``, ``s_j``, ``a_j``) and ``ztgt [rows]`` (target logits)."""

    n_tiles: int
    partials: torch.Tensor
    ztgt: torch.Tensor


def _vocab_tiles(hidden: torch.Tensor, weight: torch.Tensor, route: str) -> int:
    return triton.cdiv(weight.shape[0], tiles(hidden.dtype, hidden.device, route == "chunked").block_n)


def chunk_scratch(hidden: torch.Tensor, weight: torch.Tensor, route: str, rows: int) -> StatsScratch:
    """The statistics buffers of ``rows``-row chunks of ``hidden`` against ``weight`` on ``route``."""
    n_tiles = _vocab_tiles(hidden, weight, route)
    return StatsScratch(
        n_tiles,
        torch.empty(3, rows, n_tiles, dtype=torch.float32, device=hidden.device),
        torch.empty(rows, dtype=torch.float32, device=hidden.device),
    )


def forward_rows(hidden: torch.Tensor, weight: torch.Tensor, route: str) -> int:
    """Rows per gemm-route forward chunk: as many as the statistics buffer holds (:func:`stats_rows`)."""
    return stats_rows(_vocab_tiles(hidden, weight, route))


def chunk_stats(chunk: Chunk, lp: torch.Tensor, ent: Optional[torch.Tensor], lse: torch.Tensor) -> None:
    """The chunk driver's statistics pass: tile statistics of the chunk's ``n`` rows into
    ``buf.scratch`` (with ``buf.keeps_logits``, the logits into ``buf.logits``), merged into
    ``lp``/``ent``/``lse`` (``[n]`` views; ``ent`` may be None)."""
    buf, n = chunk.buf, chunk.n
    scratch: StatsScratch = buf.scratch
    launch_stats(
        chunk.x,
        chunk.weight,
        chunk.bias,
        chunk.targets,
        n,
        chunk.inv_temp,
        chunk.ignore_index,
        scratch.partials,
        scratch.ztgt,
        buf.route == "chunked",
        ent is not None,
        buf.logits if buf.keeps_logits else None,
    )
    launch_merge(scratch.partials, scratch.ztgt, chunk.targets, n, scratch.n_tiles, chunk.ignore_index, lp, ent, lse)
