"""The Triton backend's tile and tuning tables, in one place: block sizes, warps and stages of every
kernel launch that the kernel modules take from a named table or constant, and the defaults of the
chunked linear ops' Triton choices (the ``LINEAR_*`` tables, which a
:class:`~rl_kernel_core.linear.chunks.LinearTuning` field replaces at run time:
:func:`rl_kernel_core.linear.triton_tile.linear`).

A tile is part of a kernel's numerical result wherever it sets a summation order (the attention and
matmul tiles, the vocab blocks of the log-prob and sampling passes): changing a value here changes
bits, so each value is fixed per dtype (and, for the matmul, per device's shared memory), never per
call shape. A value chosen by measurement names the committed measurement under
``benchmarks/results/``. The native backend's launch constants are in ``native/csrc/tuning.h``.
"""

from __future__ import annotations


import torch

from rl_kernel_core.tiles import TileConfig

# --- varlen_attention (triton/attention.py) -------------------------------------------------------

TILES: dict[torch.dtype, tuple[int, int, int, int]] = {
    torch.float32: (32, 32, 4, 2),
    torch.bfloat16: (64, 64, 4, 2),
    torch.float16: (64, 64, 4, 2),
}
"""Attention forward (``_attention_fwd_kernel``): ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` per
dtype; never a function of the sequence lengths."""

BWD_TILES: dict[torch.dtype, tuple[tuple[int, int, int, int], tuple[int, int, int, int]]] = {
    torch.float32: ((32, 32, 8, 2), (32, 32, 8, 2)),
    torch.bfloat16: ((64, 32, 4, 2), (32, 64, 4, 2)),
    torch.float16: ((64, 32, 4, 2), (32, 64, 4, 2)),
}
"""Attention backward (``_attention_bwd_kernel``) tiles per dtype, ``(BLOCK_M, BLOCK_N, num_warps,
num_stages)`` of the dq pass (a program holds ``BLOCK_M`` queries and steps over keys ``BLOCK_N`` at
a time) and of the dk/dv pass (a program holds ``BLOCK_N`` keys and steps over queries ``BLOCK_M`` at
a time). 16-bit: the fastest of ``benchmarks/bench_attention.py --sweep`` at head_dim 128 (bf16,
``benchmarks/results/attention_h200/``); fp16 follows bf16, fp32 ptxas's register report. Any choice
gives correct, deterministic gradients."""

ATTENTION_INTERPRETED_TILES: tuple[int, int] = (16, 16)
"""``(BLOCK_M, BLOCK_N)`` of the attention forward and both backward passes under the Triton
interpreter (CPU tests), with the interpreter's default warps and stages."""

# --- batch-invariant ops (triton/batch_invariant.py) ----------------------------------------------

MATMUL_TILES: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.float32: (64, 64, 32, 4, 3),
    torch.bfloat16: (128, 256, 64, 8, 4),
    torch.float16: (128, 256, 64, 8, 4),
}
"""Persistent matmul (``_persistent_matmul_kernel``): ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
num_stages)`` per input dtype; never a function of N. The 16-bit tile is the fastest of
``benchmarks/sweep_bi_matmul_tiles.py``'s candidates over a Qwen3-0.6B layer's products and LM head
at 8192 rows; its pipeline needs 192 KiB of shared memory per block, more than GPUs
before Hopper have (A100: 163 KiB), which take :data:`COMPACT_MATMUL_TILES` instead (see
:func:`rl_kernel_core.batch_invariant_mode.triton.matmul_tile`)."""

COMPACT_MATMUL_TILES: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.float32: (64, 64, 32, 4, 3),
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
}
"""The persistent matmul's tiles (fields as :data:`MATMUL_TILES`) for GPUs whose shared memory per
block cannot hold :data:`MATMUL_TILES`' pipeline."""

TMA_MATMUL_TILES: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.bfloat16: (128, 256, 64, 8, 3),
    torch.float16: (128, 256, 64, 8, 3),
}
"""The TMA matmul's tiles (``_tma_matmul_kernel``, 16-bit inputs on Hopper; fields as
:data:`MATMUL_TILES`): the same blocks as :data:`MATMUL_TILES`', so the same k steps, with three
stages (its epilogue's half-tile buffer shares the shared memory). The fastest of
``benchmarks/sweep_bi_matmul_tiles.py``'s candidates over a Qwen3-1.7B layer's products in the
three layouts of a training step (``benchmarks/results/bi_matmul_h200/``)."""

TMA_WEIGHT_GRAD_NARROW_TILES: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.bfloat16: (128, 128, 64, 4, 4),
    torch.float16: (128, 128, 64, 4, 4),
}
"""The TMA matmul's tile (fields as :data:`MATMUL_TILES`) for a weight gradient (a column-major left
operand) whose output :data:`TMA_MATMUL_TILES` would cover with fewer full waves of programs than
this tile does (``batch_invariant.tma_tile``): a layer with few output features, whose product has
too few 128x256 tiles for the SMs. The same ``BLOCK_K``, so the same k steps and bits. Where both
tiles fill their waves alike, the wider one is faster and stays
(``benchmarks/results/bi_matmul_h200/graph_timing/``)."""

TMA_MIN_ROWS: int = 4096
"""Products with at least this many rows take the TMA kernel, fewer the pointer kernel (Hopper,
16-bit): the TMA kernel is the faster from about this many rows on, the pointer kernel below
(``benchmarks/results/bi_matmul_h200/``). Both kernels take the same k steps from the same blocks, and a GPU test asserts their bits equal
(``tests/core/batch_invariant_mode/test_bi_matmul.py``), so a row's bits do not depend on the side it falls."""

TMA_MIN_WEIGHT_GRAD_K: int = 2048
"""A product whose left operand is column-major (a weight gradient ``g.T @ x``: its rows are the
layer's output features, its reduction runs over the tokens) takes the TMA kernel from this many
summed rows K, whatever its row count: the pointer kernel reads such an operand with strided loads,
slower than the TMA kernel from about this K on (``benchmarks/results/bi_matmul_h200/weight_grad_rule/``).
The bits are the same either way."""

TMA_MIN_ROWS_INTERPRETED: int = 16
""":data:`TMA_MIN_ROWS` and :data:`TMA_MIN_WEIGHT_GRAD_K` under the Triton interpreter: small, so
the CPU tests' batches cross them."""

MATMUL_INTERPRETED_TILES: tuple[int, int, int] = (16, 32, 16)
"""``(BLOCK_M, BLOCK_N, BLOCK_K)`` of the persistent matmul under the Triton interpreter (CPU
tests): small so interpreted programs stay fast."""

MATMUL_GROUP_M: int = 8
"""``GROUP_M`` of the persistent matmul: row blocks that sweep the columns together (grouped order,
``grouped_tile``)."""

GROUPED_WEIGHT_GRAD_TILE: tuple[int, int, int, int, int] = (64, 64, 32, 4, 3)
"""``(BLOCK_N, BLOCK_K, BLOCK_R, num_warps, num_stages)`` of ``bi_grouped_linear``'s weight-gradient
kernel: one program per ``BLOCK_N x BLOCK_K`` block of one expert's gradient, summing that expert's
rows ``BLOCK_R`` at a time. Not measured against other tiles yet."""

GROUPED_WEIGHT_GRAD_INTERPRETED_TILE: tuple[int, int, int] = (16, 16, 16)
""":data:`GROUPED_WEIGHT_GRAD_TILE`'s blocks under the Triton interpreter (CPU tests)."""

ROW_BLOCK: int = 1024
"""Columns per step of the batch-invariant row reductions (``_row_stats_kernel``: ``bi_mean``,
``bi_log_softmax``, ``rms_norm``); the same for every row count."""

INTERPRETED_ROW_BLOCK: int = 64
""":data:`ROW_BLOCK` under the Triton interpreter (CPU tests)."""

# --- linear_logprob / fused_linear_policy_loss passes (triton/linear_*.py) ------------------------

LINEAR_GEMM_TILES = TileConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3, tma=True, persistent=True)
"""Tile of the gemm route's statistics pass for 16-bit inputs on a GPU (``LinearTuning.gemm_tiles``
replaces it): TMA loads and a persistent launch (``benchmarks/results/linear_h200/tiles/``)."""

LINEAR_GEMM_GRAD_TILES = TileConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3)
"""Tile of the gemm route's gradient pass for 16-bit inputs on a GPU (``LinearTuning.gemm_grad_tiles``
replaces it): pointer loads, one program per tile; the pass stores a 16-bit ``dl`` tile, and TMA
loads with a persistent launch measured no faster
(``benchmarks/results/linear_h200/profile_keep_experiments/tma_store.json``)."""

LINEAR_STATS_BYTES: int = 128 * 2**20
"""Budget of the gemm-route forward's tile-statistics buffers (``LinearTuning.stats_bytes``)."""

LINEAR_LOSS_KEEPS_LOGITS_FROM_DIM: int = 2048
"""``fused_linear_policy_loss`` keeps each chunk's logits for its gradient pass from this ``D`` on
(``LinearTuning.loss_keeps_logits_from_dim``): writing and reading the fp32 logits costs about the
same at every ``D``, the matrix product it saves grows with ``D``
(``benchmarks/results/linear_h200/profile_8e69d6e/``)."""

LINEAR_SM90: str = "auto"
"""Which gemm-route passes run the Hopper CUDA kernels (``LinearTuning.sm90``): every one, as each
measured at least as fast as its Triton pass (``benchmarks/results/linear_h200/epilogue/``)."""

LINEAR_SM90_TILE: tuple[int, int, int, int] = (128, 256, 64, 8)
"""``(block_m, block_n, block_k, num_warps)``: the one Triton tile whose passes the Hopper CUDA
kernels reproduce (``kSm90BlockM``/``N``/``K`` and ``kSm90Consumers`` warpgroups in
``native/csrc/tuning.h``): the statistics' vocab partition and the thread layout whose order the
sums follow. Another tile runs the Triton passes."""

LINEAR_INTERPRETER_TILES = TileConfig(32, 64, 32, group_m=4, num_warps=4, num_stages=1)
"""Tile of the linear statistics and gradient passes (``_stats_kernel``, ``_grad_kernel``) under
the Triton interpreter or off CUDA, both routes; ``tma`` and ``persistent`` follow the tuning's
gemm tile."""

LINEAR_INTERPRETER_PROGRAMS: int = 3
"""Programs of a persistent launch under the interpreter: few, so each walks several units."""

LINEAR_FP32_TILES = TileConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=3)
"""Tile of the gemm route's passes for fp32 inputs on a GPU (16-bit inputs take
:func:`linear`'s ``gemm_tiles`` / ``gemm_grad_tiles``)."""

LINEAR_MEMORY_PASS_TILES = TileConfig(1, 2048, 16, group_m=1, num_warps=8, num_stages=1)
"""Tile of the chunked route's passes on a GPU, which read an fp32 logits chunk (one row,
``BLOCK_N`` vocab columns per program)."""


MERGE_BLOCK_R: int = 16
"""Rows per program of the gemm route's statistics merge (``_merge_kernel``), and the fewest rows
of a statistics chunk (``stats_rows``)."""

MERGE_BLOCK_T: int = 64
"""Vocab tiles per step of the statistics merge (``_merge_kernel``)."""

# --- logprob_from_logits (logprob/triton.py) and sample (sampling/triton.py) ----------

LOGPROB_MAX_BLOCK_V: int = 4096
"""Largest ``BLOCK_V`` (vocab columns per step) of the log-prob backward, and the default cap of
``_block_v``."""

FWD_TILE: tuple[int, int] = (4096, 4)
"""The log-prob forward's ``(largest BLOCK_V, num_warps)``, one for both entropy settings so a row's
log-prob has the same bits with and without entropy (the old/ref passes skip the entropy, the
training pass asks for it; on-policy ratios must then be exactly 1). The fastest over the sum
of both settings in ``benchmarks/sweep_logprob_from_logits.py``
(``benchmarks/results/sweep_logprob_from_logits_h100.json``). The sampler's block scan and
gather passes take the same vocab block and warps."""

GATHER_PART: int = 512
"""Logits per step of the sampler's gather pass after its whole-block log-sum-exp term (fewer live
registers, more programs per SM)."""

RANK_TILE: tuple[int, int, int] = (128, 4096, 8)
"""``(SMALL, PAIR_TILE, num_warps)`` of the sampler's finish (``_finish_kernel``): candidate lists of
at most ``SMALL`` are ranked in a tile of that size, longer ones in one of ``CANDIDATES``
(:mod:`rl_kernel_core.sampling.triton`); a step compares every candidate with ``PAIR_TILE / size``
others."""

EXACT_TILE: tuple[int, int, int, int] = (1024, 8, 2048, 8)
"""``(SEARCH_BLOCK, PIVOTS, DRAW_BLOCK, num_warps)`` of the sampler's exact path (``_exact_kernel``):
a search pass reads ``SEARCH_BLOCK`` logits per step against ``PIVOTS`` keys, the whole-row draw
``DRAW_BLOCK``."""

SAMPLING_SCAN_WARPS: int = 4
"""Warps of the sampler's block scan (``_block_scan_kernel``): its programs read one block each, so
many small programs per SM."""

SAMPLING_PLAN_WARPS: int = 8
"""Warps of the sampler's row plan (``_row_plan_kernel``)."""

# --- losses and advantages (loss/triton.py, advantages/triton.py) ---------------------------------

LOSS_ELEMENTWISE_BLOCK: int = 1024
"""Elements per program of the ratio/KL kernel (``_ratio_kl_kernel``)."""

ADVANTAGES_MAX_BLOCK: int = 1024
"""Largest ``BLOCK`` (rewards per step) of the group-advantage kernel (``_group_advantages_kernel``)."""
