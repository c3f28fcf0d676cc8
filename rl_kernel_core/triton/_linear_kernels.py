"""Kernels and chunk drivers shared by the Triton ``linear_logprob`` and ``fused_linear_policy_loss``.

The math (stated once; ``rl_kernel_core.reference.logprob`` states the same). For a row with
scaled logits ``z = (h @ W.T + b) / T`` and target ``t``:

* forward: per vocab tile ``j`` of ``BLOCK_N`` columns, ``m_j = max z``, ``s_j = sum exp(z - m_j)``,
  ``a_j = sum exp(z - m_j) (z - m_j)``; merged over tiles in ascending order with
  ``M = max m_j``, ``S = sum s_j e^(m_j - M)``, ``A = sum e^(m_j - M) (a_j + (m_j - M) s_j)``:
  ``lse = M + log S``, ``logprob = z_t - lse``, ``entropy = log S - A / S``.
* backward: ``p = exp(z - lse)``, ``dL/dz = g (onehot(t) - p) - e p (log p + entropy)`` for
  upstream gradients ``g`` (log-prob) and ``e`` (entropy), ``dl = dL/dz / T`` is the gradient of
  the raw logits; ``dh = dl @ W``, ``dW = dl^T @ h``, ``db = sum_rows dl``.

One kernel, :func:`_logits_pass_kernel`, does every pass over a block of logits. Where the
logits come from is a compile-time switch: ``FROM_LOGITS=False`` forms the tile with ``tl.dot``
from ``hidden`` and ``weight`` (the logits never leave registers: the *gemm* route);
``FROM_LOGITS=True`` reads an fp32 logits chunk that cuBLAS wrote (the *chunked* route). What it
does with the tile is the other switch: ``GRAD=False`` writes the tile's ``(m_j, s_j, a_j)`` and,
for the row whose target falls in the tile, ``z_t``; ``GRAD=True`` writes ``dl`` for the tile.
:func:`_merge_kernel` then merges each row's tile statistics in a fixed order.

One logits route per row: every pass of an op (forward with or without entropy, with or without
grad, backward, and the loss) takes its logits from the same route (:meth:`Tuning.route_for`, a
function of the device and dtype only), and ``z_t`` is read from the same tile as the other
logits. So the backward's ``z - lse`` is formed from the forward's bits (a one-token vocab gets
``p = 1`` exactly and gradient 0; ``z_t - max z`` is exact at any logit magnitude), and a row's
log-prob has the same bits in every pass.

Determinism and batch invariance: each output element of the tile product is one length-D dot
product accumulated in a fixed ``BLOCK_K`` order; tile statistics are reduced by a fixed tree
and merged in ascending tile order; no atomics anywhere. The tile shape depends only on the
device kind and dtype, never on N, so a row's bits do not depend on N or on the other rows.
cuBLAS products (chunked route, dh) always run on a fixed ``[chunk_rows, ...]`` shape, the last
chunk zero-padded, because cuBLAS picks its algorithm (and split) from the shape.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import triton
import triton.language as tl

from rl_kernel_core.switches import env_flag
from rl_kernel_core.triton._jit import interpreting, launch_time_jit


@launch_time_jit
def _logits_pass_kernel(
    x_ptr, w_ptr, b_ptr, tgt_ptr,
    M, V, D,
    stride_xm, stride_xk, stride_wv, stride_wk,
    inv_temp, ignore_index,
    pmax_ptr, psum_ptr, pent_ptr, ztgt_ptr, stride_pm,
    lse_ptr, ent_ptr, glp_ptr, gent_ptr, dl_ptr, stride_dm,
    TILES_PER_PROG, n_progs,
    FROM_LOGITS: tl.constexpr, GRAD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GENT: tl.constexpr,
    WANT_ENT: tl.constexpr, IN_PLACE: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, UPCAST_DOT: tl.constexpr,
    TMA: tl.constexpr, FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One pass over the logits of rows ``[0, M)``.

    A work unit is ``BLOCK_M`` rows and ``TILES_PER_PROG`` consecutive vocab tiles, visited in
    ascending order (``IN_PLACE`` needs whole rows per unit: ``dl`` overwrites the fp32 logits it
    was computed from, as a 2-byte view whose row stride is the fp32 row's). Program ``i`` of
    ``n_progs`` takes units ``i, i + n_progs, ...`` (one unit each unless launched persistent).
    """
    num_pid_m = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(V, BLOCK_N)
    num_pid_g = tl.cdiv(n_tiles, TILES_PER_PROG)
    # persistent launches (n_progs < work units) walk the work units with a stride of n_progs;
    # with FLATTEN the compiler overlaps one unit's epilogue with the next unit's loads
    for pid in tl.range(tl.program_id(0), num_pid_m * num_pid_g, n_progs, flatten=FLATTEN):
        # grouped order: GROUP_M row blocks sweep the vocab together, so their weight tiles share L2
        num_pid_in_group = GROUP_M * num_pid_g
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_g = (pid % num_pid_in_group) // group_size_m

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
        if GRAD:
            valid = row_ok & (tgt != ignore_index)
            lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
            glp = tl.where(valid, tl.load(glp_ptr + rows, mask=row_ok, other=0.0), 0.0)
            if HAS_GENT:
                ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
                gent = tl.where(valid, tl.load(gent_ptr + rows, mask=row_ok, other=0.0), 0.0)
        rows_safe = tl.where(row_ok, rows, 0).to(tl.int64)

        t_start = pid_g * TILES_PER_PROG
        t_end = tl.minimum(t_start + TILES_PER_PROG, n_tiles)
        for t in range(t_start, t_end):
            cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < V
            if FROM_LOGITS:
                zr = tl.load(
                    x_ptr + rows_safe[:, None] * stride_xm + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                ).to(tl.float32)
                if IN_PLACE:
                    # every thread's loads of this tile land before any thread overwrites its bytes
                    tl.debug_barrier()
            else:
                if not TMA:
                    cols_safe = tl.where(col_ok, cols, 0).to(tl.int64)
                    offs_k = tl.arange(0, BLOCK_K)
                    a_ptrs = x_ptr + rows_safe[:, None] * stride_xm + offs_k[None, :] * stride_xk
                    b_ptrs = w_ptr + cols_safe[None, :] * stride_wv + offs_k[:, None] * stride_wk
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k in range(0, tl.cdiv(D, BLOCK_K)):
                    if TMA:  # x_ptr / w_ptr are tensor descriptors; out-of-bounds rows, columns and k read as 0
                        a = x_ptr.load([pid_m * BLOCK_M, k * BLOCK_K])
                        b = w_ptr.load([t * BLOCK_N, k * BLOCK_K]).T
                    elif EVEN_K:
                        a = tl.load(a_ptrs)
                        b = tl.load(b_ptrs)
                    else:
                        k_ok = offs_k < D - k * BLOCK_K
                        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
                    if UPCAST_DOT:  # the CPU interpreter multiplies 16-bit floats as integers; the upcast is exact
                        a = a.to(tl.float32)
                        b = b.to(tl.float32)
                    if IEEE:
                        acc = tl.dot(a, b, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(a, b, acc)
                    if not TMA:
                        a_ptrs += BLOCK_K * stride_xk
                        b_ptrs += BLOCK_K * stride_wk
                zr = acc
            if HAS_BIAS:
                zr += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            z = zr * inv_temp

            if GRAD:
                logp = z - lse[:, None]
                p = tl.exp(logp)
                onehot = cols[None, :] == tgt[:, None]
                dz = tl.where(onehot, glp[:, None], 0.0) - glp[:, None] * p
                if HAS_GENT:  # p = 0 (a -inf logit) contributes 0, not 0 * -inf
                    dz -= tl.where(p > 0.0, gent[:, None] * p * (logp + ent[:, None]), 0.0)
                dz = tl.where(valid[:, None], dz * inv_temp, 0.0)
                out_ok = row_ok[:, None] & col_ok[None, :]
                tl.store(dl_ptr + rows_safe[:, None] * stride_dm + cols[None, :], dz.to(dl_ptr.dtype.element_ty), mask=out_ok)
            else:
                zm = tl.where(col_ok[None, :], z, float("-inf"))
                m = tl.max(zm, axis=1)
                # a tile of -inf logits (a -inf bias) has m = -inf: exponentials relative to 0
                # give s = 0 instead of exp(-inf - -inf) = NaN
                ref = tl.where(m == -float("inf"), 0.0, m)
                e = tl.exp(zm - ref[:, None])
                s = tl.sum(e, axis=1)
                p_off = rows_safe * stride_pm + t
                tl.store(pmax_ptr + p_off, m, mask=row_ok)
                tl.store(psum_ptr + p_off, s, mask=row_ok)
                if WANT_ENT:  # e = 0 (a -inf logit, or past V) adds 0, not 0 * -inf
                    a_stat = tl.sum(tl.where(e > 0.0, e * (z - ref[:, None]), 0.0), axis=1)
                    tl.store(pent_ptr + p_off, a_stat, mask=row_ok)
                # z_t from the tile itself: the bits the statistics and the gradient pass see
                zt = tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
                owns = (tgt >= t * BLOCK_N) & (tgt < t * BLOCK_N + BLOCK_N)
                tl.store(ztgt_ptr + rows, zt, mask=row_ok & owns)


@launch_time_jit
def _merge_kernel(
    pmax_ptr, psum_ptr, pent_ptr, ztgt_ptr, tgt_ptr,
    lp_ptr, ent_ptr, lse_ptr,
    M, n_tiles, stride_pm, ignore_index,
    WANT_ENT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
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


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class TileConfig:
    """Tile shape of :func:`_logits_pass_kernel`; part of the numerical result (fixed per device kind)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False
    """Load the gemm route's operands through TMA tensor descriptors where
    :func:`tma_supported` (others take pointer loads with the same tiles)."""
    persistent: bool = False
    """Launch one program per SM that walks the tiles (flattened loop nest: the next tile's
    loads overlap this tile's epilogue) instead of one program per tile. The tile partition and
    each tile's arithmetic are the same either way."""


_INTERPRETER_TILES = TileConfig(32, 64, 32, group_m=4, num_warps=4, num_stages=1)
_INTERPRETER_PROGRAMS = 3
"""Programs of a persistent launch under the interpreter: few, so each walks several units."""
_GPU_FP32_TILES = TileConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=3)
_GPU_MEMORY_PASS_TILES = TileConfig(1, 2048, 16, group_m=1, num_warps=8, num_stages=1)


@dataclass
class Tuning:
    """Choices measured on an H100 (``docs/kernels_linear_logprob.md``); the benchmark overrides them.

    ``route``: where every pass (forward, backward, loss) takes its logits from, ``"gemm"`` (a
    Triton ``tl.dot`` pass: the logits stay in registers) or ``"chunked"`` (cuBLAS writes an fp32
    logits chunk that one pass reads). One route for all passes, so a row's logits have the same
    bits in the forward, the backward and the loss; gemm serves the vocab-parallel path as well
    (``_vocab_parallel``), whose results then equal the single-process ones bit for bit.
    ``chunk_bytes``: the budget of the per-chunk work buffer (``dl``, or the fp32 logits chunk
    that ``dl`` then overwrites). ``wgrad_fp32``: accumulate ``dW`` over token chunks in an fp32
    ``[V, D]`` buffer (``4 V D`` extra bytes while the gradient is formed, and slower) instead of
    in ``weight``'s dtype (one rounding per chunk); off by default, on with
    ``RL_KERNEL_WGRAD_FP32=1``. ``gemm_tiles`` / ``gemm_grad_tiles``: the gemm route's tile shape
    for 16-bit inputs on a GPU in the statistics pass / the gradient pass. The statistics pass
    takes TMA loads and a persistent launch; the gradient pass, which stores a 16-bit ``dl``
    tile, measured slower with them (one timing of the pass alone on an H100, not committed:
    1.98 against 1.55 ms per 1536-row chunk at D=896; ``bench_linear_logprob.py --variants
    "tmagrad=gemm_grad_tiles.tma:true;gemm_grad_tiles.persistent:true"`` measures it end to end).
    """

    route: str = "gemm"
    chunk_bytes: int = 448 * 2**20
    wgrad_fp32: bool = field(default_factory=lambda: env_flag("RL_KERNEL_WGRAD_FP32", False))
    gemm_tiles: TileConfig = field(default_factory=lambda: TileConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3, tma=True, persistent=True))
    gemm_grad_tiles: TileConfig = field(default_factory=lambda: TileConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3))

    def tiles(self, dtype: torch.dtype, device: torch.device, from_logits: bool, grad: bool = False) -> TileConfig:
        """The tile shape for a statistics (or, with ``grad``, gradient) pass over ``dtype`` inputs on ``device``."""
        gemm = self.gemm_grad_tiles if grad else self.gemm_tiles
        if device.type != "cuda" or interpreting():
            return dataclasses.replace(_INTERPRETER_TILES, tma=gemm.tma, persistent=gemm.persistent)
        if from_logits:
            return _GPU_MEMORY_PASS_TILES
        return _GPU_FP32_TILES if dtype == torch.float32 else gemm

    def route_for(self, hidden: torch.Tensor) -> str:
        """``"gemm"`` or ``"chunked"``: the route of every pass over ``hidden`` (a function of its
        device and dtype only). The chunked route needs cuBLAS to write fp32 logits from 16-bit
        operands; where this torch cannot, the gemm route runs.
        """
        if self.route == "chunked" and not fp32_logits_supported(hidden.device, hidden.dtype):
            return "gemm"
        return self.route


TUNING = Tuning()
STATS_BYTES = 128 * 2**20
"""Budget of the tile-statistics buffers of the gemm-route forward (12 bytes per row and tile)."""
_MERGE_BLOCK_R = 16
_MERGE_BLOCK_T = 64


def stats_rows(n_tiles: int) -> int:
    """Rows per chunk of the gemm-route forward (a function of the tile count only, never of N):
    as many as fit ``n_tiles`` tiles of statistics in :data:`STATS_BYTES`, from 16 to 16384."""
    return max(_MERGE_BLOCK_R, min(16384, STATS_BYTES // (12 * n_tiles)))


def chunk_rows(vocab: int, elem_bytes: int) -> int:
    """Fixed rows per chunk (a function of the vocab and dtype only, never of N): as many rows,
    in multiples of 128 up to 8192 (powers of two from 16 below 128), as fit a ``[rows, vocab]``
    buffer of ``elem_bytes``-byte elements in ``TUNING.chunk_bytes``."""
    rows = TUNING.chunk_bytes // max(1, vocab * elem_bytes)
    if rows >= 128:
        return int(min(8192, rows // 128 * 128))
    return int(2 ** int(math.log2(max(16, rows))))


# --------------------------------------------------------------------------- GEMM helpers

_DTYPE_MM_OK: dict[str, bool] = {}


def _dtype_mm_supported(kind: str) -> bool:
    """Whether this torch's CUDA ``mm`` / in-place ``addmm`` take ``out_dtype=float32`` for bf16 (probed once)."""
    if kind not in _DTYPE_MM_OK:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda")
        acc = torch.ones(16, 16, dtype=torch.float32, device="cuda")
        try:
            if kind == "mm":
                out = torch.mm(a, a, out_dtype=torch.float32)
                ok = out.dtype == torch.float32 and bool((out == 16).all())
            else:
                torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
                ok = bool((acc == 17).all())
        except (RuntimeError, TypeError):
            ok = False
        _DTYPE_MM_OK[kind] = ok
    return _DTYPE_MM_OK[kind]


def fp32_logits_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """The chunked route needs cuBLAS to write fp32 logits from 16-bit operands (``mm(out_dtype=)``)."""
    if device.type != "cuda" or dtype == torch.float32:
        return True
    return _dtype_mm_supported("mm")


def mm_fp32_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out[fp32] = a @ b`` with fp32 accumulation (cuBLAS ``out_dtype`` on CUDA, upcast on CPU)."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    elif a.device.type == "cuda":
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


def addmm_acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in ``acc``'s dtype with fp32 products, never a full-size temporary."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.device.type != "cuda":
        acc.addmm_(a.float(), b.float())
    elif _dtype_mm_supported("addmm"):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # this torch lacks addmm(out_dtype=): fp32 products over row slices of at most 64 MiB
        step = max(1, (64 * 2**20) // (4 * b.shape[1]))
        for r in range(0, a.shape[0], step):
            acc[r : r + step] += torch.mm(a[r : r + step].float(), b.float())


# --------------------------------------------------------------------------- launches


def _dummy(device: torch.device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=device)


def tma_supported(dtype: torch.dtype, dim: int, device: torch.device) -> bool:
    """Whether the gemm route can take TMA loads for ``[*, dim]`` operands of ``dtype`` on
    ``device``: 16-bit, rows a multiple of 16 bytes, compute capability 9.0+ (or the interpreter).
    A function of the dtype, D and device only, so every row of a given head takes the same path."""
    if dtype not in (torch.bfloat16, torch.float16) or (dim * 2) % 16:
        return False
    if interpreting():
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def canonical_layout(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy when it is strided or its base is not 16-byte aligned.

    Triton specializes a kernel on unit strides and aligned pointers, and the register layout it
    then picks sets the order of in-kernel reductions; TMA descriptors need this layout too. The
    chunk drivers' entry points pass ``hidden`` and ``weight`` through it, so a strided view gives
    the bits of its contiguous copy (the public ops already pass contiguous tensors: no copy)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _gemm_operands(x: torch.Tensor, weight: torch.Tensor, cfg: TileConfig, from_logits: bool) -> tuple[object, object, bool]:
    """``(x, weight, tma)``: tensor descriptors of the tile blocks when ``cfg.tma`` applies, else the tensors."""
    if from_logits or not cfg.tma or not tma_supported(weight.dtype, weight.shape[1], weight.device):
        return x, weight, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]), True)


def _grid(work: int, cfg: TileConfig, device: torch.device, from_logits: bool) -> tuple[int]:
    """One program per work unit, or one per SM for a persistent gemm-route launch."""
    if not cfg.persistent or from_logits:
        return (work,)
    if device.type != "cuda" or interpreting():
        return (min(work, _INTERPRETER_PROGRAMS),)
    return (min(work, torch.cuda.get_device_properties(device).multi_processor_count),)


def _common_flags(weight: torch.Tensor, bias: Optional[torch.Tensor], cfg: TileConfig, tma: bool) -> dict:
    return dict(
        HAS_BIAS=bias is not None, EVEN_K=weight.shape[1] % cfg.block_k == 0, IEEE=weight.dtype == torch.float32,
        UPCAST_DOT=interpreting(), TMA=tma, FLATTEN=cfg.persistent,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def launch_stats(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    rows: int, inv_temp: float, ignore_index: int, partials: torch.Tensor, ztgt: torch.Tensor,
    from_logits: bool, want_entropy: bool,
) -> None:
    """Tile statistics of ``rows`` rows into ``partials [3, >=rows, n_tiles]`` and ``ztgt [>=rows]``
    (``partials[2]``, the entropy statistic, only with ``want_entropy``).

    ``x`` is ``hidden [rows, D]`` (gemm route) or an fp32 logits chunk ``[>=rows, V]`` (chunked).
    """
    vocab, dim = weight.shape
    cfg = TUNING.tiles(weight.dtype, weight.device, from_logits)
    n_tiles = triton.cdiv(vocab, cfg.block_n)
    grid = _grid(triton.cdiv(rows, cfg.block_m) * n_tiles, cfg, x.device, from_logits)
    dummy = _dummy(x.device)
    xs, ws, tma = _gemm_operands(x[:rows], weight, cfg, from_logits)
    _logits_pass_kernel[grid](
        xs, ws, bias if bias is not None else dummy, targets,
        rows, vocab, dim,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        inv_temp, ignore_index,
        partials[0], partials[1], partials[2], ztgt, partials.stride(1),
        dummy, dummy, dummy, dummy, dummy, 0,
        1, grid[0],
        FROM_LOGITS=from_logits, GRAD=False, HAS_GENT=False, WANT_ENT=want_entropy, IN_PLACE=False, **_common_flags(weight, bias, cfg, tma),
    )


def launch_merge(
    partials: torch.Tensor, ztgt: torch.Tensor, targets: torch.Tensor, rows: int, n_tiles: int,
    ignore_index: int, lp: torch.Tensor, ent: Optional[torch.Tensor], lse: torch.Tensor,
) -> None:
    """Merge ``rows`` rows of tile statistics into ``lp``, ``lse`` and, unless None, ``ent`` (fp32 ``[rows]``)."""
    grid = (triton.cdiv(rows, _MERGE_BLOCK_R),)
    _merge_kernel[grid](
        partials[0], partials[1], partials[2], ztgt, targets, lp, lp if ent is None else ent, lse,
        rows, n_tiles, partials.stride(1), ignore_index,
        WANT_ENT=ent is not None, BLOCK_R=_MERGE_BLOCK_R, BLOCK_T=_MERGE_BLOCK_T, num_warps=4,
    )


def launch_grad(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    rows: int, inv_temp: float, ignore_index: int,
    lse: torch.Tensor, ent: Optional[torch.Tensor], g_lp: torch.Tensor, g_ent: Optional[torch.Tensor],
    dl: torch.Tensor, from_logits: bool,
) -> None:
    """Write ``dl[:rows]`` (``[rows, V]``, ``dl``'s dtype) from recomputed or stored logits.

    ``g_lp`` / ``g_ent`` are fp32 upstream gradients (``g_ent`` None: no entropy term; ``ent``
    is then unused). With ``from_logits`` the pass reads the fp32 chunk ``x``; ``dl`` may alias
    it: ``x`` itself (fp32 inputs), or a 2-byte view with ``x``'s byte row stride, for which each
    program then sweeps whole rows in ascending column order.
    """
    vocab, dim = weight.shape
    cfg = TUNING.tiles(weight.dtype, weight.device, from_logits, grad=True)
    n_tiles = triton.cdiv(vocab, cfg.block_n)
    # a narrower dl written over wider logits lands on bytes other threads have yet to read
    in_place = from_logits and dl.data_ptr() == x.data_ptr() and dl.element_size() != x.element_size()
    per_prog = n_tiles if in_place else 1
    grid = _grid(triton.cdiv(rows, cfg.block_m) * triton.cdiv(n_tiles, per_prog), cfg, x.device, from_logits)
    has_gent = g_ent is not None
    dummy = _dummy(x.device)
    xs, ws, tma = _gemm_operands(x[:rows], weight, cfg, from_logits)
    _logits_pass_kernel[grid](
        xs, ws, bias if bias is not None else dummy, targets,
        rows, vocab, dim,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        inv_temp, ignore_index,
        dummy, dummy, dummy, dummy, 0,
        lse, ent if has_gent else dummy, g_lp, g_ent if has_gent else dummy, dl, dl.stride(0),
        per_prog, grid[0],
        FROM_LOGITS=from_logits, GRAD=True, HAS_GENT=has_gent, WANT_ENT=False, IN_PLACE=in_place, **_common_flags(weight, bias, cfg, tma),
    )


# --------------------------------------------------------------------------- chunk drivers


class ChunkBuffers:
    """The fixed-size work buffers of one forward, backward or loss pass, reused for every chunk.

    ``rows`` is the chunk height; ``partials``/``ztgt`` hold one chunk's tile statistics; on the
    chunked route ``logits`` is the fp32 ``[rows, V]`` chunk and ``dl`` overwrites it in place;
    on the gemm route ``dl`` (when needed) is its own ``[rows, V]`` buffer in ``hidden``'s dtype.

    The per-chunk passes are :meth:`stats` and :meth:`grad_pass` (Triton kernels here); a
    subclass may replace them (the native backend's CUDA pass does) and inherits the chunking,
    the padding and the buffers; :meth:`route_for` names the route its passes need.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, route: str, need_dl: bool) -> None:
        vocab, dim = weight.shape
        dev, dt = hidden.device, hidden.dtype
        self.route = route
        self.n_tiles = triton.cdiv(vocab, TUNING.tiles(dt, dev, route == "chunked").block_n)
        self.logits = self.h_pad = self.dl = None
        if route == "chunked":
            self.rows = chunk_rows(vocab, 4)
            self.logits = torch.empty(self.rows, vocab, dtype=torch.float32, device=dev)
            self.h_pad = torch.empty(self.rows, dim, dtype=dt, device=dev)
            self.dl = self.logits if dt == torch.float32 else self.logits.view(dt)[:, :vocab]
        elif need_dl:
            self.rows = chunk_rows(vocab, hidden.element_size())
            self.dl = torch.empty(self.rows, vocab, dtype=dt, device=dev)
        else:
            self.rows = stats_rows(self.n_tiles)
        self.partials = torch.empty(3, self.rows, self.n_tiles, dtype=torch.float32, device=dev)
        self.ztgt = torch.empty(self.rows, dtype=torch.float32, device=dev)

    def source(self, hidden: torch.Tensor, weight: torch.Tensor, r0: int, n: int) -> torch.Tensor:
        """What the pass reads for rows ``[r0, r0+n)``: hidden rows (gemm route) or their fp32
        logits computed by cuBLAS on the fixed ``[rows, D]`` shape, zero-padded (chunked route)."""
        if self.route != "chunked":
            return hidden[r0 : r0 + n]
        self.h_pad[:n].copy_(hidden[r0 : r0 + n])
        if n < self.rows:
            self.h_pad[n:].zero_()
        mm_fp32_into(self.h_pad, weight.t(), self.logits)
        return self.logits

    def stats(
        self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor, n: int,
        inv_temp: float, ignore_index: int, lp: torch.Tensor, ent: Optional[torch.Tensor], lse: torch.Tensor,
    ) -> None:
        """Tile statistics of ``n`` rows of ``x`` merged into ``lp``/``ent``/``lse`` (``[n]`` views; ``ent`` may be None)."""
        launch_stats(x, weight, bias, targets, n, inv_temp, ignore_index, self.partials, self.ztgt, self.route == "chunked", ent is not None)
        launch_merge(self.partials, self.ztgt, targets, n, self.n_tiles, ignore_index, lp, ent, lse)

    def grad(
        self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor, n: int,
        inv_temp: float, ignore_index: int, lse: torch.Tensor, ent: Optional[torch.Tensor],
        g_lp: torch.Tensor, g_ent: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """``dl`` of ``n`` rows of ``x`` on the fixed ``[rows, V]`` shape (rows past ``n`` zero)."""
        self.grad_pass(x, weight, bias, targets, n, inv_temp, ignore_index, lse, ent, g_lp, g_ent)
        if n < self.rows:
            self.dl[n:].zero_()
        return self.dl

    def grad_pass(
        self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor, n: int,
        inv_temp: float, ignore_index: int, lse: torch.Tensor, ent: Optional[torch.Tensor],
        g_lp: torch.Tensor, g_ent: Optional[torch.Tensor],
    ) -> None:
        """Write ``self.dl[:n]`` from ``n`` rows of ``x`` (arguments as :meth:`grad`)."""
        launch_grad(x, weight, bias, targets, n, inv_temp, ignore_index, lse, ent, g_lp, g_ent, self.dl, self.route == "chunked")

    @staticmethod
    def route_for(hidden: torch.Tensor) -> str:
        """The route of every pass over ``hidden``: :meth:`Tuning.route_for`."""
        return TUNING.route_for(hidden)


def forward_stats(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    inv_temp: float, ignore_index: int, route: str, want_entropy: bool, buffers: type[ChunkBuffers] = ChunkBuffers,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(logprob, entropy or None, lse)``, fp32 ``[N]``; nothing ``[N, V]`` is ever held.

    ``buffers``: the :class:`ChunkBuffers` class whose per-chunk passes run."""
    n_rows = hidden.shape[0]
    lp = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    ent = torch.empty_like(lp) if want_entropy else None
    lse = torch.empty_like(lp)
    buf = buffers(hidden, weight, route, need_dl=False)
    for r0 in range(0, n_rows, buf.rows):
        n = min(buf.rows, n_rows - r0)
        sl = slice(r0, r0 + n)
        buf.stats(
            buf.source(hidden, weight, r0, n), weight, bias, targets[sl], n, inv_temp, ignore_index,
            lp[sl], None if ent is None else ent[sl], lse[sl],
        )
    return lp, ent, lse


class GradSink:
    """Consumes each chunk's ``dl``: ``dh`` rows, the ``dW`` accumulator and ``db``."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, need_h: bool, need_w: bool, need_b: bool) -> None:
        self.hidden, self.weight = hidden, weight
        self.dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
        acc_dtype = torch.float32 if TUNING.wgrad_fp32 else weight.dtype
        self.dw = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        self.db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        self._dh_tmp: Optional[torch.Tensor] = None

    def add(self, dl: torch.Tensor, r0: int, n: int) -> None:
        """Consume ``dl [rows, V]`` (rows past ``n`` zero) belonging to hidden rows ``[r0, r0+n)``."""
        rows = dl.shape[0]
        if self.dh is not None:
            if n == rows:
                torch.mm(dl, self.weight, out=self.dh[r0 : r0 + n])
            else:  # the same [rows, D] product shape as every other chunk: a row's dh must not depend on N
                if self._dh_tmp is None:
                    self._dh_tmp = torch.empty(rows, self.weight.shape[1], dtype=self.dh.dtype, device=dl.device)
                torch.mm(dl, self.weight, out=self._dh_tmp)
                self.dh[r0 : r0 + n].copy_(self._dh_tmp[:n])
        if self.dw is not None:
            addmm_acc_(self.dw, dl[:n].t(), self.hidden[r0 : r0 + n])
        if self.db is not None:
            self.db += dl[:n].sum(dim=0, dtype=torch.float32)

    def grads(self, scale: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], ...]:
        """``(dh, dW, db)`` in the inputs' dtypes (None where not needed), times ``scale`` if given."""
        out = []
        for g, like in ((self.dh, self.hidden), (self.dw, self.weight), (self.db, self.weight)):
            if g is not None:
                if scale is not None:
                    g = g * scale.to(g.dtype)
                g = g.to(like.dtype)
            out.append(g)
        return tuple(out)


def backward_chunks(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
    lse: torch.Tensor, ent: Optional[torch.Tensor], g_lp: torch.Tensor, g_ent: Optional[torch.Tensor],
    inv_temp: float, ignore_index: int, route: str, sink: GradSink, buffers: type[ChunkBuffers] = ChunkBuffers,
) -> None:
    """Recompute each chunk's logits, form ``dl`` (``buffers``' pass) and hand it to ``sink``."""
    n_rows = hidden.shape[0]
    buf = buffers(hidden, weight, route, need_dl=True)
    for r0 in range(0, n_rows, buf.rows):
        n = min(buf.rows, n_rows - r0)
        sl = slice(r0, r0 + n)
        dl = buf.grad(
            buf.source(hidden, weight, r0, n), weight, bias, targets[sl], n, inv_temp, ignore_index,
            lse[sl], None if ent is None else ent[sl], g_lp[sl], None if g_ent is None else g_ent[sl],
        )
        sink.add(dl, r0, n)
